/**
 * The browser tab's visibility for tests that run in Node. Lumino's `Poll` reads the page's
 * visibility once, when its module loads, and then follows `visibilitychange` events on `document`.
 * `hiddenPage.ts` puts a stand-in `document` in place just before `@lumino/polling` loads; it is taken
 * away right after (other packages take any `document` for a real DOM) and put back only while an
 * event is dispatched. Import this module before anything that imports `@lumino/polling`.
 */
import { page } from './hiddenPage';
import '@lumino/polling';

const global = globalThis as { document?: unknown };
delete global.document;

/** Hide or show the tab, as switching browser tabs does. */
export function setPageHidden(hidden: boolean): void {
  page.visibilityState = hidden ? 'hidden' : 'visible';
  global.document = page;
  try {
    page.dispatchEvent(new Event('visibilitychange'));
  } finally {
    delete global.document;
  }
}
