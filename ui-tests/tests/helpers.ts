/**
 * Helpers shared by the browser tests (not a spec file: Playwright only collects `*.spec.ts`).
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';
import { Locator, Page } from '@playwright/test';

export const SHOTS = 'test-results/screenshots';

/**
 * Put `source` into cell `index` of the current notebook through its model: typing it would let the
 * editor's auto-indent and bracket closing change it.
 */
export async function writeCell(
  page: IJupyterLabPageFixture,
  index: number,
  source: string
): Promise<void> {
  await page.evaluate(
    ([i, text]) => {
      const nb = (window as any).jupyterapp.shell.currentWidget.content;
      nb.widgets[i].model.sharedModel.setSource(text);
    },
    [index, source] as const
  );
}

/** The source of cell `index` of the current notebook, read from its model. */
export async function cellSource(
  page: IJupyterLabPageFixture,
  index: number
): Promise<string> {
  return page.evaluate(i => {
    const nb = (window as any).jupyterapp.shell.currentWidget.content;
    return nb.widgets[i].model.sharedModel.getSource() as string;
  }, index);
}

export async function openPanel(
  page: IJupyterLabPageFixture
): Promise<Locator> {
  await page.sidebar.openTab('oommagic-panel');
  const panel = page.locator('#oommagic-panel');
  await expect(panel).toBeVisible();
  return panel;
}

/**
 * Collect what the page throws (uncaught errors, unhandled rejections) and the console errors that
 * come from or mention oommagic, from now on; the returned array fills as they happen.
 */
export function collectErrors(page: Page): string[] {
  const errors: string[] = [];
  page.on('pageerror', error => {
    errors.push(`pageerror: ${error.message}\n${error.stack ?? ''}`);
  });
  page.on('console', message => {
    if (message.type() !== 'error') {
      return;
    }
    const where = message.location().url;
    if (/oommagic/i.test(message.text()) || /oommagic/i.test(where)) {
      errors.push(`console.error (${where}): ${message.text()}`);
    }
  });
  return errors;
}
