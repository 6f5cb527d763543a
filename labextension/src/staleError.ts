/**
 * The red `OutOfMemoryError: ...` line a failed `%%gpumem` cell leaves under its report: once a run
 * with fixes fits, that line is stale (the report above it now reads "fits"), and it goes from the
 * cell's output model. Only that cell, only `error` outputs of an out-of-memory error.
 */

import { ICellModel, ICodeCellModel } from '@jupyterlab/cells';

/** An nbformat output that is an out-of-memory error (`torch.OutOfMemoryError` or the magic's own). */
export function isOutOfMemoryError(output: unknown): boolean {
  if (typeof output !== 'object' || output === null) {
    return false;
  }
  const { output_type: type, ename } = output as {
    output_type?: unknown;
    ename?: unknown;
  };
  return (
    type === 'error' &&
    typeof ename === 'string' &&
    /OutOfMemoryError$/.test(ename)
  );
}

/** Remove the cell's out-of-memory error outputs; how many went. Other outputs stay as they are. */
export function removeOutOfMemoryErrors(cell: ICellModel): number {
  if (cell.type !== 'code') {
    return 0;
  }
  const outputs = (cell as ICodeCellModel).outputs;
  let removed = 0;
  for (let i = outputs.length - 1; i >= 0; i--) {
    if (isOutOfMemoryError(outputs.get(i).toJSON())) {
      outputs.remove(i);
      removed++;
    }
  }
  return removed;
}
