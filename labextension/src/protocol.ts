/**
 * The comm protocol between the kernel (`oommagic/comm.py`) and the sidebar, version 1, and the shape
 * of the `CellRun` record it carries (`oommagic/cellrun.py`, `CellRun.to_json`).
 *
 * The kernel opens the comm (target `oommagic`) with `{"version":1,"type":"hello","runs":[...]}` (all
 * runs so far) and then sends `{"version":1,"type":"run","run":{...}}` after each run; the frontend
 * sends `{"type":"sync"}` to have the hello sent again. Parsing never throws: anything else becomes an
 * `unknown` message whose notice the panel shows in one line.
 */

import { describe, isObject, num, numbers, str } from './json';

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

/** One execution of a `%%gpumem` cell. Bytes are integers; null where nothing was measured. */
export interface CellRunJson {
  version: number;
  id: string;
  /** The run this one retried, if it is a retry. */
  parent: string | null;
  source: string;
  device: string;
  options: Record<string, unknown>;
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
  report: Record<string, unknown> | null;
  freed: number | null;
  error: string | null;
  findings: FindingJson[];
  change: string | null;
}

export type KernelMessage =
  | { kind: 'hello'; runs: CellRunJson[] }
  | { kind: 'run'; run: CellRunJson }
  | { kind: 'unknown'; notice: string; detail: string };

/** The one message the frontend sends: ask the kernel to send its hello again. */
export const SYNC_REQUEST = { type: 'sync' } as const;

export const OUTCOMES: readonly Outcome[] = [
  'ok',
  'oom',
  'error',
  'interrupted'
];

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
    const runs = data.runs.map(parseCellRun).filter(isRun);
    return { kind: 'hello', runs };
  }
  if (data.type === 'run') {
    const run = parseCellRun(data.run);
    return run
      ? { kind: 'run', run }
      : unknown(version, 'run without a valid run record');
  }
  return unknown(version, `unknown type ${describe(data.type)}`);
}

/**
 * A `CellRun` json with every field present and of its type; null when it has no string `id`.
 * Fields a newer kernel adds are kept; missing or mistyped ones get the empty value.
 */
export function parseCellRun(value: unknown): CellRunJson | null {
  if (!isObject(value) || typeof value.id !== 'string' || value.id === '') {
    return null;
  }
  const outcome = (OUTCOMES as readonly unknown[]).includes(value.outcome)
    ? value.outcome
    : 'error';
  return {
    ...value,
    version: num(value.version) ?? PROTOCOL_VERSION,
    id: value.id,
    parent: str(value.parent),
    source: str(value.source) ?? '',
    device: str(value.device) ?? '',
    options: isObject(value.options) ? value.options : {},
    execution_count: num(value.execution_count),
    cell_id: str(value.cell_id),
    started: num(value.started) ?? 0,
    wall_s: num(value.wall_s) ?? 0,
    outcome: outcome as Outcome,
    headline: str(value.headline) ?? '',
    before_allocated: num(value.before_allocated) ?? 0,
    before_reserved: num(value.before_reserved) ?? 0,
    after_allocated: num(value.after_allocated) ?? 0,
    after_reserved: num(value.after_reserved) ?? 0,
    peak_allocated: num(value.peak_allocated) ?? 0,
    peak_reserved: num(value.peak_reserved) ?? 0,
    capacity: num(value.capacity),
    limit: num(value.limit),
    headroom: num(value.headroom),
    timeline: parseTimeline(value.timeline),
    report: isObject(value.report) ? value.report : null,
    freed: num(value.freed),
    error: str(value.error),
    findings: Array.isArray(value.findings)
      ? value.findings.filter(isObject).map(parseFinding)
      : [],
    change: str(value.change)
  };
}

/** The bytes a run could use: its limit if one was set, else the card's capacity. */
export function budgetOf(run: {
  limit: number | null;
  capacity: number | null;
}): number | null {
  return run.limit ?? run.capacity;
}

function parseTimeline(value: unknown): TimelineJson {
  const data = isObject(value) ? value : {};
  const t = numbers(data.t);
  const allocated = numbers(data.allocated);
  const reserved = numbers(data.reserved);
  const n = Math.min(t.length, allocated.length);
  return {
    t: t.slice(0, n),
    allocated: allocated.slice(0, n),
    reserved:
      reserved.length >= n ? reserved.slice(0, n) : allocated.slice(0, n),
    steps: numbers(data.steps),
    oom_at: num(data.oom_at),
    truncated: data.truncated === true,
    events: num(data.events) ?? 0
  };
}

function parseFinding(value: Record<string, unknown>): FindingJson {
  return {
    key: str(value.key) ?? '',
    title: str(value.title) ?? '',
    evidence: str(value.evidence) ?? '',
    saving: num(value.saving),
    score: num(value.score) ?? 0,
    remedies: Array.isArray(value.remedies)
      ? value.remedies.filter(isObject).map(parseRemedy)
      : []
  };
}

function parseRemedy(value: Record<string, unknown>): RemedyJson {
  return {
    kind: str(value.kind) ?? '',
    title: str(value.title) ?? '',
    explanation: str(value.explanation) ?? '',
    code: str(value.code),
    automatic: value.automatic === true,
    saving: num(value.saving),
    params: isObject(value.params) ? value.params : {},
    new_source: str(value.new_source)
  };
}

function unknown(version: number | string, detail: string): KernelMessage {
  return {
    kind: 'unknown',
    notice: `unknown message from oommagic v${version}`,
    detail
  };
}

function isRun(run: CellRunJson | null): run is CellRunJson {
  return run !== null;
}
