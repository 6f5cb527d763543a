/**
 * What a run card offers from the kernel's fix plan, and what a run that fits after a fix is: pure
 * decisions over `CellRunJson`s. The components draw them; `panel.tsx` sends the actions.
 */

import { CellRunJson, PlanEntryJson } from './protocol';

/** One plan entry as the card lists it. */
export interface PlanRow {
  /** The entry's index in `plan.entries`: what an `apply` request names. */
  index: number;
  entry: PlanEntryJson;
  /** The first entry measured to fit: listed first, with the primary button. */
  recommended: boolean;
  /** Whether the card offers to run it (every entry not measured not to fit). */
  runnable: boolean;
}

/** The plan's entries, the recommended one first, the others in the plan's order. */
export function planRows(run: CellRunJson): PlanRow[] {
  const entries = run.plan?.entries ?? [];
  const best = entries.findIndex(e => e.verdict === 'fits');
  const rows = entries.map((entry, index) => ({
    index,
    entry,
    recommended: index === best,
    runnable: entry.verdict !== 'does not fit'
  }));
  return [
    ...rows.filter(r => r.recommended),
    ...rows.filter(r => !r.recommended)
  ];
}

/**
 * The run of `run`'s cell that plan entry `entry` made and that fitted: a child of `run` whose last
 * fixes in force are the entry's, with outcome "ok". The newest if it ran more than once.
 */
export function fittedRunOf(
  run: CellRunJson,
  entry: PlanEntryJson,
  live: readonly CellRunJson[]
): CellRunJson | null {
  const titles = entry.fixes.map(f => f.title);
  const matches = live.filter(child => {
    if (child.parent !== run.id || child.outcome !== 'ok') {
      return false;
    }
    const last = child.applied.slice(-titles.length).map(f => f.title);
    return (
      child.applied.length >= titles.length &&
      last.every((title, i) => title === titles[i])
    );
  });
  return matches.length ? matches[matches.length - 1] : null;
}

/**
 * The cell body "Apply to cell" writes for a plan entry: a single fix's own `new_source`; for a
 * combination (no single rewrite says it all), the source the run that fitted with it ran, once that
 * run has arrived. Null when there is nothing to write (yet).
 */
export function sourceToWrite(
  entry: PlanEntryJson,
  fitted: CellRunJson | null
): string | null {
  if (entry.fixes.length === 1 && entry.fixes[0].new_source !== null) {
    return entry.fixes[0].new_source;
  }
  return fitted ? fitted.source : null;
}

/** A run that fits thanks to fixes the kernel applied to a failed run of its cell. */
export function fitsWithFixes(run: CellRunJson): boolean {
  return run.outcome === 'ok' && run.parent !== null && run.applied.length > 0;
}

/** The run the user started that `run` descends from (following `parent` through `live`). */
export function rootOf(
  run: CellRunJson,
  live: readonly CellRunJson[]
): CellRunJson {
  const byId = new Map(live.map(r => [r.id, r]));
  let root = run;
  const seen = new Set<string>();
  while (root.parent !== null && !seen.has(root.id)) {
    seen.add(root.id);
    const parent = byId.get(root.parent);
    if (!parent) {
      break;
    }
    root = parent;
  }
  return root;
}

/**
 * Whether `run`'s arrival makes the error in its cell stale: it fits with fixes, and it descends from
 * a failed execution of the same cell that is still the cell's latest (only that execution left an
 * error in the cell's outputs; the kernel's actions run the cell without writing to it). When the user
 * ran the cell again since, its outputs are another execution's and stay.
 */
export function clearsCellError(
  run: CellRunJson,
  live: readonly CellRunJson[]
): boolean {
  if (!fitsWithFixes(run) || run.cell_id === null) {
    return false;
  }
  const root = rootOf(run, live);
  if (root === run || root.cell_id !== run.cell_id || root.outcome === 'ok') {
    return false;
  }
  return !live.some(
    r =>
      r.parent === null && r.cell_id === run.cell_id && r.started > root.started
  );
}
