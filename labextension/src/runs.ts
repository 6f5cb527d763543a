/**
 * The runs the panel lists for one notebook: live runs the kernel sent over the comm, and the saved
 * summaries of earlier sessions read from cell metadata. Pure decisions (status, order, what is a
 * duplicate); the comm and the notebook model live in `kernelComm.ts` and `notebookRuns.ts`.
 */

import { CellRunJson, Outcome } from './protocol';
import { RunSummary } from './savedRuns';

export type RunStatus = 'ok' | 'oom' | 'retried' | 'error' | 'interrupted';

export interface RunEntry {
  id: string;
  /** The notebook cell's model id, null when the kernel did not know it (a console, a script). */
  cellId: string | null;
  executionCount: number | null;
  outcome: Outcome;
  status: RunStatus;
  headline: string;
  peakAllocated: number;
  peakReserved: number;
  capacity: number | null;
  limit: number | null;
  started: number;
  /** Read from the cell's metadata, not received from the running kernel. */
  saved: boolean;
  /** The full record for live runs (timeline, findings); null for saved ones. */
  run: CellRunJson | null;
}

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
    id: run.id,
    cellId: run.cell_id,
    executionCount: run.execution_count,
    outcome: run.outcome,
    status: statusOf(run.outcome, retriedIds.has(run.id)),
    headline: run.headline,
    peakAllocated: run.peak_allocated,
    peakReserved: run.peak_reserved,
    capacity: run.capacity,
    limit: run.limit,
    started: run.started,
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
        id: summary.id,
        cellId: cell.cellId,
        executionCount: cell.executionCount,
        outcome: summary.outcome,
        status: statusOf(summary.outcome, rerun),
        headline: summary.headline,
        peakAllocated: summary.peak_allocated,
        peakReserved: summary.peak_reserved,
        capacity: summary.capacity,
        limit: summary.limit,
        started: summary.started,
        saved: true,
        run: null
      });
    }
  }
  return entries.sort((a, b) => b.started - a.started);
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
