/**
 * @jest-environment jsdom
 */
/**
 * The fix plan on a run card, the fixes in force with their ✕, a run that fits after a fix, memory
 * by category and per-rank rows: built from the runs Python wrote (`fixtures/cellrun.json`), with
 * plan entries and categories varied where the fixture has only one kind.
 */
import * as React from 'react';
import { act } from 'react';
import { createRoot, Root } from 'react-dom/client';

import { CategoryBar } from '../src/components/CategoryBar';
import { RankTable } from '../src/components/RankTable';
import { RunCard } from '../src/components/RunCard';
import {
  clearsCellError,
  fitsWithFixes,
  fittedRunOf,
  planRows,
  rootOf,
  sourceToWrite
} from '../src/plan';
import { CellRunJson, PlanEntryJson, RankJson } from '../src/protocol';
import { listRuns } from '../src/runs';
import { isOutOfMemoryError } from '../src/staleError';
import { cardProps } from './cardProps';
import { kernelRun } from './fixtures';

// React 18's act() outside a test renderer.
(
  globalThis as { IS_REACT_ACT_ENVIRONMENT?: boolean }
).IS_REACT_ACT_ENVIRONMENT = true;

const MiB = 2 ** 20;

const failed = kernelRun('oom_batch');
const fitted = { ...kernelRun('retry'), cell_id: 'c1' };
const batch = failed.plan!.entries[0];
const checkpointing = {
  ...batch.fixes[0],
  kind: 'checkpointing',
  title: 'Gradient checkpointing',
  new_source: 'model.gradient_checkpointing_enable()\n'
};

function entry(overrides: Partial<PlanEntryJson>): PlanEntryJson {
  return { ...batch, ...overrides };
}

/** The failed run with these plan entries (and `unfittable`). */
function withPlan(entries: PlanEntryJson[], unfittable = ''): CellRunJson {
  return { ...failed, plan: { ...failed.plan!, entries, unfittable } };
}

const combination = entry({
  kind: 'checkpointing+batch',
  title: `Gradient checkpointing + ${batch.title}`,
  fixes: [checkpointing, batch.fixes[0]],
  verdict: 'fits',
  line: 'fits — peak 40.00 MiB of 64.00 MiB'
});
const notMeasured = entry({
  kind: 'autocast',
  title: 'Mixed precision',
  verdict: 'not measured',
  line: 'not measured'
});
const tooBig = entry({
  kind: 'expandable_segments',
  title: 'Expandable segments',
  verdict: 'does not fit',
  line: 'does not fit — peak at least 80.00 MiB of 64.00 MiB'
});

describe('planRows', () => {
  it('puts the first entry that fits first and keeps the others in the plan order', () => {
    const rows = planRows(withPlan([notMeasured, tooBig, combination]));
    expect(rows.map(r => [r.index, r.recommended, r.runnable])).toEqual([
      [2, true, true],
      [0, false, true],
      [1, false, false]
    ]);
  });

  it('recommends nothing when nothing fits', () => {
    expect(planRows(withPlan([tooBig])).some(r => r.recommended)).toBe(false);
    expect(planRows({ ...failed, plan: null })).toEqual([]);
  });
});

describe('what "Apply to cell" writes', () => {
  it("writes a single fix's rewrite", () => {
    expect(sourceToWrite(batch, null)).toBe(batch.fixes[0].new_source);
  });

  it('writes what the fitting run ran for a combination, once it arrived', () => {
    expect(sourceToWrite(combination, null)).toBeNull();
    const ran = {
      ...fitted,
      applied: combination.fixes,
      source: 'model.gradient_checkpointing_enable()\nbatch_size = 12\n'
    };
    const parent = withPlan([combination]);
    expect(fittedRunOf(parent, combination, [ran])).toBe(ran);
    expect(sourceToWrite(combination, ran)).toBe(ran.source);
    // A run of the cell with another fix is not the combination's.
    expect(fittedRunOf(parent, combination, [fitted])).toBeNull();
  });
});

