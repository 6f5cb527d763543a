/**
 * Writing a remedy into its cell. A remedy's `new_source` is the cell's body as the kernel ran it,
 * without the `%%gpumem …` line (IPython hands a cell magic only the body), so the line the user
 * wrote, options included, is kept on top.
 */

/** The cell's new source: the current `%%gpumem` line (if any) over the remedy's body. */
export function fixedCellSource(current: string, newBody: string): string {
  if (newBody.trimStart().startsWith('%%')) {
    return newBody;
  }
  const newline = current.indexOf('\n');
  const first = newline === -1 ? current : current.slice(0, newline);
  if (first.trimStart().startsWith('%%gpumem')) {
    return `${first}\n${newBody}`;
  }
  return newBody;
}
