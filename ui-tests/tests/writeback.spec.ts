/**
 * The notebook says what the kernel runs, in Chromium against a real JupyterLab and kernel (CPU mode,
 * `--limit` emulating a 24 MiB card): a training function defined in one cell, called by a cell that
 * runs out of memory. Pressing the report's fix runs it in the kernel (which shows busy, the buttons
 * that would start a second run held), and once it fits the notebook is rewritten: `train` where it
 * is defined, the failing cell's batch in place, one undoable edit each. The report after the failure
 * fits a screen at 1400×900 with no label cut; a kernel restart of a notebook never saved lists no run.
 */
import { expect, test } from '@jupyterlab/galata';

import {
  cellSource,
  kernelStatus,
  collectErrors,
  openPanel,
  SHOTS,
  writeCell,
  WRITEBACK_FAILING,
  WRITEBACK_TRAIN
} from './helpers';

const TRAIN = WRITEBACK_TRAIN;
const FAILING = WRITEBACK_FAILING;

// Galata's kernel API mock answers every POST as a creation (201); the real kernels are wanted here.
test.use({ kernels: null });

test.describe('a fix pressed in the report', () => {
  test('runs with the kernel busy, then is written where the notebook defines it; Ctrl+Z takes it back', async ({
    page
  }) => {
    const errors = collectErrors(page);
    await page.notebook.createNew('writeback.ipynb');
    await page.notebook.setCell(0, 'code', '%load_ext oommagic\nimport time, torch');
    await page.notebook.addCell('code', 'pass');
    await writeCell(page, 1, TRAIN);
    await page.notebook.addCell('code', 'pass');
    await writeCell(page, 2, FAILING);
    for (const i of [0, 1, 2]) {
      await page.notebook.runCell(i);
    }
    const cell = (await page.notebook.getCellLocator(2))!;
    const report = cell.locator('.oommagic-report');
    await expect(report.locator('.oommagic-fix-batch')).toBeVisible();

    await test.step('the report after the failure: one screen, its first fix on it, no label cut', async () => {
      await report.scrollIntoViewIfNeeded();
      await report.evaluate(node => node.scrollIntoView({ block: 'start' }));
      const box = (await report.boundingBox())!;
      const first = (await report
        .locator('.oommagic-fix')
        .first()
        .boundingBox())!;
      const measured = `height ${Math.round(box.height)} px; first fix's button ends ${Math.round(first.y + first.height - box.y)} px below the report's top`;
      test.info().annotations.push({
        type: 'report after the failure at 1400×900',
        description: measured
      });
      console.log(`report after the failure at 1400×900: ${measured}`);
      expect(box.height).toBeLessThanOrEqual(900);
      expect(first.y + first.height - box.y).toBeLessThanOrEqual(600);
      const cut = await report.evaluate(node =>
        [...node.querySelectorAll('button')]
          .filter(b => b.offsetParent !== null && b.scrollWidth > b.clientWidth)
          .map(b => b.textContent)
      );
      expect(cut).toEqual([]);
      await page.screenshot({ path: `${SHOTS}/writeback-01-report.png` });
    });

    const panel = await openPanel(page);
    const before = [await cellSource(page, 1), await cellSource(page, 2)];

    await test.step('pressed: the kernel shows busy and every button that would start a run waits', async () => {
      await expect(panel.locator('.oommagic-apply-batch')).toBeEnabled();
      await report.locator('.oommagic-fix-batch').click();
      await expect.poll(() => kernelStatus(page)).toBe('busy');
      await expect(report.locator('.oommagic-fix-batch')).toBeDisabled();
      await expect(panel.locator('.oommagic-apply-batch')).toBeDisabled();
      await expect(report.locator('.oommagic-retry-ok')).toBeVisible({
        timeout: 120_000
      });
      await expect.poll(() => kernelStatus(page)).toBe('idle');
    });

    await test.step('the notebook holds what ran: train where it is defined, the batch in place', async () => {
      await expect.poll(() => cellSource(page, 2)).not.toBe(before[1]);
      const defs = await cellSource(page, 1);
      const failing = await cellSource(page, 2);
      expect(defs).toMatch(/^def train\(model, opt, batch_size\):/);
      expect(defs).not.toBe(before[0]);
      expect(failing.split('\n')[0]).toBe('%%gpumem --limit 24MiB');
      expect(failing).not.toContain('def train');
      expect(failing).toMatch(/^batch_size = \d+$/m);
      expect(failing).not.toContain('batch_size = 64');
      expect(failing.endsWith('train(model, opt, batch_size)')).toBe(true);
      // The report in the kernel heard back: it no longer tells what to paste.
      await expect(report.locator('.oommagic-written')).toHaveText(
        'Written into the notebook: Ctrl+Z in a changed cell undoes it.'
      );
      await page.screenshot({ path: `${SHOTS}/writeback-02-written.png` });
      // The fitted card offers no second "Apply to cell": the notebook says it already.
      await expect(panel.locator('.oommagic-run-fits')).toHaveCount(1);
      await expect(panel.locator('.oommagic-write-fitted')).toHaveCount(0);
    });

    await test.step('Ctrl+Z in each cell brings its text back', async () => {
      for (const [i, original] of [
        [2, before[1]],
        [1, before[0]]
      ] as const) {
        await page.notebook.enterCellEditingMode(i);
        await page.keyboard.press('Control+z');
        await expect.poll(() => cellSource(page, i)).toBe(original);
      }
      // Undone, the fitted run can be written again from its card.
      await expect(panel.locator('.oommagic-write-fitted')).toHaveCount(1);
    });
    expect(errors).toEqual([]);
  });

  test('a kernel restart clears the live runs; a notebook never saved has no saved runs', async ({
    page
  }) => {
    await page.notebook.createNew('unsaved.ipynb');
    await page.notebook.setCell(0, 'code', '%load_ext oommagic');
    await page.notebook.addCell('code', '%%gpumem\nx = sum(range(1000))');
    await page.notebook.runCell(0);
    await page.notebook.runCell(1);
    const panel = await openPanel(page);
    await expect(panel.locator('.oommagic-run-live')).toHaveCount(1);
    await page.evaluate(async () => {
      await (
        window as any
      ).jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart();
    });
    await expect(panel.locator('.oommagic-run')).toHaveCount(0);
    await expect(panel.locator('.oommagic-runs-empty')).toBeVisible();
  });
});