describe('a run that fits after a fix', () => {
  const parent = { ...failed, cell_id: 'c1', started: 100 };
  const child = { ...fitted, started: 110 };

  it('is a child run with fixes in force and outcome ok', () => {
    expect(fitsWithFixes(child)).toBe(true);
    expect(fitsWithFixes(failed)).toBe(false);
    expect(fitsWithFixes({ ...child, applied: [] })).toBe(false);
  });

  it('makes the error of the failed execution it descends from stale', () => {
    expect(clearsCellError(child, [parent, child])).toBe(true);
    // Through a retry that failed too (an entry not measured).
    const between = { ...child, id: 'between', outcome: 'oom' as const };
    const last = { ...child, id: 'last', parent: 'between', started: 120 };
    expect(rootOf(last, [parent, between, last])).toBe(parent);
    expect(clearsCellError(last, [parent, between, last])).toBe(true);
  });

  it("leaves another cell's outputs, and a cell that ran again since, alone", () => {
    expect(clearsCellError(child, [{ ...parent, cell_id: 'c2' }, child])).toBe(
      false
    );
    const rerun = { ...parent, id: 'rerun', started: 105 };
    expect(clearsCellError(child, [parent, rerun, child])).toBe(false);
    expect(clearsCellError(child, [child])).toBe(false);
    expect(clearsCellError({ ...child, outcome: 'oom' }, [parent, child])).toBe(
      false
    );
  });

  it('knows the error output it takes away', () => {
    const oom = {
      output_type: 'error',
      ename: 'OutOfMemoryError',
      evalue: '',
      traceback: ['\u001b[0;31mOutOfMemoryError\u001b[0m: needed …']
    };
    expect(isOutOfMemoryError(oom)).toBe(true);
    expect(
      isOutOfMemoryError({ ...oom, ename: 'torch.OutOfMemoryError' })
    ).toBe(true);
    expect(isOutOfMemoryError({ ...oom, ename: 'ValueError' })).toBe(false);
    expect(
      isOutOfMemoryError({ output_type: 'stream', name: 'stderr', text: '' })
    ).toBe(false);
  });
});

describe('the run card', () => {
  let host: HTMLDivElement;
  let root: Root;

  beforeEach(() => {
    host = document.createElement('div');
    document.body.appendChild(host);
    root = createRoot(host);
  });

  afterEach(() => {
    act(() => root.unmount());
    host.remove();
  });

  function show(run: CellRunJson, props = {}): void {
    const [e] = listRuns([run], []).filter(x => x.run.id === run.id);
    act(() => root.render(<RunCard {...cardProps(e, props)} />));
  }

  it('lists the plan, the recommended entry first with "Run with this fix", and sends apply', () => {
    const onRunPlanEntry = jest.fn();
    show(withPlan([notMeasured, tooBig, combination]), { onRunPlanEntry });
    const entries = [...host.querySelectorAll('.oommagic-plan-entry')];
    expect(entries.map(e => e.getAttribute('data-entry'))).toEqual([
      '2',
      '0',
      '1'
    ]);
    expect(entries[0].textContent).toContain('fits — peak 40.00 MiB');
    expect(entries[0].classList).toContain('oommagic-verdict-fits');
    expect(entries[2].classList).toContain('oommagic-verdict-does-not-fit');
    const primary = host.querySelector<HTMLButtonElement>(
      '.oommagic-run-fix-primary'
    )!;
    expect(primary.textContent).toBe('Run with this fix');
    // Entries measured not to fit are shown, not offered.
    expect(host.querySelectorAll('.oommagic-run-fix')).toHaveLength(2);
    expect(entries[2].querySelector('.oommagic-run-fix')).toBeNull();
    act(() => primary.click());
    expect(onRunPlanEntry).toHaveBeenCalledWith(2, combination.title);
  });

  it('offers "Apply to cell" for a single fix, and for a combination once its run fitted', () => {
    const onApplyEntry = jest.fn();
    const run = withPlan([combination, batch]);
    show(run, { onApplyEntry });
    const applies = (): string[] =>
      [...host.querySelectorAll('.oommagic-plan-entry')]
        .filter(e => e.querySelector('.oommagic-apply'))
        .map(e => e.getAttribute('data-entry')!);
    expect(applies()).toEqual(['1']);
    const ran = { ...fitted, applied: combination.fixes, source: 'both\n' };
    show(run, { onApplyEntry, retries: [ran] });
    expect(applies()).toEqual(['0', '1']);
    act(() =>
      host.querySelector<HTMLButtonElement>('.oommagic-apply')!.click()
    );
    // The kernel runs the entry; the notebook gets it written once it fits.
    expect(onApplyEntry).toHaveBeenCalledWith(0, combination.title);
  });

  it('says why nothing fits, and holds the buttons while the kernel works', () => {
    show(withPlan([tooBig], 'Nothing it knows fits in 24.00 MiB.'), {
      pending: 'running with: Expandable segments'
    });
    expect(host.querySelector('.oommagic-plan-unfittable')?.textContent).toBe(
      'Nothing it knows fits in 24.00 MiB.'
    );
    expect(host.textContent).toContain('running with: Expandable segments');
    for (const b of host.querySelectorAll('button')) {
      expect(b.disabled).toBe(true);
    }
  });

  it("shows the kernel's refusal on the card", () => {
    show(failed, { refusal: 'run run-1 has no plan entry 3' });
    expect(host.querySelector('.oommagic-run-refusal')?.textContent).toBe(
      'run run-1 has no plan entry 3'
    );
  });

  it('says "fits" at the top of a run that fits after a fix, lists its fixes, and removes one with ✕', () => {
    const onRemoveFix = jest.fn();
    show(fitted, { onRemoveFix });
    const card = host.querySelector('.oommagic-run')!;
    expect(card.classList).toContain('oommagic-run-fits');
    expect(card.querySelector('.oommagic-status')?.textContent).toBe('fits');
    expect(card.querySelector('.oommagic-run-fits-line')?.textContent).toMatch(
      /^fits with Batch 64 → 12.*: peak 60\.00 MiB of 64\.00 MiB$/
    );
    const fixes = [...card.querySelectorAll('.oommagic-applied-fix')];
    expect(
      fixes.map(f => f.querySelector('.oommagic-applied-title')?.textContent)
    ).toEqual([fitted.applied[0].title]);
    const remove = fixes[0].querySelector<HTMLButtonElement>(
      '.oommagic-remove-fix'
    )!;
    expect(remove.title).toBe(
      `Run the cell again without ${fitted.applied[0].title}`
    );
    act(() => remove.click());
    expect(onRemoveFix).toHaveBeenCalledWith(0, fitted.applied[0].title);
    expect(card.querySelector('.oommagic-write-fitted')?.textContent).toBe(
      'Apply to cell'
    );
  });

  it('says "ok", not "fits", for a run the user started', () => {
    show(kernelRun('ok'));
    expect(host.querySelector('.oommagic-status')?.textContent).toBe('ok');
    expect(host.querySelector('.oommagic-run-fits-line')).toBeNull();
    expect(host.querySelector('.oommagic-applied')).toBeNull();
  });

  it('draws categories and ranks when the kernel sends them', () => {
    show({
      ...failed,
      categories: [
        { key: 'parameters', label: 'parameters', bytes: 8 * MiB },
        { key: 'activations', label: 'activations', bytes: 56 * MiB }
      ],
      ranks: [rank(0, {}), rank(1, { oom: true, first_failed: true })]
    });
    expect(
      host.querySelectorAll('.oommagic-category-bar .oommagic-cat')
    ).toHaveLength(2);
    expect(host.querySelectorAll('.oommagic-rank')).toHaveLength(2);
  });
});

