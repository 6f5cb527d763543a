/**
 * How a person finds and tunes the panel: one "GPU Memory" command, in the View menu and once in the
 * command palette, opening the right sidebar; its settings applied live; and the same in Notebook 7
 * (served by the same server when the `notebook` package is installed).
 */
import { expect, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import { Page } from '@playwright/test';

import { collectErrors, putNotebook, SHOTS } from './helpers';

const PLUGIN = 'oommagic:plugin';

/** The labels of the command palette's entries that name the GPU memory panel. */
async function paletteEntries(page: Page): Promise<string[]> {
  await page.keyboard.press('Control+Shift+C');
  const input = page.locator('.lm-CommandPalette-input:visible');
  await expect(input).toBeVisible();
  await input.fill('gpu memory');
  const labels = await page
    .locator('.lm-CommandPalette-item:visible .lm-CommandPalette-itemLabel')
    .allInnerTexts();
  await page.keyboard.press('Escape');
  return labels.filter(label => /gpu memory/i.test(label));
}

/** Set one of the panel's settings through the app's setting registry (Galata keeps them in memory). */
async function setSetting(
  page: IJupyterLabPageFixture,
  key: string,
  value: unknown
): Promise<void> {
  await page.evaluate(
    async ([plugin, k, v]) => {
      const registry = await (window as any).galata.getPlugin(
        '@jupyterlab/apputils-extension:settings'
      );
      await registry.set(plugin, k, v);
    },
    [PLUGIN, key, value] as const
  );
}

test.describe('finding the panel in JupyterLab', () => {
  test('View › GPU Memory opens the panel in the right sidebar', async ({
    page
  }) => {
    const errors = collectErrors(page);
    await page.menu.open('View');
    const item = await page.menu.getMenuItemLocator('View>GPU Memory');
    expect(item).not.toBeNull();
    await page.screenshot({ path: `${SHOTS}/09-view-menu.png` });
    await item!.click();
    const panel = page.locator('#oommagic-panel');
    await expect(panel).toBeVisible();
    await expect(
      page.locator('#jp-right-stack').locator('#oommagic-panel')
    ).toHaveCount(1);
    expect(errors).toEqual([]);
  });

  test('the command palette has exactly one entry for it', async ({ page }) => {
    expect(await paletteEntries(page)).toEqual(['GPU Memory']);
  });

  test('its settings apply at once: sections, and no polling with the devices off', async ({
    page
  }) => {
    let requests = 0;
    await page.route('**/oommagic/devices*', async route => {
      requests++;
      await route.fulfill({ status: 404, body: 'Not Found' });
    });
    await page.sidebar.openTab('oommagic-panel');
    const panel = page.locator('#oommagic-panel');
    await expect(panel.locator('.oommagic-devices-section')).toBeVisible();
    await expect(panel.locator('.oommagic-notebook-section')).toBeVisible();

    await setSetting(page, 'showRuns', false);
    await expect(panel.locator('.oommagic-notebook-section')).toHaveCount(0);
    await expect(panel.locator('.oommagic-devices-section')).toBeVisible();

    await setSetting(page, 'showDevices', false);
    await expect(panel.locator('.oommagic-devices-section')).toHaveCount(0);
    await expect(panel.locator('.oommagic-all-hidden')).toBeVisible();
    await page.screenshot({ path: `${SHOTS}/10-settings-all-off.png` });
    // One request may still be in flight when the setting lands.
    const off = requests;
    await page.waitForTimeout(3000);
    expect(requests).toBeLessThanOrEqual(off + 1);

    await setSetting(page, 'showDevices', true);
    await expect(panel.locator('.oommagic-devices-section')).toContainText(
      'not enabled'
    );
    await expect.poll(() => requests).toBeGreaterThan(off + 1);
  });

  test('a setting changed in the settings editor applies to the open panel', async ({
    page
  }) => {
    await page.sidebar.openTab('oommagic-panel');
    const panel = page.locator('#oommagic-panel');
    await expect(panel.locator('.oommagic-devices-section')).toBeVisible();
    await page.evaluate(() =>
      (window as any).jupyterapp.commands.execute('settingeditor:open', {
        query: 'GPU Memory'
      })
    );
    const editor = page.locator('.jp-SettingsPanel');
    await expect(
      editor.getByText('Device refresh interval (ms)')
    ).toBeVisible();
    await expect(editor.getByText('Runs kept per cell')).toBeVisible();

    await editor.getByLabel('Show devices').uncheck();
    await expect(panel.locator('.oommagic-devices-section')).toHaveCount(0);
    await expect(panel.locator('.oommagic-notebook-section')).toBeVisible();
    await page.screenshot({ path: `${SHOTS}/11-settings-editor.png` });
  });
});

test.describe('finding the panel in Notebook 7', () => {
  test('View › GPU Memory opens it in the right sidebar; one palette entry', async ({
    context,
    request
  }) => {
    const tree = await request.get('tree');
    test.skip(
      tree.status() === 404,
      'Notebook 7 is not installed in this environment (pip install notebook)'
    );
    const path = 'notebook7.ipynb';
    await putNotebook(request, path);

    const page = await context.newPage();
    // Tall enough for the whole View menu, which Notebook 7 fills with every extension's items.
    await page.setViewportSize({ width: 1400, height: 1600 });
    const errors = collectErrors(page);
    // The file browser page loads the extension too (no notebook there): it must not break.
    await page.goto('tree');
    await expect(page.locator('.jp-DirListing')).toBeVisible({
      timeout: 60_000
    });
    await page.goto(`notebooks/${path}`);
    await expect(page.locator('.jp-NotebookPanel')).toBeVisible({
      timeout: 60_000
    });

    await page.locator('.lm-MenuBar-itemLabel', { hasText: /^View$/ }).click();
    const item = page.locator('.lm-Menu-item:visible', {
      has: page.locator('.lm-Menu-itemLabel', { hasText: /^GPU Memory$/ })
    });
    await expect(item).toHaveCount(1);
    await page.screenshot({ path: `${SHOTS}/12-notebook7-view-menu.png` });
    await item.click();
    const panel = page.locator('#oommagic-panel');
    await expect(panel).toBeVisible();
    await expect(page.locator('#jp-right-stack #oommagic-panel')).toHaveCount(
      1
    );
    await expect(panel.locator('.oommagic-notebook-section')).toContainText(
      path
    );
    await page.screenshot({ path: `${SHOTS}/13-notebook7-panel.png` });

    expect(await paletteEntries(page)).toHaveLength(1);
    // Notebook 7.6.5 throws "Cannot read properties of undefined (reading 'schema')" from its own
    // shortcuts plugin on these pages, with this extension disabled too: only ours count here.
    expect(errors.filter(error => /oommagic/i.test(error))).toEqual([]);
    await page.close();
  });
});
