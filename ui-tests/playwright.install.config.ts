/**
 * The browser half of scripts/install_check.sh: JupyterLab (OOMMAGIC_UI_APP=lab) or Notebook 7
 * (OOMMAGIC_UI_APP=notebook) from a virtualenv that the built wheel was pip-installed into
 * (OOMMAGIC_VENV), started with only that virtualenv's bin/ on its PATH: no Node.js, nothing built on
 * the spot. Its root directory ($OOMMAGIC_UI_ROOT, else a fresh temporary one) gets a copy of
 * notebooks/quickstart.ipynb.
 */
import { copyFileSync, mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

import { defineConfig } from '@playwright/test';

const TOKEN = process.env.OOMMAGIC_UI_TOKEN ?? 'oommagic-install-check';
const PORT = Number(process.env.OOMMAGIC_UI_PORT ?? 8889);
const APP = process.env.OOMMAGIC_UI_APP ?? 'lab';
if (!process.env.OOMMAGIC_VENV) {
  throw new Error('OOMMAGIC_VENV: the virtualenv the wheel was installed into');
}
const VENV = resolve(process.env.OOMMAGIC_VENV);
// Set once in the main process; the workers inherit it instead of making their own.
process.env.OOMMAGIC_UI_ROOT ??= mkdtempSync(
  join(tmpdir(), 'oommagic-install-root-')
);
const ROOT = process.env.OOMMAGIC_UI_ROOT;
copyFileSync(
  resolve(__dirname, '../notebooks/quickstart.ipynb'),
  join(ROOT, 'quickstart.ipynb')
);
const APP_CLASS = APP === 'lab' ? 'LabApp' : 'JupyterNotebookApp';
// No layout or settings of earlier runs (or of the person running this) restored into the page:
// a hidden folder of the root, which the file browser does not list.
const STATE = join(ROOT, '.jupyter-state');

export default defineConfig({
  testDir: 'install',
  outputDir: 'test-results/install',
  timeout: 120_000,
  expect: { timeout: 30_000 },
  workers: 1,
  reporter: [['line']],
  use: {
    browserName: 'chromium',
    baseURL: `http://localhost:${PORT}`,
    extraHTTPHeaders: { Authorization: `token ${TOKEN}` },
    viewport: { width: 1400, height: 900 },
    launchOptions: {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
      args: ['--headless', '--no-sandbox', '--disable-gpu', '--no-first-run']
    },
    trace: 'retain-on-failure',
    video: 'off'
  },
  webServer: {
    command: [
      `${VENV}/bin/jupyter`,
      APP,
      '--no-browser',
      '--allow-root',
      `--port=${PORT}`,
      '--ServerApp.port_retries=0',
      `--IdentityProvider.token=${TOKEN}`,
      `--ServerApp.root_dir=${ROOT}`,
      `--${APP_CLASS}.expose_app_in_browser=True`,
      `--${APP_CLASS}.workspaces_dir=${STATE}/workspaces`,
      `--${APP_CLASS}.user_settings_dir=${STATE}/settings`
    ].join(' '),
    env: { PATH: `${VENV}/bin` },
    url: `http://localhost:${PORT}/api/status?token=${TOKEN}`,
    timeout: 120_000,
    reuseExistingServer: false,
    stdout: 'pipe',
    stderr: 'pipe'
  }
});
