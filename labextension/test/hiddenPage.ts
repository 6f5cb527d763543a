/** A stand-in `document` with the page visibility only; see `pageVisibility.ts`. */

class PageVisibility extends EventTarget {
  visibilityState: 'visible' | 'hidden' = 'visible';
}

export const page = new PageVisibility();
(globalThis as { document?: unknown }).document = page;
