import { mergeSaved, readSaved, summarize } from '../src/savedRuns';
import { oomRun } from './fixtures';

const summary = (id: string, started: number) => ({
  ...summarize(oomRun({ id })),
  started
});

describe('summarize', () => {
  it('keeps only the small figures a reopened notebook needs', () => {
    expect(summarize(oomRun())).toEqual({
      id: 'run-1',
      outcome: 'oom',
      peak_allocated: 64 * 2 ** 20,
      peak_reserved: 64 * 2 ** 20,
      capacity: 64 * 2 ** 20,
      limit: 64 * 2 ** 20,
      headline: 'needed 256.00 MiB more than the 64.00 MiB limit had',
      started: 1718000001
    });
  });
});

describe('mergeSaved', () => {
  it('starts the list in a cell without metadata', () => {
    expect(mergeSaved(undefined, [summary('a', 1)])).toEqual({
      runs: [summary('a', 1)]
    });
  });

  it('appends in start order and keeps the last five', () => {
    let metadata: unknown = undefined;
    for (let i = 1; i <= 7; i++) {
      metadata = mergeSaved(metadata, [summary(`r${i}`, i)]) ?? metadata;
    }
    expect(readSaved(metadata).map(r => r.id)).toEqual([
      'r3',
      'r4',
      'r5',
      'r6',
      'r7'
    ]);
  });

  it('replaces a run it already has instead of listing it twice', () => {
    const first = mergeSaved(undefined, [summary('a', 1)]);
    const changed = { ...summary('a', 1), outcome: 'ok' as const };
    expect(mergeSaved(first, [changed])).toEqual({ runs: [changed] });
  });

  it('answers null when nothing changes, so the notebook is not marked dirty', () => {
    const metadata = mergeSaved(undefined, [summary('a', 1), summary('b', 2)]);
    expect(
      mergeSaved(JSON.parse(JSON.stringify(metadata)), [summary('b', 2)])
    ).toBeNull();
  });

  it('repairs metadata someone else broke', () => {
    expect(mergeSaved({ runs: 'nope' }, [summary('a', 1)])).toEqual({
      runs: [summary('a', 1)]
    });
    expect(readSaved({ runs: [{ id: 3 }, summary('a', 1), null] })).toEqual([
      summary('a', 1)
    ]);
  });
});
