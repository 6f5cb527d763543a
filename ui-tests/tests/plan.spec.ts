/**
 * The fix plan from the sidebar, in Chromium against a real JupyterLab and kernel (CPU mode, with
 * `--limit` emulating a 24 MiB card): a training cell runs out of memory, the card lists the plan,
 * "Run with this fix" has the kernel run the cell with it, the card says "fits" and the cell's red
 * error line is gone; ✕ on the fix runs the cell without it again. The same red line also goes when
 * the fit came from the report's own button.
 */
import { readFileSync } from 'node:fs';
import { join } from 'node:path';

import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import { Locator } from '@playwright/test';

import { collectErrors, openPanel, SHOTS, writeCell } from './helpers';

// The cell of `tests/test_comm.py` (OOM_CELL), failing as a person would see it: no --no-raise.
const OOM_CELL = [
  '%%gpumem --limit 24MiB',
  'import torch',
  'batch_size = 64',
  'model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))',
  'opt = torch.optim.SGD(model.parameters(), lr=0.1)',
  'for _ in range(2):',
  '    x = torch.randn(batch_size, 64, 256)',
  '    model(x).square().mean().backward()',
  '    opt.step()',
  '    opt.zero_grad()'
].join('\n');

// The red line of an error output (JupyterLab renders `error` outputs with the stderr mime type).
const RED_LINE = '[data-mime-type="application/vnd.jupyter.stderr"]';

// Galata's kernel API mock answers every POST as a creation (201); the real kernels are wanted here.
test.use({ kernels: null });

/** A notebook with `%load_ext oommagic` and the failing cell, both run; the failing cell's locator. */
async function failingCell(
  page: IJupyterLabPageFixture,
  name: string
): Promise<Locator> {
  await page.notebook.createNew(name);
  await page.notebook.setCell(0, 'code', '%load_ext oommagic');
  await page.notebook.addCell('code', 'pass');
  await writeCell(page, 1, OOM_CELL);
  await page.notebook.runCell(0);
  await page.notebook.runCell(1);
  const cell = (await page.notebook.getCellLocator(1))!;
  await expect(cell.locator('.oommagic-report')).toBeVisible();
  await expect(cell.locator(RED_LINE)).toContainText('OutOfMemoryError');
  return cell;
}

