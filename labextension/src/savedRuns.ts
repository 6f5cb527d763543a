/**
 * What a cell remembers of its `%%gpumem` runs: a small summary in the cell's metadata under the key
 * `oommagic`, written when a run arrives, so a saved and reopened notebook still shows its past runs
 * without running anything.
 *
 * `{"runs": [{"id", "outcome", "peak_allocated", "peak_reserved", "capacity", "limit", "headline",
 * "started"}]}`, oldest first, at most `keep` entries (the setting "Runs kept per cell", `KEEP` by
 * default).
 */

import { isObject, num, pick, record } from './json';
import { CELL_RUN, CellRunJson } from './protocol';

export const METADATA_KEY = 'oommagic';
export const KEEP = 5;

/** The fields of a run that its cell keeps: a part of `CellRunJson`, read with the same readers. */
export const SUMMARY_FIELDS = [
  'id',
  'outcome',
  'peak_allocated',
  'peak_reserved',
  'capacity',
  'limit',
  'headline',
  'started'
] as const;

export type RunSummary = Pick<CellRunJson, (typeof SUMMARY_FIELDS)[number]>;

export interface SavedRuns {
  runs: RunSummary[];
}

const readSummary = record(pick(CELL_RUN, SUMMARY_FIELDS));

/** The part of a run its cell keeps (a live run's whole record is far larger: timeline, findings). */
export function summarize(run: RunSummary): RunSummary {
  const summary: Partial<Record<keyof RunSummary, unknown>> = {};
  for (const key of SUMMARY_FIELDS) {
    summary[key] = run[key];
  }
  return summary as RunSummary;
}

/**
 * The summaries in a cell's `oommagic` metadata. An entry without a string id or a start time is
 * dropped; other fields that are missing or mistyped get their empty value.
 */
export function readSaved(metadata: unknown): RunSummary[] {
  if (!isObject(metadata) || !Array.isArray(metadata.runs)) {
    return [];
  }
  return metadata.runs.flatMap((entry: unknown) =>
    isObject(entry) &&
    typeof entry.id === 'string' &&
    num(entry.started) !== null
      ? [readSummary(entry, 'summary', [])]
      : []
  );
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
    byId.set(run.id, summarize(run));
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
