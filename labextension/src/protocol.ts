/**
 * The comm protocol between the kernel (`oommagic/comm.py`) and the sidebar, version 1, and the shape
 * of the `CellRun` record it carries (`oommagic/cellrun.py`, `CellRun.to_json`).
 *
 * The kernel opens the comm (target `oommagic`) with `{"version":1,"type":"hello","runs":[...]}` (all
 * runs so far) and then sends `{"version":1,"type":"run","run":{...}}` after each run; the frontend
 * sends `{"type":"sync"}` to have the hello sent again. The sidebar's actions are
 * `{"type":"apply","run":<id>,"entry":<k>}` (run the cell with plan entry k stacked on the fixes in
 * force) and `{"type":"remove","run":<id>,"index":<i>}` (run it without `applied[i]`); the new run
 * arrives as a `run` message whose `parent` is `<id>`, a refusal as
 * `{"version":1,"type":"error","run":<id>,"message":"..."}`. After a fix pressed in the report fits, the
 * kernel sends `{"version":1,"type":"write","run":<id>,"cell_id":...,"write":{body, functions}}`: the
 * frontend writes it into the notebook (the setting "Write fixes into cells") and answers
 * `{"type":"written","run":<id>}`, which the report turns into "Written into the notebook". Parsing never throws: anything else becomes
 * an `unknown` message whose notice the panel shows in one line.
 *
 * `test/fixtures/cellrun.json` holds runs that Python's `CellRun.to_json()` wrote
 * (`tests/test_protocol_fixture.py` checks it still does); `test/contract.spec.tsx` reads them here
 * without a problem, so a field renamed or retyped on either side fails a test.
 */

import {
  anyObject,
  optional,
  describe,
  flag,
  integer,
  isObject,
  listOf,
  nullable,
  oneOf,
  pair,
  real,
  Reader,
  record,
  Shape,
  text
} from './json';

export const COMM_TARGET = 'oommagic';
export const PROTOCOL_VERSION = 1;

export type Outcome = 'ok' | 'oom' | 'error' | 'interrupted';

export interface TimelineJson {
  /** Seconds since the cell started. */
  t: number[];
  /** Bytes allocated after each event at `t`. */
  allocated: number[];
  /** Bytes reserved by the allocator after each event at `t`. */
  reserved: number[];
  steps: number[];
  oom_at: number | null;
  truncated: boolean;
  events: number;
}

export interface RemedyJson {
  kind: string;
  title: string;
  explanation: string;
  code: string | null;
  automatic: boolean;
  saving: number | null;
  params: Record<string, unknown>;
  /** The cell's body (without the `%%gpumem` line) with the fix written in, or null. */
  new_source: string | null;
}

export interface FindingJson {
  key: string;
  title: string;
  evidence: string;
  saving: number | null;
  score: number;
  remedies: RemedyJson[];
}

/** The figures of the out-of-memory message (`oommagic.parse_oom`); bytes, null where it says nothing. */
export interface OOMReportJson {
  text: string;
  device: string | null;
  gpu_index: number | null;
  requested: number | null;
  capacity: number | null;
  free: number | null;
  allocated: number | null;
  reserved: number | null;
  reserved_unallocated: number | null;
  process_used: number | null;
  /** `[pid, bytes]` of the other processes the message names. */
  other_processes: [pid: number, bytes: number][];
  limit: number | null;
  source: string;
  emulated: boolean;
}

export type Verdict = 'fits' | 'likely fits' | 'does not fit' | 'not measured';

export const VERDICTS: readonly Verdict[] = [
  'fits',
  'likely fits',
  'does not fit',
  'not measured'
];

