/**
 * The `%%gpumem` runs of one open notebook: live runs from its kernel's comm and saved summaries
 * from its cells' metadata. Kept for every open notebook (not only the visible one) so that a run
 * finishing in a background notebook is still written into that notebook's cell.
 *
 * Saved runs are those of the notebook as it was saved (or opened): a summary written into a cell's
 * metadata during this session is a saved run only once the notebook is saved, so a kernel restart
 * in a notebook never saved lists nothing.
 */

import { ICellModel } from '@jupyterlab/cells';
import { NotebookPanel } from '@jupyterlab/notebook';
import { IDisposable } from '@lumino/disposable';
import { ISignal, Signal } from '@lumino/signaling';

import { writeRun } from './cellActions';
import { KernelComm } from './kernelComm';
import { clearsCellError } from './plan';
import {
  ActionRequest,
  CellRunJson,
  CellWriteJson,
  KernelMessage
} from './protocol';
import { listRuns, mergeLive, RunEntry, SavedCell } from './runs';
import { removeOutOfMemoryErrors } from './staleError';
import {
  KEEP,
  mergeSaved,
  METADATA_KEY,
  readSaved,
  summarize
} from './savedRuns';

/** How many one-line notices (unknown messages, failed fixes) the panel keeps. */
const NOTICES = 3;

export class NotebookRuns implements IDisposable {
  constructor(panel: NotebookPanel) {
    this.panel = panel;
    this.comm = new KernelComm(panel.sessionContext);
    this.comm.received.connect(this._onMessage, this);
    this.comm.reset.connect(this._onReset, this);
    // Saved runs can only be read once the notebook's content is loaded.
    void panel.context.ready.then(() => {
      this._onDisk = this._summaryIds();
      this._changed.emit();
    });
    panel.context.saveState.connect((_, state) => {
      if (state === 'completed') {
        this._onDisk = this._summaryIds();
        this._changed.emit();
      }
    }, this);
  }

  readonly panel: NotebookPanel;
  readonly comm: KernelComm;

  /** How many runs each cell keeps in its metadata (the setting "Runs kept per cell"). */
  keep = KEEP;

  /** Whether a fix that fits is written into the notebook (the setting "Write fixes into cells"). */
  writeFixes = true;

  /** Something the panel shows changed. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Live runs (this kernel) first-arrived first. */
  get live(): readonly CellRunJson[] {
    return this._live;
  }

  get notices(): readonly string[] {
    return this._notices;
  }

  /** What the kernel is doing for a run, by run id ("running with: Batch 64 → 12"), until it answers. */
  get pending(): ReadonlyMap<string, string> {
    return this._pending;
  }

  /** The kernel's refusal of the last action on a run, by run id. */
  get refusals(): ReadonlyMap<string, string> {
    return this._refusals;
  }

