/**
 * Writing a remedy into its cell. A remedy's `new_source` is the cell's body as the kernel ran it,
 * without the `%%gpumem …` line (IPython hands a cell magic only the body), so the line the user
 * wrote, options included, is kept on top.
 *
 * A run that fits with a rewritten source carries its `write` (`oommagic/diagnosis/write_back.py`): the
 * cell's body, and the notebook functions the fix redefined (`train`, with accumulation) with the text
 * they replace. Each goes back where the notebook defines it, so the notebook holds one definition.
 */

import { CellWriteJson } from './protocol';

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

/**
 * The sources `write` gives the notebook's cells (`sources`, in order; the run's cell at `cellIndex`),
 * by index, only those that change: each redefined function replaces its old text in the first other
 * cell that holds it; one found nowhere goes on top of the run's cell, once.
 */
export function writtenSources(
  sources: readonly string[],
  cellIndex: number,
  write: CellWriteJson
): Map<number, string> {
  const next = new Map<number, string>();
  const homeless: string[] = [];
  for (const fn of write.functions) {
    const now = fn.now.trimEnd();
    if (sources.some((source, i) => i !== cellIndex && source.includes(now))) {
      continue; // written back already
    }
    const was = fn.was?.trimEnd() ?? '';
    const home = was
      ? sources.findIndex(
          (source, i) =>
            i !== cellIndex && (next.get(i) ?? source).includes(was)
        )
      : -1;
    if (home === -1) {
      homeless.push(fn.now.trimEnd());
      continue;
    }
    next.set(
      home,
      (next.get(home) ?? sources[home]).replace(was, fn.now.trimEnd())
    );
  }
  const body = [...homeless, write.body].join('\n\n');
  next.set(cellIndex, fixedCellSource(sources[cellIndex], body));
  for (const [i, source] of [...next]) {
    if (source === sources[i]) {
      next.delete(i);
    }
  }
  return next;
}