/** One candidate of the fix plan: fixes stacked on those in force, and what its trial measured. */
export interface PlanEntryJson {
  /** `"batch"`, or `"checkpointing+batch"` for a combination. */
  kind: string;
  title: string;
  fixes: RemedyJson[];
  verdict: Verdict;
  /** Peak reserved bytes of the trial (a lower bound where it ran out), null when not measured. */
  peak: number | null;
  budget: number | null;
  seconds_per_step: number | null;
  /** Time per step against the failed run's, null when not measured. */
  time_ratio: number | null;
  method: string;
  note: string;
  /** The verdict with its figures, as the kernel's report writes it. */
  line: string;
}

/** The fix plan measured after an out-of-memory error: entries in order, the first that fits first. */
export interface FixPlanJson {
  entries: PlanEntryJson[];
  summary: string;
  budget_s: number;
  spent_s: number;
  trials: number;
  snapshot_bytes: number;
  stopped: boolean;
  /** Why nothing the plan knows fits; empty when something does. */
  unfittable: string;
  notes: string[];
}

/** Bytes of one kind of memory (parameters, gradients, activations, ...) at the run's moment. */
export interface CategoryJson {
  key: string;
  label: string;
  bytes: number;
}

/** One process of a distributed run. */
export interface RankJson {
  rank: number;
  device: string;
  pid: number;
  peak_allocated: number;
  peak_reserved: number;
  /** Bytes outside PyTorch, null when unknown. */
  outside: number | null;
  oom: boolean;
  requested: number | null;
  /** The rank whose request failed first. */
  first_failed: boolean;
  /** The rank with the least headroom. */
  bottleneck: boolean;
}

/** A name the failed cell had bound to device memory, dropped with its attempt: `[name, bytes]`. */
export type DroppedJson = [name: string, bytes: number];

/** A notebook function a fix redefined: its text as the notebook holds it (null: unknown), and now. */
export interface RedefinedJson {
  name: string;
  was: string | null;
  now: string;
}

/** What writing a fitted run into the notebook changes (`oommagic/diagnosis/write_back.py`). */
export interface CellWriteJson {
  /** The cell's body without the `%%gpumem` line and without the redefined functions. */
  body: string;
  functions: RedefinedJson[];
}

/** One execution of a `%%gpumem` cell. Bytes are integers; null where nothing was measured. */
export interface CellRunJson {
  version: number;
  id: string;
  /** The run this one retried, if it is a retry. */
  parent: string | null;
  /** What ran: the cell's body with the fixes in force written in. */
  source: string;
  /** The body as the person wrote it; null when it is `source`. */
  original: string | null;
  device: string;
  options: Record<string, unknown>;
  /** The fixes in force for this run, in the order they were applied. */
  applied: RemedyJson[];
  execution_count: number | null;
  /** The notebook cell's model id (JupyterLab sends it with the execute request). */
  cell_id: string | null;
  /** Seconds since the epoch. */
  started: number;
  wall_s: number;
  outcome: Outcome;
  headline: string;
  before_allocated: number;
  before_reserved: number;
  after_allocated: number;
  after_reserved: number;
  peak_allocated: number;
  peak_reserved: number;
  capacity: number | null;
  limit: number | null;
  headroom: number | null;
  timeline: TimelineJson;
  report: OOMReportJson | null;
  /** Bytes given back after the error. */
  freed: number | null;
  dropped: DroppedJson[];
  error: string | null;
  findings: FindingJson[];
  /** The measured fix plan of an out-of-memory run, else null. */
  plan: FixPlanJson | null;
  /** The fixes in force, as one line ("Batch 64 → 32"), null when none. */
  change: string | null;
  /** The bytes the run could use (newer kernels); else `budgetOf` reads limit and capacity. */
  budget?: number | null;
  /** Memory by category (newer kernels). */
  categories?: CategoryJson[];
  /** One row per process of a distributed run (newer kernels). */
  ranks?: RankJson[];
  /** For a run that fits with a rewritten source: what writing it into the notebook changes. */
  write?: CellWriteJson | null;
}

