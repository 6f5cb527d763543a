import * as React from 'react';

/**
 * Text from the kernel with its `code` spans (the findings' convention, as the report widget draws
 * them) as <code>, never as literal backticks; everything else is plain text (React escapes it).
 */
export function RichText({ text }: { text: string }): JSX.Element {
  const parts = text.split(/`([^`]+)`/);
  return (
    <>
      {parts.map((part, i) =>
        i % 2 === 1 ? (
          <code key={i} className="oommagic-code">
            {part}
          </code>
        ) : (
          part
        )
      )}
    </>
  );
}
