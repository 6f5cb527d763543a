import * as React from 'react';
import { renderToStaticMarkup } from 'react-dom/server';

import { RichText } from '../src/components/RichText';

describe('RichText', () => {
  it("draws the kernel's `code` spans as code, never as literal backticks", () => {
    const html = renderToStaticMarkup(
      <RichText text="The `--limit` ran out, not the card <b>" />
    );
    expect(html).toBe(
      'The <code class="oommagic-code">--limit</code> ran out, not the card &lt;b&gt;'
    );
    expect(html).not.toContain('`');
  });
});