test.describe('the fix plan in the sidebar', () => {
  test('"Run with this fix" makes the card fit and takes the red line away; ✕ removes the fix', async ({
    page
  }) => {
    const errors = collectErrors(page);
    const cell = await failingCell(page, 'plan.ipynb');
    const panel = await openPanel(page);
    const failed = panel.locator('.oommagic-run-oom');

    await test.step('the card lists the plan, the recommended fix first', async () => {
      await expect(failed).toHaveCount(1);
      const first = failed.locator('.oommagic-plan-entry').first();
      await expect(first).toHaveClass(/oommagic-plan-recommended/);
      await expect(first.locator('.oommagic-plan-line')).toHaveText(
        /^fits — peak [\d.]+ (KiB|MiB) of 24\.00 MiB/
      );
      await expect(first.locator('.oommagic-run-fix-primary')).toHaveText(
        'Run with this fix'
      );
      await failed.screenshot({ path: `${SHOTS}/plan-01-oom-card.png` });
    });

    await test.step('"Run with this fix": the new run fits and the red line is gone', async () => {
      await failed.locator('.oommagic-run-fix-primary').click();
      const fits = panel.locator('.oommagic-run-fits');
      await expect(fits).toHaveCount(1, { timeout: 120_000 });
      await expect(fits.locator('.oommagic-status')).toHaveText('fits');
      await expect(fits.locator('.oommagic-run-fits-line')).toContainText(
        /^fits with .+: peak [\d.]+ (KiB|MiB) of 24\.00 MiB$/
      );
      await expect(fits.locator('.oommagic-applied-fix')).toHaveCount(1);
      await expect(cell.locator(RED_LINE)).toHaveCount(0);
      // The report in the cell stays; only the stale error went.
      await expect(cell.locator('.oommagic-report')).toBeVisible();
      await fits.screenshot({ path: `${SHOTS}/plan-02-fits-card.png` });
      await page.screenshot({ path: `${SHOTS}/plan-03-fits-notebook.png` });
    });

    await test.step('✕ runs the cell without the fix: out of memory again', async () => {
      const fits = panel.locator('.oommagic-run-fits');
      const remove = fits.locator('.oommagic-remove-fix');
      await expect(remove).toHaveAttribute(
        'title',
        /^Run the cell again without /
      );
      await remove.click();
      const again = panel.locator('.oommagic-run-oom');
      await expect(again).toHaveCount(1, { timeout: 120_000 });
      await expect(again.locator('.oommagic-applied')).toHaveCount(0);
      await expect(again.locator('.oommagic-plan-entry').first()).toBeVisible();
      await expect(panel.locator('.oommagic-run-retried')).toHaveCount(2);
      await page.screenshot({ path: `${SHOTS}/plan-04-fix-removed.png` });
    });

    expect(errors).toEqual([]);
  });

  test("the red line also goes when the fit came from the report's own button", async ({
    page
  }) => {
    const cell = await failingCell(page, 'widget.ipynb');
    await cell.locator('.oommagic-report .oommagic-fix').first().click();
    await expect(cell.locator('.oommagic-retry-ok')).toBeVisible({
      timeout: 120_000
    });
    await expect(cell.locator(RED_LINE)).toHaveCount(0);
    const panel = await openPanel(page);
    await expect(panel.locator('.oommagic-run-fits')).toHaveCount(1);
  });

  test('memory by category and the ranks of a newer kernel are drawn on the card', async ({
    page
  }) => {
    // The run Python wrote for the contract test, with the fields newer kernels add.
    const runs = JSON.parse(
      readFileSync(
        join(__dirname, '../../labextension/test/fixtures/cellrun.json'),
        'utf-8'
      )
    );
    const MiB = 2 ** 20;
    const run = {
      ...runs.oom_batch,
      budget: 64 * MiB,
      categories: [
        { key: 'parameters', label: 'parameters', bytes: 8 * MiB },
        { key: 'gradients', label: 'gradients', bytes: 8 * MiB },
        { key: 'optimizer', label: 'optimizer state', bytes: 16 * MiB },
        { key: 'activations', label: 'activations', bytes: 28 * MiB },
        { key: 'cache', label: 'allocator cache', bytes: 4 * MiB }
      ],
      ranks: [0, 1].map(rank => ({
        rank,
        device: `cuda:${rank}`,
        pid: 4242 + rank,
        peak_allocated: 60 * MiB,
        peak_reserved: (62 + rank) * MiB,
        outside: 512 * MiB,
        oom: rank === 1,
        requested: rank === 1 ? 256 * MiB : null,
        first_failed: rank === 1,
        bottleneck: rank === 1
      }))
    };
    await page.notebook.createNew('newer.ipynb');
    await writeCell(
      page,
      0,
      `import json\nfrom comm import create_comm\nc = create_comm(target_name='oommagic', data={'version': 1, 'type': 'hello', 'runs': [json.loads(${JSON.stringify(JSON.stringify(run))})]})`
    );
    await page.notebook.runCell(0);
    const panel = await openPanel(page);
    const card = panel.locator('.oommagic-run');
    await expect(card).toHaveCount(1);
    await expect(
      card.locator('.oommagic-category-bar .oommagic-cat')
    ).toHaveCount(5);
    await expect(card.locator('.oommagic-rank')).toHaveCount(2);
    await expect(card.locator('.oommagic-rank-oom')).toContainText(
      'OOM (asked 256.00 MiB), failed first, bottleneck'
    );
    await card.screenshot({ path: `${SHOTS}/plan-05-categories-ranks.png` });
  });
});
