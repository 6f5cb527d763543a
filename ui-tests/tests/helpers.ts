/**
 * Helpers shared by the browser tests (not a spec file: Playwright only collects `*.spec.ts`).
 */
import { expect, IJupyterLabPageFixture } from '@jupyterlab/galata';
import { APIRequestContext, Locator, Page } from '@playwright/test';

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

/** The source of cell `index` of the current notebook (JupyterLab's or Notebook 7's), read from its model. */
export async function cellSource(page: Page, index: number): Promise<string> {
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

/** The current notebook's kernel status as its session reports it ("idle", "busy", ...). */
export function kernelStatus(page: Page): Promise<string> {
  return page.evaluate(
    () =>
      (window as any).jupyterapp.shell.currentWidget.sessionContext
        .kernelDisplayStatus as string
  );
}

/**
 * Write a notebook of code cells `sources` at `path` through the server's contents API, its kernel named
 * (so that no "Select Kernel" dialog covers the page that opens it).
 */
export async function putNotebook(
  request: APIRequestContext,
  path: string,
  sources: string[] = []
): Promise<void> {
  const cells = sources.map(source => ({
    cell_type: 'code',
    execution_count: null,
    metadata: {},
    outputs: [],
    source
  }));
  const response = await request.put(`api/contents/${path}`, {
    data: {
      type: 'notebook',
      format: 'json',
      content: {
        cells,
        metadata: {
          kernelspec: {
            name: 'python3',
            display_name: 'Python 3',
            language: 'python'
          }
        },
        nbformat: 4,
        nbformat_minor: 5
      }
    }
  });
  expect(response.ok()).toBe(true);
}

/** A training function of one cell and the `%%gpumem` cell that calls it and runs out of memory (a 24 MiB
 * card): the notebook whose pressed fix is written back into both cells. */
// Each micro-batch first waits a quarter of a second: the pressed fix's run (eight micro-batches) then
// holds the kernel busy for about two seconds, long enough to check every button while it runs (a run of a
// few hundred milliseconds ended between the checks under CI's load, and the sidebar's check failed).
export const WRITEBACK_TRAIN = [
  'def train(model, opt, batch_size):',
  '    for _ in range(2):',
  '        time.sleep(0.25)',
  '        x = torch.randn(batch_size, 64, 256)',
  '        model(x).square().mean().backward()',
  '        opt.step()',
  '        opt.zero_grad()'
].join('\n');

export const WRITEBACK_FAILING = [
  '%%gpumem --limit 24MiB',
  'batch_size = 64',
  'model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))',
  'opt = torch.optim.SGD(model.parameters(), lr=0.1)',
  'train(model, opt, batch_size)'
].join('\n');