/** `element` drawn into a detached node, returned. */
function draw(element: JSX.Element): HTMLElement {
  const node = document.createElement('div');
  const r = createRoot(node);
  act(() => r.render(element));
  return node;
}

function rank(n: number, overrides: Partial<RankJson>): RankJson {
  return {
    rank: n,
    device: `cuda:${n}`,
    pid: 4000 + n,
    peak_allocated: 60 * MiB,
    peak_reserved: 62 * MiB,
    outside: null,
    oom: false,
    requested: null,
    first_failed: false,
    bottleneck: false,
    ...overrides
  };
}

describe('CategoryBar', () => {
  it('stacks each category against the budget, coloured by its key', () => {
    const node = draw(
      <CategoryBar
        budget={64 * MiB}
        categories={[
          { key: 'parameters', label: 'parameters', bytes: 16 * MiB },
          { key: 'gradients', label: 'gradients', bytes: 0 },
          { key: 'activations', label: 'activations', bytes: 32 * MiB }
        ]}
      />
    );
    const parts = [...node.querySelectorAll<HTMLElement>('.oommagic-cat')];
    expect(parts.map(p => [p.className, p.style.width])).toEqual([
      ['oommagic-cat oommagic-cat-parameters', '25.00%'],
      ['oommagic-cat oommagic-cat-activations', '50.00%']
    ]);
    expect(node.textContent).toContain('activations 32.00 MiB');
    expect(
      node.querySelector('.oommagic-category-bar')?.getAttribute('aria-label')
    ).toBe('48.00 MiB by category of 64.00 MiB');
  });

  it('marks the budget when the categories pass it', () => {
    const node = draw(
      <CategoryBar
        budget={24 * MiB}
        categories={[
          { key: 'activations', label: 'activations', bytes: 48 * MiB }
        ]}
      />
    );
    expect(
      node.querySelector<HTMLElement>('.oommagic-category-budget')?.style.left
    ).toBe('50.00%');
  });
});

describe('RankTable', () => {
  it('says which rank ran out first and which is the bottleneck', () => {
    const node = draw(
      <RankTable
        ranks={[
          rank(0, { bottleneck: true, outside: 512 * MiB }),
          rank(1, { oom: true, requested: 256 * MiB, first_failed: true })
        ]}
      />
    );
    const rows = [...node.querySelectorAll('.oommagic-rank')];
    expect(rows.map(r => r.className)).toEqual([
      'oommagic-rank oommagic-rank-bottleneck',
      'oommagic-rank oommagic-rank-oom'
    ]);
    expect(rows[0].textContent).toContain('512.00 MiB');
    expect(rows[0].textContent).toContain('bottleneck');
    expect(rows[1].textContent).toContain(
      'OOM (asked 256.00 MiB), failed first'
    );
  });
});
