/**
 * Pictures of the quickstart (`notebooks/quickstart.ipynb`) as a person sees it at 1400×900 in
 * JupyterLab: the report after the training cell ran out of memory, and after its first fix was
 * pressed, with the GPU Memory sidebar open. Written to `docs/` by `scripts/screenshots.sh`.
 */
import { resolve } from 'node:path';

import { expect, test } from '@jupyterlab/galata';

const QUICKSTART = resolve(__dirname, '../../notebooks/quickstart.ipynb');
const DOCS = resolve(__dirname, '../../docs');

test.use({ kernels: null });

test('the quickstart: the report after the failure and after the fix', async ({
  page,
  tmpPath
}) => {
  test.setTimeout(600_000);
  await page.contents.uploadFile(QUICKSTART, `${tmpPath}/quickstart.ipynb`);
  await page.notebook.openByPath(`${tmpPath}/quickstart.ipynb`);
  await page.notebook.activate('quickstart.ipynb');
  // Run All goes past the failing cell: it is tagged raises-exception.
  await page.notebook.run();
  const failing = page
    .locator('.jp-Cell')
    .filter({ hasText: '%%gpumem --limit $LIMIT' })
    .filter({ hasNotText: '--find-batch' });
  const report = failing.locator('.oommagic-report');
  await expect(report.locator('.oommagic-fix').first()).toBeVisible();
  // The cell's first line at the top of the notebook's view, as when a person scrolls to it.
  await failing.evaluate(node => node.scrollIntoView({ block: 'start' }));
  await page.screenshot({ path: `${DOCS}/quickstart-oom.png` });

  await report.locator('.oommagic-fix').first().click();
  await expect(report.locator('.oommagic-retry-ok')).toBeVisible({
    timeout: 300_000
  });
  await page.sidebar.openTab('oommagic-panel');
  await expect(page.locator('#oommagic-panel .oommagic-run-fits')).toHaveCount(1);
  await failing.evaluate(node => node.scrollIntoView({ block: 'start' }));
  await page.screenshot({ path: `${DOCS}/quickstart-fitted.png` });
});
