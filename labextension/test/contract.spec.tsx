/**
 * The contract with the kernel side: the runs in `fixtures/cellrun.json` were written by Python's
 * `CellRun.to_json()` (`tests/test_protocol_fixture.py` fails when it writes anything else), and the
 * sidebar's parser reads every field it declares from them with no problem. A field renamed, dropped
 * or retyped on either side fails here or there.
 */
import { renderToStaticMarkup } from 'react-dom/server';
import * as React from 'react';

import { GivenBack } from '../src/components/GivenBack';
import {
  CELL_RUN,
  checkCellRun,
  parseCellRun,
  parseKernelMessage
} from '../src/protocol';
import { isOptional } from '../src/json';
import { fittedRunOf, planRows, sourceToWrite } from '../src/plan';
import { listRuns } from '../src/runs';
import { KERNEL_RUNS, kernelRun } from './fixtures';

const NAMES = Object.keys(KERNEL_RUNS);
const MiB = 2 ** 20;
const GiB = 2 ** 30;

describe('runs written by CellRun.to_json()', () => {
  it('are the runs the Python test writes', () => {
    expect(NAMES).toEqual([
      'ok',
      'oom_batch',
      'retry',
      'oom_dropped',
      'error',
      'cuda_oom'
    ]);
  });

  it.each(NAMES)('%s: every declared field is there with its type', name => {
    const raw = KERNEL_RUNS[name] as Record<string, unknown>;
    for (const [field, read] of Object.entries(CELL_RUN)) {
      if (!isOptional(read)) {
        expect(raw).toHaveProperty([field]);
      }
    }
    expect(checkCellRun(raw)?.problems).toEqual([]);
  });

  it('arrive in a hello without a problem', () => {
    const message = parseKernelMessage({
      version: 1,
      type: 'hello',
      runs: Object.values(KERNEL_RUNS)
    });
    expect(message).toMatchObject({ kind: 'hello', problems: [] });
    expect(message.kind === 'hello' && message.runs.length).toBe(NAMES.length);
  });

  it('give the names a failed cell had bound and the bytes given back', () => {
    const run = kernelRun('oom_dropped');
    expect(run.outcome).toBe('oom');
    expect(run.dropped).toEqual([['bound_big', 32 * MiB]]);
    expect(run.freed).toBe(32 * MiB);
    const html = renderToStaticMarkup(<GivenBack run={run} />);
    expect(html).toContain('given back after the error: 32.00 MiB');
    expect(html).toContain('<code>bound_big</code> (32.00 MiB)');
  });

  it('link a retry to the run it retried, with the change it made', () => {
    const failed = kernelRun('oom_batch');
    const retry = kernelRun('retry');
    expect(retry.parent).toBe(failed.id);
    expect(retry.change).toMatch(/^Batch 64 → \d+\b/);
    expect(listRuns([failed, retry], []).map(e => e.status)).toEqual([
      'ok',
      'retried'
    ]);
  });

  it('carry the measured plan of an out-of-memory run, the fitting entry first', () => {
    const failed = kernelRun('oom_batch');
    const [first] = planRows(failed);
    expect(first).toMatchObject({
      index: 0,
      recommended: true,
      runnable: true
    });
    expect(first.entry.verdict).toBe('fits');
    expect(first.entry.line).toMatch(/^fits — peak [\d.]+ MiB of 64\.00 MiB/);
    expect(sourceToWrite(first.entry, null)).toMatch(/^batch_size = 12\n/);
    expect(kernelRun('cuda_oom').plan?.entries).toEqual([]);
  });

  it('carry the fixes in force of the run the plan made, and the cell as written', () => {
    const failed = kernelRun('oom_batch');
    const retry = kernelRun('retry');
    const entry = failed.plan!.entries[0];
    expect(retry.applied.map(f => f.title)).toEqual([entry.title]);
    expect(retry.original).toBe(failed.source);
    expect(retry.source).toBe(entry.fixes[0].new_source);
    expect(fittedRunOf(failed, entry, [retry])).toBe(retry);
    expect(failed.applied).toEqual([]);
    expect(failed.original).toBeNull();
  });

  it('carry a remedy that rewrites the cell', () => {
    const remedies = kernelRun('oom_batch').findings.flatMap(f => f.remedies);
    const batch = remedies.find(r => r.kind === 'batch');
    expect(batch?.new_source).toMatch(/^batch_size = \d+\n/);
    expect(batch?.automatic).toBe(true);
    expect(typeof batch?.saving).toBe('number');
  });

  it('carry the figures parse_oom read from a CUDA message', () => {
    const report = kernelRun('cuda_oom').report;
    expect(report).toMatchObject({
      device: 'cuda',
      gpu_index: 0,
      requested: 8 * GiB,
      free: Math.round(3.29 * GiB),
      other_processes: [[4242, 20 * GiB]],
      emulated: false
    });
  });

  it('carry an error run with its message and a timeline the sparkline can zip', () => {
    const run = kernelRun('error');
    expect(run.error).toBe('ValueError: boom 42');
    expect(run.timeline.t.length).toBe(run.timeline.allocated.length);
  });
});

