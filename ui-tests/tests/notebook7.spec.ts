/**
 * The same promise in Notebook 7 (the `notebook` package's page, served by the same Jupyter server as the
 * lab): a notebook with a training function in one cell and a `%%gpumem --limit 24MiB` cell that runs out
 * of memory. The report's fix, pressed, runs with the kernel busy, and once it fits the notebook holds
 * what ran (the batch in the failing cell, `train` where it is defined), one undoable edit per cell.
 *
 * Plain Playwright here, not Galata's `page` fixture: that one opens JupyterLab. The notebook is written
 * through the server's contents API, then opened at `/notebooks/<name>` like a person would.
 */
import { expect, test } from '@playwright/test';

import {
  cellSource,
  collectErrors,
  kernelStatus,
  putNotebook,
  SHOTS,
  WRITEBACK_FAILING,
  WRITEBACK_TRAIN
} from './helpers';

const TRAIN = WRITEBACK_TRAIN;
const FAILING = WRITEBACK_FAILING;

const NAME = 'notebook7-writeback.ipynb';

test('Notebook 7: a pressed fix runs with the kernel busy, is written into the cells, and Ctrl+Z takes it back', async ({
  page,
  request
}) => {
  const tree = await request.get('tree');
  test.skip(
    tree.status() === 404,
    'Notebook 7 is not installed in this environment (pip install notebook)'
  );
  const errors = collectErrors(page);
  await putNotebook(request, NAME, [
    '%load_ext oommagic\nimport time, torch',
    TRAIN,
    FAILING
  ]);
  await page.goto(`/notebooks/${NAME}`);
  // Notebook 7's own page (not the lab), with its kernel started and idle.
  await page.waitForFunction(
    () =>
      (window as any).jupyterapp?.shell?.currentWidget?.sessionContext
        ?.kernelDisplayStatus === 'idle',
    undefined,
    { timeout: 120_000 }
  );
  expect(page.url()).toContain('/notebooks/');

  const before = [await cellSource(page, 1), await cellSource(page, 2)];
  await page.evaluate(() =>
    (window as any).jupyterapp.commands.execute('notebook:run-all-cells')
  );
  const cells = page.locator('.jp-Notebook .jp-Cell');
  const report = cells.nth(2).locator('.oommagic-report');
  await expect(report.locator('.oommagic-fix-batch')).toBeVisible({
    timeout: 120_000
  });
  await page.screenshot({ path: `${SHOTS}/notebook7-01-report.png` });

  await test.step('pressed: the kernel shows busy, the fix fits', async () => {
    await report.locator('.oommagic-fix-batch').click();
    await expect.poll(() => kernelStatus(page)).toBe('busy');
    await expect(report.locator('.oommagic-fix-batch')).toBeDisabled();
    await expect(report.locator('.oommagic-retry-ok')).toBeVisible({
      timeout: 120_000
    });
    await expect.poll(() => kernelStatus(page)).toBe('idle');
  });

  await test.step('the cells hold what ran', async () => {
    await expect.poll(() => cellSource(page, 2)).not.toBe(before[1]);
    const defs = await cellSource(page, 1);
    const failing = await cellSource(page, 2);
    expect(defs).toMatch(/^def train\(model, opt, batch_size\):/);
    expect(defs).not.toBe(before[0]);
    expect(failing.split('\n')[0]).toBe('%%gpumem --limit 24MiB');
    expect(failing).not.toContain('def train');
    expect(failing).toMatch(/^batch_size = \d+$/m);
    expect(failing).not.toContain('batch_size = 64');
    await expect(report.locator('.oommagic-written')).toHaveText(
      'Written into the notebook: Ctrl+Z in a changed cell undoes it.'
    );
    await page.screenshot({ path: `${SHOTS}/notebook7-02-written.png` });
  });

  await test.step('Ctrl+Z in each changed cell brings its text back', async () => {
    for (const [i, original] of [
      [2, before[1]],
      [1, before[0]]
    ] as const) {
      await cells.nth(i).locator('.cm-content').click();
      await page.keyboard.press('Control+z');
      await expect.poll(() => cellSource(page, i)).toBe(original);
    }
  });
  // Notebook 7.6.5 throws "Cannot read properties of undefined (reading 'schema')" from its own
  // shortcuts plugin on its pages, with this extension disabled too: only ours count here.
  expect(errors.filter(error => /oommagic/i.test(error))).toEqual([]);

  await page.evaluate(() =>
    (window as any).jupyterapp.shell.currentWidget.sessionContext.shutdown()
  );
});
