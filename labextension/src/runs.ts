/**
 * The runs the panel lists for one notebook: live runs the kernel sent over the comm, and the saved
 * summaries of earlier sessions read from cell metadata. Pure decisions (status, order, what is a
 * duplicate); the comm and the notebook model live in `kernelComm.ts` and `notebookRuns.ts`.
 */

import { CellRunJson, Outcome } from './protocol';
import { RunSummary } from './savedRuns';

export type RunStatus = 'ok' | 'oom' | 'retried' | 'error' | 'interrupted';

/**
 * One run in the panel's list: the run's own record (the whole `CellRunJson` of a live run, the
 * summary its cell saved for an earlier one) and where it stands in the notebook now.
 */
export type RunEntry = {
  /** The notebook cell's model id, null when the kernel did not know it (a console, a script). */
  cellId: string | null;
  executionCount: number | null;
  status: RunStatus;
} & (
  | { saved: false; run: CellRunJson }
  /** Read from the cell's metadata, not received from the running kernel. */
  | { saved: true; run: RunSummary }
);

/** The runs saved in one cell's metadata, with that cell's identity. */
export interface SavedCell {
  cellId: string;
  executionCount: number | null;
  runs: RunSummary[];
}

/** A run that a later run retried is "retried", whatever its own outcome was. */
export function statusOf(outcome: Outcome, retried: boolean): RunStatus {
  return retried ? 'retried' : outcome;
}

export const STATUS_LABEL: Record<RunStatus, string> = {
  ok: 'ok',
  oom: 'OOM',
  retried: 'retried',
  error: 'error',
  interrupted: 'interrupted'
};

/**
 * Newest first: every live run, then every saved run the live ones do not already cover. A saved
 * summary of a run that is also live (the same id) is the same run and appears once, live.
 */
export function listRuns(
  live: readonly CellRunJson[],
  saved: readonly SavedCell[]
): RunEntry[] {
  const retriedIds = new Set(
    live.map(r => r.parent).filter((p): p is string => p !== null)
  );
  const liveIds = new Set(live.map(r => r.id));
  const entries: RunEntry[] = live.map(run => ({
    cellId: run.cell_id,
    executionCount: run.execution_count,
    status: statusOf(run.outcome, retriedIds.has(run.id)),
    saved: false,
    run
  }));
  for (const cell of saved) {
    const latest = Math.max(...cell.runs.map(r => r.started));
    for (const summary of cell.runs) {
      if (liveIds.has(summary.id)) {
        continue;
      }
      // A saved summary keeps no parent link: a failed run that the cell ran again after is
      // taken as retried.
      const rerun = summary.outcome !== 'ok' && summary.started < latest;
      entries.push({
        cellId: cell.cellId,
        executionCount: cell.executionCount,
        status: statusOf(summary.outcome, rerun),
        saved: true,
        run: summary
      });
    }
  }
  return entries.sort((a, b) => b.run.started - a.run.started);
}

/** Add or replace runs by id, keeping arrival order (a retry re-sent in a hello stays where it was). */
export function mergeLive(
  current: readonly CellRunJson[],
  incoming: readonly CellRunJson[]
): CellRunJson[] {
  const byId = new Map(current.map(r => [r.id, r]));
  for (const run of incoming) {
    byId.set(run.id, run);
  }
  return [...byId.values()];
}
