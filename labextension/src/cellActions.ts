/**
 * What the panel does to a notebook: go to a run's cell, write a fix into it and run it, run it
 * again. Cells are found by their model id, which JupyterLab sends with each execute request and the
 * kernel records as the run's `cell_id`.
 */

import { Cell } from '@jupyterlab/cells';
import { Notebook, NotebookActions, NotebookPanel } from '@jupyterlab/notebook';

import { fixedCellSource, writtenSources } from './fix';
import { CellWriteJson } from './protocol';

export interface FoundCell {
  index: number;
  cell: Cell;
}

/** The cell whose model id is `cellId`, or null (deleted, or run somewhere else). */
export function findCell(
  notebook: Notebook,
  cellId: string | null
): FoundCell | null {
  if (!cellId) {
    return null;
  }
  const index = notebook.widgets.findIndex(cell => cell.model.id === cellId);
  return index === -1 ? null : { index, cell: notebook.widgets[index] };
}

/** Make the cell the only selected, active one and scroll it into view; false if it is gone. */
export async function revealCell(
  panel: NotebookPanel,
  cellId: string | null
): Promise<boolean> {
  const notebook = panel.content;
  const found = findCell(notebook, cellId);
  if (!found) {
    return false;
  }
  notebook.activeCellIndex = found.index;
  notebook.deselectAll();
  await notebook.scrollToCell(found.cell, 'center');
  return true;
}

/**
 * Replace the cell's body by `newBody` (the remedy's `new_source`, the `%%gpumem` line kept) as one
 * undoable step, then run the cell. False when the cell is gone.
 */
export async function applyFix(
  panel: NotebookPanel,
  cellId: string | null,
  newBody: string
): Promise<boolean> {
  const found = findCell(panel.content, cellId);
  if (!found) {
    return false;
  }
  const shared = found.cell.model.sharedModel;
  const source = fixedCellSource(shared.getSource(), newBody);
  // The undo manager merges changes made within its capture timeout (500 ms) into one step; closing
  // the step on both sides keeps the fix apart from the user's typing, so one Ctrl+Z takes it back.
  stopCapturing(shared);
  shared.setSource(source);
  stopCapturing(shared);
  return retryCell(panel, cellId);
}

/**
 * Write a fitted run into the notebook (`write`: the cell's body and the functions it redefined, each
 * back into the cell that defines it), without running anything: the kernel already ran it. Each cell
 * changed is one undoable step of its own (Ctrl+Z in it brings its text back). False when the run's
 * cell is gone.
 */
export function writeRun(
  panel: NotebookPanel,
  cellId: string | null,
  write: CellWriteJson
): boolean {
  const notebook = panel.content;
  const found = findCell(notebook, cellId);
  if (!found) {
    return false;
  }
  const cells = notebook.widgets;
  const next = writtenSources(
    cells.map(cell => cell.model.sharedModel.getSource()),
    found.index,
    write
  );
  for (const [i, source] of next) {
    const shared = cells[i].model.sharedModel;
    stopCapturing(shared);
    shared.setSource(source);
    stopCapturing(shared);
  }
  return true;
}

/** Whether the notebook already says what `write` would write (nothing would change). */
export function isWritten(
  panel: NotebookPanel,
  cellId: string | null,
  write: CellWriteJson
): boolean {
  const found = findCell(panel.content, cellId);
  if (!found) {
    return false;
  }
  const sources = panel.content.widgets.map(cell =>
    cell.model.sharedModel.getSource()
  );
  return writtenSources(sources, found.index, write).size === 0;
}

/** Run the cell as it is now. False when the cell is gone. */
export async function retryCell(
  panel: NotebookPanel,
  cellId: string | null
): Promise<boolean> {
  if (!(await revealCell(panel, cellId))) {
    return false;
  }
  await NotebookActions.run(panel.content, panel.sessionContext);
  return true;
}

function stopCapturing(shared: object): void {
  const manager = (
    shared as { undoManager?: { stopCapturing?: () => void } | null }
  ).undoManager;
  manager?.stopCapturing?.();
}
