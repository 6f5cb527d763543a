/**
 * What a cell remembers of its `%%gpumem` runs: a small summary in the cell's metadata under the key
 * `oommagic`, written when a run arrives, so a saved and reopened notebook still shows its past runs
 * without running anything.
 *
 * `{"runs": [{"id", "outcome", "peak_allocated", "peak_reserved", "capacity", "limit", "headline",
 * "started"}]}`, oldest first, at most `KEEP` entries.
 */

import { isObject } from './json';
import { CellRunJson, Outcome, OUTCOMES } from './protocol';

export const METADATA_KEY = 'oommagic';
export const KEEP = 5;

export interface RunSummary {
  id: string;
  outcome: Outcome;
  peak_allocated: number;
  peak_reserved: number;
  capacity: number | null;
  limit: number | null;
  headline: string;
  started: number;
}

export interface SavedRuns {
  runs: RunSummary[];
}

export function summarize(run: CellRunJson): RunSummary {
  return {
    id: run.id,
    outcome: run.outcome,
    peak_allocated: run.peak_allocated,
    peak_reserved: run.peak_reserved,
    capacity: run.capacity,
    limit: run.limit,
    headline: run.headline,
    started: run.started
  };
}

/** The summaries in a cell's `oommagic` metadata; entries that are not summaries are dropped. */
export function readSaved(metadata: unknown): RunSummary[] {
  if (!isObject(metadata) || !Array.isArray(metadata.runs)) {
    return [];
  }
  return metadata.runs.filter(isObject).flatMap(normalize);
}

/**
 * The metadata value after adding `runs` (a run already there by id is replaced), ordered by start
 * time and cut to the last `keep`; null when that changes nothing, so that an unchanged cell is not
 * written and the notebook not marked dirty.
 */
export function mergeSaved(
  metadata: unknown,
  runs: RunSummary[],
  keep = KEEP
): SavedRuns | null {
  const before = readSaved(metadata);
  const byId = new Map(before.map(r => [r.id, r]));
  for (const run of runs) {
    byId.set(run.id, run);
  }
  const after = [...byId.values()]
    .sort((a, b) => a.started - b.started)
    .slice(-keep);
  const unchanged =
    isObject(metadata) &&
    Array.isArray(metadata.runs) &&
    metadata.runs.length === after.length &&
    JSON.stringify(metadata.runs) === JSON.stringify(after);
  return unchanged ? null : { runs: after };
}

function normalize(value: Record<string, unknown>): RunSummary[] {
  const { id, outcome, started } = value;
  if (typeof id !== 'string' || typeof started !== 'number') {
    return [];
  }
  const bytes = (v: unknown): number | null =>
    typeof v === 'number' ? v : null;
  return [
    {
      id,
      outcome: (OUTCOMES as readonly unknown[]).includes(outcome)
        ? (outcome as Outcome)
        : 'error',
      peak_allocated: bytes(value.peak_allocated) ?? 0,
      peak_reserved: bytes(value.peak_reserved) ?? 0,
      capacity: bytes(value.capacity),
      limit: bytes(value.limit),
      headline: typeof value.headline === 'string' ? value.headline : '',
      started
    }
  ];
}
