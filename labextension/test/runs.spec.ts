import { listRuns, mergeLive } from '../src/runs';
import { summarize } from '../src/savedRuns';
import { oomRun } from './fixtures';

describe('listRuns', () => {
  it('marks a run that a later run retried as retried', () => {
    const failed = oomRun({ id: 'failed', started: 1 });
    const retry = oomRun({
      id: 'retry',
      parent: 'failed',
      outcome: 'ok',
      started: 2,
      findings: []
    });
    const entries = listRuns([failed, retry], []);
    expect(entries.map(e => [e.run.id, e.status])).toEqual([
      ['retry', 'ok'],
      ['failed', 'retried']
    ]);
  });

  it('lists saved runs the kernel did not send, marked saved, and a live one only once', () => {
    const live = oomRun({ id: 'live', started: 5 });
    const saved = [
      {
        cellId: 'cell-2',
        executionCount: 7,
        runs: [summarize(oomRun({ id: 'old', started: 1 })), summarize(live)]
      }
    ];
    const entries = listRuns([live], saved);
    expect(entries.map(e => [e.run.id, e.saved, e.executionCount])).toEqual([
      ['live', false, 2],
      ['old', true, 7]
    ]);
    // A saved run is its summary: no timeline, no findings to draw.
    expect(entries[1].run).toEqual(saved[0].runs[0]);
    expect(entries[1].run).not.toHaveProperty('timeline');
  });
});

describe('mergeLive', () => {
  it('replaces by id and keeps arrival order', () => {
    const merged = mergeLive(
      [oomRun({ id: 'a' }), oomRun({ id: 'b' })],
      [oomRun({ id: 'a', outcome: 'ok' })]
    );
    expect(merged.map(r => [r.id, r.outcome])).toEqual([
      ['a', 'ok'],
      ['b', 'oom']
    ]);
  });
});

describe('saved runs', () => {
  it('take a failed run that the cell ran again after as retried', () => {
    const saved = [
      {
        cellId: 'cell-2',
        executionCount: 4,
        runs: [
          summarize(oomRun({ id: 'failed', started: 1 })),
          summarize(oomRun({ id: 'fixed', outcome: 'ok', started: 2 }))
        ]
      },
      {
        cellId: 'cell-3',
        executionCount: 5,
        runs: [summarize(oomRun({ id: 'still-failing', started: 3 }))]
      }
    ];
    expect(listRuns([], saved).map(e => [e.run.id, e.status])).toEqual([
      ['still-failing', 'oom'],
      ['fixed', 'ok'],
      ['failed', 'retried']
    ]);
  });
});