describe('the parser', () => {
  const raw = KERNEL_RUNS.oom_batch as Record<string, unknown>;

  it('ignores the fields a newer kernel adds', () => {
    const newer = { ...raw, shards: [0, 1], compiled: { mode: 'max' } };
    const checked = checkCellRun(newer);
    expect(checked?.problems).toEqual([]);
    expect(checked?.value).toEqual(parseCellRun(raw));
    expect(checked?.value).not.toHaveProperty('shards');
  });

  it('reads the categories the kernel writes, and no ranks for one process', () => {
    const run = kernelRun('oom_batch');
    expect(run.categories?.map(c => c.key)).toContain('activations');
    expect(run.categories?.every(c => c.bytes >= 0 && c.label.length > 0)).toBe(
      true
    );
    expect(run.ranks ?? []).toEqual([]);
    expect(run).not.toHaveProperty('budget');
  });

  it('reads categories, ranks and budget when the kernel sends them', () => {
    const categories = [
      { key: 'parameters', label: 'parameters', bytes: 8 * MiB },
      { key: 'activations', label: 'activations', bytes: 56 * MiB }
    ];
    const ranks = [
      {
        rank: 1,
        device: 'cuda:1',
        pid: 4243,
        peak_allocated: 60 * MiB,
        peak_reserved: 64 * MiB,
        outside: null,
        oom: true,
        requested: 256 * MiB,
        first_failed: true,
        bottleneck: true
      }
    ];
    const checked = checkCellRun({
      ...raw,
      categories,
      ranks,
      budget: 64 * MiB
    });
    expect(checked?.problems).toEqual([]);
    expect(checked?.value.categories).toEqual(categories);
    expect(checked?.value.ranks).toEqual(ranks);
    expect(checked?.value.budget).toBe(64 * MiB);
  });

  it('names categories of another shape as a problem, and keeps the run', () => {
    const checked = checkCellRun({
      ...raw,
      categories: { activations: 64 * MiB }
    });
    expect(checked?.problems).toEqual([
      "run run-1.categories: expected the categories' bytes"
    ]);
    expect(checked?.value.categories).toEqual([]);
    expect(checked?.value.peak_reserved).toBe(64 * MiB);
  });

  it('names a declared field that is missing or mistyped', () => {
    const withoutDropped = { ...raw };
    delete withoutDropped.dropped;
    expect(checkCellRun(withoutDropped)?.problems).toEqual([
      'run run-1.dropped: missing'
    ]);
    expect(
      checkCellRun({ ...raw, peak_allocated: 67108864.5 })?.problems
    ).toEqual([
      'run run-1.peak_allocated: expected an integer, got 67108864.5'
    ]);
    expect(
      checkCellRun({ ...raw, dropped: [['x', '32MiB']] })?.problems
    ).toEqual(['run run-1.dropped[0][1]: expected an integer, got "32MiB"']);
  });

  it('still gives the panel a run with empty values for what was wrong', () => {
    const run = parseCellRun({ ...raw, capacity: 'big', findings: 'none' });
    expect(run?.capacity).toBeNull();
    expect(run?.findings).toEqual([]);
    expect(run?.peak_allocated).toBe(64 * MiB);
  });
});