  /**
   * Ask the kernel to run `request` (apply a plan entry, remove a fix) on its run; `doing` is what the
   * card says meanwhile. The answer is a new run (its `parent` is the run) or a refusal.
   */
  ask(request: ActionRequest, doing: string, write = false): void {
    this._refusals.delete(request.run);
    if (this.comm.send(request)) {
      this._pending.set(request.run, doing);
      if (write) {
        this._writeWhenFits.add(request.run);
      }
    } else {
      this._refusals.set(
        request.run,
        'The kernel of this run is gone (restarted or changed): run the cell again.'
      );
    }
    this._changed.emit();
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Every run to list, newest first: live ones and the saved ones live ones do not cover. */
  entries(): RunEntry[] {
    return listRuns(this._live, this.savedCells());
  }

  /**
   * The summaries saved in the notebook's cells (read fresh: cells move, get deleted, get pasted), of
   * the runs the notebook held when it was last saved or opened.
   */
  savedCells(): SavedCell[] {
    const cells = this.panel.model?.cells;
    if (!cells) {
      return [];
    }
    const saved: SavedCell[] = [];
    for (let i = 0; i < cells.length; i++) {
      const cell = cells.get(i);
      const runs = readSaved(cell.getMetadata(METADATA_KEY)).filter(run =>
        this._onDisk.has(run.id)
      );
      if (runs.length) {
        saved.push({
          cellId: cell.id,
          executionCount: executionCountOf(cell),
          runs
        });
      }
    }
    return saved;
  }

  /** Show a one-line notice at the top of the notebook's runs. */
  notify(line: string): void {
    this._notices = [...this._notices.filter(n => n !== line), line].slice(
      -NOTICES
    );
    this._changed.emit();
  }

  dismissNotices(): void {
    this._notices = [];
    this._changed.emit();
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this.comm.dispose();
    Signal.clearData(this);
  }

  /** Write `write` (run `runId` fitted) into the notebook, if the setting lets it. */
  write(runId: string, cellId: string | null, write: CellWriteJson): void {
    if (!this.writeFixes) {
      return;
    }
    try {
      if (writeRun(this.panel, cellId, write)) {
        // The report in the kernel says the notebook now holds what it ran.
        this.comm.send({ type: 'written', run: runId });
      } else {
        this.notify(
          'The cell of that fix is not in this notebook any more: nothing was written.'
        );
      }
    } catch (error) {
      this.notify(
        `Could not write the fix into the cell: ${error instanceof Error ? error.message : String(error)}`
      );
    }
    this._changed.emit();
  }

  private _onMessage(_: KernelComm, message: KernelMessage): void {
    if (message.kind === 'write') {
      this.write(message.run, message.cellId, message.write);
      return;
    }
    if (message.kind === 'error') {
      const id = message.run ?? '';
      this._pending.delete(id);
      this._writeWhenFits.delete(id);
      if (this._live.some(r => r.id === id)) {
        this._refusals.set(id, message.message);
      } else {
        this.notify(`The kernel could not do that: ${message.message}`);
      }
      this._changed.emit();
      return;
    }
    if (message.kind === 'unknown') {
      console.warn(`oommagic: ${message.notice}: ${message.detail}`);
      this.notify(message.notice);
      return;
    }
    if (message.problems.length) {
      // A kernel of another oommagic version: the panel still shows what it could read.
      console.warn(
        `oommagic: the kernel's run record differs from this sidebar's: ${message.problems.join('; ')}`
      );
    }
    const runs = message.kind === 'hello' ? message.runs : [message.run];
    // A hello is the kernel's whole history: it replaces what this page knew of that kernel.
    this._live =
      message.kind === 'hello'
        ? mergeLive([], runs)
        : mergeLive(this._live, runs);
    this._save(runs);
    if (message.kind === 'run') {
      this._answered(message.run);
    }
    this._changed.emit();
  }

  /** A new run ends what was pending on its parent; one that fits takes the parent's error away. */
  private _answered(run: CellRunJson): void {
    if (run.parent === null) {
      return;
    }
    this._pending.delete(run.parent);
    this._refusals.delete(run.parent);
    if (this._writeWhenFits.delete(run.parent) && run.outcome === 'ok') {
      this.write(
        run.id,
        run.cell_id,
        run.write ?? { body: run.source, functions: [] }
      );
    }
    if (!clearsCellError(run, this._live)) {
      return;
    }
    const cells = this.panel.model?.cells;
    for (let i = 0; cells && i < cells.length; i++) {
      const cell = cells.get(i);
      if (cell.id === run.cell_id) {
        removeOutOfMemoryErrors(cell);
      }
    }
  }

  private _onReset(): void {
    this._live = [];
    this._pending.clear();
    this._writeWhenFits.clear();
    this._refusals.clear();
    this._changed.emit();
  }

  /** Write each run's summary into its cell's metadata (not undoable: the user did not type it). */
  private _save(runs: readonly CellRunJson[]): void {
    const cells = this.panel.model?.cells;
    if (!cells) {
      return;
    }
    const byCell = new Map<string, CellRunJson[]>();
    for (const run of runs) {
      if (run.cell_id) {
        byCell.set(run.cell_id, [...(byCell.get(run.cell_id) ?? []), run]);
      }
    }
    for (let i = 0; i < cells.length && byCell.size; i++) {
      const cell = cells.get(i);
      const mine = byCell.get(cell.id);
      if (!mine) {
        continue;
      }
      byCell.delete(cell.id);
      const next = mergeSaved(
        cell.getMetadata(METADATA_KEY),
        mine.map(summarize),
        this.keep
      );
      if (next) {
        cell.sharedModel.transact(
          () => cell.setMetadata(METADATA_KEY, next),
          false
        );
      }
    }
  }

  /** The ids of the runs summarised in the cells' metadata, as of the last save or opening. */
  private _summaryIds(): Set<string> {
    const ids = new Set<string>();
    const cells = this.panel.model?.cells;
    for (let i = 0; cells && i < cells.length; i++) {
      for (const run of readSaved(cells.get(i).getMetadata(METADATA_KEY))) {
        ids.add(run.id);
      }
    }
    return ids;
  }

  private _live: CellRunJson[] = [];
  private _onDisk = new Set<string>();
  /** Runs whose action asked for the fix to be written into the notebook once it fits. */
  private _writeWhenFits = new Set<string>();
  private _notices: string[] = [];
  private _pending = new Map<string, string>();
  private _refusals = new Map<string, string>();
  private _isDisposed = false;
  private _changed = new Signal<this, void>(this);
}

function executionCountOf(cell: ICellModel): number | null {
  const count = (cell as { executionCount?: unknown }).executionCount;
  return typeof count === 'number' ? count : null;
}