export type KernelMessage =
  | { kind: 'hello'; runs: CellRunJson[]; problems: string[] }
  | { kind: 'run'; run: CellRunJson; problems: string[] }
  /** The kernel could not do a sidebar action on run `run`. */
  | { kind: 'error'; run: string | null; message: string }
  /** A fix pressed in the report fitted: write run `run` into the notebook. */
  | { kind: 'write'; run: string; cellId: string | null; write: CellWriteJson }
  | { kind: 'unknown'; notice: string; detail: string };

/** Ask the kernel to send its hello again. */
export const SYNC_REQUEST = { type: 'sync' } as const;

/** What the sidebar asks the kernel to do with a run, or tells it (`written`: run written into cells). */
export type ActionRequest =
  | { type: 'apply'; run: string; entry: number }
  | { type: 'remove'; run: string; index: number }
  | { type: 'written'; run: string };

/** Run `run`'s cell again with its plan entry `entry` stacked on the fixes in force. */
export function applyRequest(run: string, entry: number): ActionRequest {
  return { type: 'apply', run, entry };
}

/** Run `run`'s cell again without `applied[index]`. */
export function removeRequest(run: string, index: number): ActionRequest {
  return { type: 'remove', run, index };
}

export const OUTCOMES: readonly Outcome[] = [
  'ok',
  'oom',
  'error',
  'interrupted'
];

/** A value read against a shape, with what did not match it (empty when all did). */
export interface Checked<T> {
  value: T;
  problems: string[];
}

const bytes = integer;
const maybeBytes = nullable(integer);

const REMEDY: Shape<RemedyJson> = {
  kind: text,
  title: text,
  explanation: text,
  code: nullable(text),
  automatic: flag,
  saving: maybeBytes,
  params: anyObject,
  new_source: nullable(text)
};

const FINDING: Shape<FindingJson> = {
  key: text,
  title: text,
  evidence: text,
  saving: maybeBytes,
  score: real,
  remedies: listOf(record(REMEDY))
};

const PLAN_ENTRY: Shape<PlanEntryJson> = {
  kind: text,
  title: text,
  fixes: listOf(record(REMEDY)),
  verdict: oneOf(VERDICTS, 'not measured'),
  peak: maybeBytes,
  budget: maybeBytes,
  seconds_per_step: nullable(real),
  time_ratio: nullable(real),
  method: text,
  note: text,
  line: text
};

const FIX_PLAN: Shape<FixPlanJson> = {
  entries: listOf(record(PLAN_ENTRY)),
  summary: text,
  budget_s: real,
  spent_s: real,
  trials: integer,
  snapshot_bytes: bytes,
  stopped: flag,
  unfittable: text,
  notes: listOf(text)
};

const CATEGORY: Shape<CategoryJson> = { key: text, label: text, bytes };

const RANK: Shape<RankJson> = {
  rank: integer,
  device: text,
  pid: integer,
  peak_allocated: bytes,
  peak_reserved: bytes,
  outside: maybeBytes,
  oom: flag,
  requested: maybeBytes,
  first_failed: flag,
  bottleneck: flag
};

/** A plain object's entries, or none. */
function entries(value: unknown): Record<string, unknown> {
  return value !== null && typeof value === 'object' && !Array.isArray(value)
    ? (value as Record<string, unknown>)
    : {};
}

/**
 * `categories` as the kernel writes it (`{order, labels, bytes, ...}`, oommagic/categories.py), or a list
 * of `{key, label, bytes}`; null (no breakdown) is an empty list.
 */
const readCategories: Reader<CategoryJson[]> = (value, at, problems) => {
  if (value === null) {
    return [];
  }
  if (Array.isArray(value)) {
    return listOf(record(CATEGORY))(value, at, problems);
  }
  const data = entries(value);
  const sizes = entries(data.bytes);
  const labels = entries(data.labels);
  const order = Array.isArray(data.order) ? data.order : Object.keys(sizes);
  if (!Object.keys(sizes).length) {
    problems.push(`${at}: expected the categories' bytes`);
    return [];
  }
  return order
    .filter(
      (key): key is string =>
        typeof key === 'string' && typeof sizes[key] === 'number'
    )
    .map(key => ({
      key,
      label: typeof labels[key] === 'string' ? (labels[key] as string) : key,
      bytes: sizes[key] as number
    }));
};

