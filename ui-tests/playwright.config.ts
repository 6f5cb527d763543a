/**
 * Browser tests of the oommagic lab extension: Galata's fixtures over Playwright, in Debian's
 * Chromium (never a downloaded browser), against a JupyterLab that Playwright starts from the
 * project's virtualenv with a token, on a fresh temporary root directory.
 */
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join, resolve } from 'node:path';

import { defineConfig } from '@playwright/test';

const TOKEN = process.env.OOMMAGIC_UI_TOKEN ?? 'oommagic-ui-tests';
const PORT = Number(process.env.OOMMAGIC_UI_PORT ?? 8888);
const VENV = resolve(__dirname, process.env.OOMMAGIC_VENV ?? '../.venv');
// Set once in the main process; the workers inherit it instead of making their own.
process.env.OOMMAGIC_UI_ROOT ??= mkdtempSync(
  join(tmpdir(), 'oommagic-ui-root-')
);

export default defineConfig({
  testDir: 'tests',
  outputDir: 'test-results',
  timeout: 240_000,
  expect: { timeout: 30_000 },
  workers: 1,
  retries: process.env.CI ? 1 : 0,
  reporter: [
    [process.env.CI ? 'line' : 'list'],
    ['html', { open: 'never', outputFolder: 'playwright-report' }]
  ],
  use: {
    browserName: 'chromium',
    baseURL: `http://localhost:${PORT}`,
    // Galata opens `${baseURL}${appPath}`; the token rides along on every request and the websockets.
    extraHTTPHeaders: { Authorization: `token ${TOKEN}` },
    viewport: { width: 1400, height: 900 },
    launchOptions: {
      executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
      args: [
        '--headless',
        '--no-sandbox',
        '--disable-gpu',
        '--disable-quic',
        '--no-first-run',
        '--disable-background-networking',
        '--disable-component-update',
        '--disable-sync'
      ]
    },
    trace: 'retain-on-failure',
    video: 'off'
  },
  webServer: {
    command: [
      `${VENV}/bin/jupyter`,
      'lab',
      '--config=jupyter_server_test_config.py',
      `--IdentityProvider.token=${TOKEN}`,
      '--no-browser',
      `--port=${PORT}`,
      `--ServerApp.root_dir=${process.env.OOMMAGIC_UI_ROOT}`
    ].join(' '),
    url: `http://localhost:${PORT}/api/status?token=${TOKEN}`,
    timeout: 120_000,
    // Always our own server: another one on the port would have another token and extensions.
    reuseExistingServer: false,
    stdout: 'pipe',
    stderr: 'pipe'
  }
});
