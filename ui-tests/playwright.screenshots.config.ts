/**
 * The README's pictures, taken from the quickstart in the real JupyterLab (`scripts/screenshots.sh`):
 * the same server and browser as the browser tests, another folder of specs (not run by `jlpm test`).
 */
import { defineConfig } from '@playwright/test';

import base from './playwright.config';

export default defineConfig({
  ...base,
  testDir: 'screenshots',
  retries: 0,
  reporter: [['list']]
});