/**
 * `ranks` as the kernel writes it (`{ranks: [...], failed_first, bottleneck, ...}`,
 * oommagic/diagnosis/ranks.py), or a list of rank rows; null (one process) is an empty list.
 */
const readRanks: Reader<RankJson[]> = (value, at, problems) => {
  if (value === null) {
    return [];
  }
  if (Array.isArray(value)) {
    return listOf(record(RANK))(value, at, problems);
  }
  const data = entries(value);
  const rows = Array.isArray(data.ranks) ? data.ranks : [];
  return rows.map(row => {
    const r = entries(row);
    const num = (v: unknown): number | null =>
      typeof v === 'number' ? v : null;
    return {
      rank: num(r.rank) ?? 0,
      device: typeof r.device === 'string' ? r.device : '',
      pid: num(r.pid) ?? 0,
      peak_allocated: num(r.peak_allocated) ?? 0,
      peak_reserved: num(r.peak_reserved) ?? 0,
      outside: num(r.outside),
      oom: r.status === 'oom',
      requested: num(r.requested),
      first_failed: data.failed_first === r.rank,
      bottleneck: data.bottleneck === r.rank
    };
  });
};

const REDEFINED: Shape<RedefinedJson> = {
  name: text,
  was: nullable(text),
  now: text
};

const CELL_WRITE: Shape<CellWriteJson> = {
  body: text,
  functions: listOf(record(REDEFINED))
};

const OOM_REPORT: Shape<OOMReportJson> = {
  text,
  device: nullable(text),
  gpu_index: nullable(integer),
  requested: maybeBytes,
  capacity: maybeBytes,
  free: maybeBytes,
  allocated: maybeBytes,
  reserved: maybeBytes,
  reserved_unallocated: maybeBytes,
  process_used: maybeBytes,
  other_processes: listOf(pair(integer, bytes)),
  limit: maybeBytes,
  source: text,
  emulated: flag
};

const TIMELINE: Shape<TimelineJson> = {
  t: listOf(real),
  allocated: listOf(bytes),
  reserved: listOf(bytes),
  steps: listOf(real),
  oom_at: nullable(real),
  truncated: flag,
  events: integer
};

/** The reader of every field of a `CellRunJson`; `savedRuns.ts` reads its summaries with a part of it. */
export const CELL_RUN: Shape<CellRunJson> = {
  version: integer,
  id: text,
  parent: nullable(text),
  source: text,
  original: nullable(text),
  device: text,
  options: anyObject,
  applied: listOf(record(REMEDY)),
  execution_count: nullable(integer),
  cell_id: nullable(text),
  started: real,
  wall_s: real,
  outcome: oneOf(OUTCOMES, 'error'),
  headline: text,
  before_allocated: bytes,
  before_reserved: bytes,
  after_allocated: bytes,
  after_reserved: bytes,
  peak_allocated: bytes,
  peak_reserved: bytes,
  capacity: maybeBytes,
  limit: maybeBytes,
  headroom: maybeBytes,
  timeline: readTimeline,
  report: nullable(record(OOM_REPORT)),
  freed: maybeBytes,
  dropped: listOf(pair(text, bytes)),
  error: nullable(text),
  findings: listOf(record(FINDING)),
  plan: nullable(record(FIX_PLAN)),
  change: nullable(text),
  budget: optional(maybeBytes),
  categories: optional(readCategories),
  ranks: optional(readRanks),
  write: optional(nullable(record(CELL_WRITE)))
};

