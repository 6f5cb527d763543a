import { CellRunJson, checkCellRun } from '../src/protocol';
import written from './fixtures/cellrun.json';

/**
 * The runs Python's `CellRun.to_json()` wrote for `tests/test_protocol_fixture.py` (real `%%gpumem`
 * cells in CPU mode, volatile fields normalised), by name: `ok`, `oom_batch` (its `retry`),
 * `oom_dropped`, `error`, `cuda_oom`.
 */
export const KERNEL_RUNS: Readonly<Record<string, unknown>> = written;

/** A run of the fixture as the sidebar reads it; throws if the parser found anything to complain of. */
export function kernelRun(name: string): CellRunJson {
  const checked = checkCellRun(KERNEL_RUNS[name]);
  if (!checked || checked.problems.length) {
    throw new Error(
      `fixture run ${name}: ${checked ? checked.problems.join('; ') : 'not a run'}`
    );
  }
  return checked.value;
}

/** The out-of-memory run of a 64-sample batch under `--limit 64MiB`, with `overrides`. */
export function oomRun(overrides: Partial<CellRunJson> = {}): CellRunJson {
  return { ...kernelRun('oom_batch'), ...overrides };
}