/** Read a comm message's `data`; never throws. */
export function parseKernelMessage(data: unknown): KernelMessage {
  if (!isObject(data)) {
    return unknown('?', `not an object: ${describe(data)}`);
  }
  const version = data.version;
  if (version !== PROTOCOL_VERSION) {
    const shown =
      typeof version === 'number' || typeof version === 'string'
        ? version
        : '?';
    return unknown(shown, `this sidebar speaks version ${PROTOCOL_VERSION}`);
  }
  if (data.type === 'hello') {
    if (!Array.isArray(data.runs)) {
      return unknown(version, 'hello without a list of runs');
    }
    const checked = data.runs.map(checkCellRun).filter(isChecked);
    return {
      kind: 'hello',
      runs: checked.map(c => c.value),
      problems: checked.flatMap(c => c.problems)
    };
  }
  if (data.type === 'run') {
    const checked = checkCellRun(data.run);
    return checked
      ? { kind: 'run', run: checked.value, problems: checked.problems }
      : unknown(version, 'run without a valid run record');
  }
  if (data.type === 'write') {
    const problems: string[] = [];
    const write = record(CELL_WRITE)(data.write, 'write', problems);
    return typeof data.run === 'string' &&
      isObject(data.write) &&
      !problems.length
      ? {
          kind: 'write',
          run: data.run,
          cellId: typeof data.cell_id === 'string' ? data.cell_id : null,
          write
        }
      : unknown(
          version,
          `write without a valid cell write: ${problems.join('; ')}`
        );
  }
  if (data.type === 'error') {
    return {
      kind: 'error',
      run: typeof data.run === 'string' ? data.run : null,
      message:
        typeof data.message === 'string' && data.message
          ? data.message
          : 'the kernel could not do that'
    };
  }
  return unknown(version, `unknown type ${describe(data.type)}`);
}

/**
 * A `CellRun` json read against `CELL_RUN`, with the fields that did not match it (each named with
 * the run's id); null when it has no string `id` and so is no run at all. Declared fields that are
 * missing or mistyped get their empty value; fields a newer kernel adds are left out.
 */
export function checkCellRun(value: unknown): Checked<CellRunJson> | null {
  if (!isObject(value) || typeof value.id !== 'string' || value.id === '') {
    return null;
  }
  const problems: string[] = [];
  const run = record(CELL_RUN)(value, `run ${value.id}`, problems);
  return { value: run, problems };
}

/** `checkCellRun` without the problems. */
export function parseCellRun(value: unknown): CellRunJson | null {
  return checkCellRun(value)?.value ?? null;
}

/**
 * The bytes a run could use: the kernel's own `budget` where it sends one, else the limit if one was
 * set, else the card's capacity.
 */
export function budgetOf(run: {
  budget?: number | null;
  limit: number | null;
  capacity: number | null;
}): number | null {
  return run.budget ?? run.limit ?? run.capacity;
}

/** The timeline's lists, cut to a common length so that the sparkline can zip them. */
function readTimeline(
  value: unknown,
  at: string,
  problems: string[]
): TimelineJson {
  const timeline = record(TIMELINE)(value, at, problems);
  const { t, allocated, reserved } = timeline;
  const n = Math.min(t.length, allocated.length);
  if (t.length !== allocated.length || reserved.length < n) {
    problems.push(
      `${at}: t, allocated and reserved have ${t.length}, ${allocated.length} and ${reserved.length} entries`
    );
  }
  return {
    ...timeline,
    t: t.slice(0, n),
    allocated: allocated.slice(0, n),
    reserved:
      reserved.length >= n ? reserved.slice(0, n) : allocated.slice(0, n)
  };
}

function unknown(version: number | string, detail: string): KernelMessage {
  return {
    kind: 'unknown',
    notice: `unknown message from oommagic v${version}`,
    detail
  };
}

function isChecked(
  checked: Checked<CellRunJson> | null
): checked is Checked<CellRunJson> {
  return checked !== null;
}
