import * as React from 'react';

import { formatBytes, percent } from '../format';
import { fitsWithFixes } from '../plan';
import { budgetOf, CellRunJson, RemedyJson } from '../protocol';
import { RunEntry, STATUS_LABEL } from '../runs';
import { AppliedFixes } from './AppliedFixes';
import { CategoryBar } from './CategoryBar';
import { FindingView } from './FindingView';
import { GivenBack } from './GivenBack';
import { PlanView } from './PlanView';
import { RankTable } from './RankTable';
import { RichText } from './RichText';
import { Sparkline } from './Sparkline';

/** How many findings of an out-of-memory run are shown (they come ranked, best first). */
export const TOP_FINDINGS = 3;

export interface IRunCardProps {
  entry: RunEntry;
  /** Whether the run's cell is in the open notebook (only then can it be revealed, retried, fixed). */
  cellPresent: boolean;
  busy: boolean;
  /** Runs the kernel made from this one (their `parent` is its id). */
  retries: readonly CellRunJson[];
  /** What the kernel is doing for this run ("running with: …"), null when nothing. */
  pending: string | null;
  /** The kernel's refusal of the last action on this run. */
  refusal: string | null;
  onReveal: () => void;
  onRetry: () => void;
  /** Write a finding's remedy into the cell and run it. */
  onApply: (remedy: RemedyJson) => void;
  /** Have the kernel run plan entry `index` and write it into the notebook once it fits. */
  onApplyEntry: (index: number, title: string) => void;
  /** Write this run (it fits) into the notebook. */
  onWriteFitted: () => void;
  /** Whether the notebook already holds what this run ran (nothing left to write). */
  written: boolean;
  /** Have the kernel run the cell with plan entry `index` stacked on the fixes in force. */
  onRunPlanEntry: (index: number, title: string) => void;
  /** Have the kernel run the cell without `applied[index]`. */
  onRemoveFix: (index: number, title: string) => void;
}

/**
 * One run of a `%%gpumem` cell: its cell number and status, peak against the budget with a sparkline
 * (and memory by category, and the ranks, where the kernel sends them), the fixes in force, and for an
 * out-of-memory error the headline, the fix plan, the top findings. Clicking the head goes to the cell.
 */
export function RunCard({
  entry,
  cellPresent,
  busy,
  retries,
  pending,
  refusal,
  onReveal,
  onRetry,
  onApply,
  onApplyEntry,
  onWriteFitted,
  written,
  onRunPlanEntry,
  onRemoveFix
}: IRunCardProps): JSX.Element {
  const summary = entry.run;
  // Timeline, findings, plan and what was given back come with live runs only.
  const live = entry.saved ? null : entry.run;
  const budget = budgetOf(summary);
  const share = percent(summary.peak_reserved, budget);
  const cell =
    entry.executionCount !== null ? `[${entry.executionCount}]` : '[ ]';
  const oom = live && live.outcome === 'oom' ? live : null;
  const plan = oom && oom.plan ? { ...oom, plan: oom.plan } : null;
  // With a plan the plan's entries carry the buttons; the findings explain.
  const planOffers = plan !== null && plan.plan.entries.length > 0;
  const findings = oom ? oom.findings.slice(0, TOP_FINDINGS) : [];
  const fits = live !== null && fitsWithFixes(live);
  const waiting = busy || pending !== null;
  const classes = [
    'oommagic-run',
    `oommagic-run-${entry.status}`,
    entry.saved ? 'oommagic-run-saved' : 'oommagic-run-live',
    fits ? 'oommagic-run-fits' : ''
  ]
    .filter(Boolean)
    .join(' ');
  return (
    <li
      className={classes}
      data-run-id={summary.id}
      data-cell-id={entry.cellId ?? undefined}
    >
      <div
        className="oommagic-run-head"
        role="button"
        tabIndex={0}
        title={
          cellPresent
            ? 'Go to the cell'
            : 'This cell is not in the open notebook'
        }
        onClick={onReveal}
        onKeyDown={event => {
          if (event.key === 'Enter' || event.key === ' ') {
            event.preventDefault();
            onReveal();
          }
        }}
      >
        <span className="oommagic-run-cell">{cell}</span>
        <span
          className={`oommagic-status oommagic-status-${fits ? 'fits' : entry.status}`}
        >
          {fits ? 'fits' : STATUS_LABEL[entry.status]}
        </span>
        {live?.device ? (
          <span className="oommagic-run-device">{live.device}</span>
        ) : null}
        <span className="oommagic-run-time">{clock(summary.started)}</span>
      </div>
      {fits && live ? (
        <div className="oommagic-run-fits-line">
          fits with {live.change ?? 'the fixes in force'}: peak{' '}
          {formatBytes(live.peak_reserved)}
          {budget !== null ? ` of ${formatBytes(budget)}` : ''}
        </div>
      ) : null}
      {entry.saved ? (
        <div className="oommagic-run-saved-mark">from a saved run</div>
      ) : null}
      <div className="oommagic-run-peak">
        peak {formatBytes(summary.peak_allocated)} allocated,{' '}
        {formatBytes(summary.peak_reserved)} reserved
        {budget !== null
          ? ` of ${formatBytes(budget)}${summary.limit !== null ? ' limit' : ''}`
          : ''}
        {share ? ` (${share})` : ''}
      </div>
      {live ? <Sparkline timeline={live.timeline} budget={budget} /> : null}
      {live?.categories ? (
        <CategoryBar categories={live.categories} budget={budget} />
      ) : null}
      {live?.ranks ? <RankTable ranks={live.ranks} /> : null}
      {summary.outcome !== 'ok' && summary.headline ? (
        <div className="oommagic-run-headline">
          <RichText text={summary.headline} />
        </div>
      ) : null}
      {live ? (
        <AppliedFixes
          applied={live.applied}
          busy={waiting}
          onRemove={onRemoveFix}
        />
      ) : null}
      {pending !== null ? (
        <div className="oommagic-run-pending">{pending}</div>
      ) : null}
      {refusal !== null ? (
        <div className="oommagic-error oommagic-run-refusal">{refusal}</div>
      ) : null}
      {plan ? (
        <PlanView
          run={plan}
          retries={retries}
          busy={waiting}
          onRun={onRunPlanEntry}
          onApply={cellPresent ? onApplyEntry : null}
        />
      ) : null}
      {live ? <GivenBack run={live} /> : null}
      {findings.length ? (
        <ul className="oommagic-findings">
          {findings.map(finding => (
            <FindingView
              key={finding.key || finding.title}
              finding={finding}
              busy={waiting}
              onApply={cellPresent && !planOffers ? onApply : null}
            />
          ))}
        </ul>
      ) : null}
      {fits &&
      live &&
      cellPresent &&
      !written &&
      live.source !== (live.original ?? live.source) ? (
        <div className="oommagic-actions">
          <button
            type="button"
            className="jp-Button jp-mod-styled jp-mod-accept oommagic-write-fitted"
            title="Write the code that fitted into the notebook (undo with Ctrl+Z in the cell); the kernel already runs it."
            disabled={waiting}
            onClick={onWriteFitted}
          >
            Apply to cell
          </button>
        </div>
      ) : null}
      {cellPresent && entry.status !== 'ok' && entry.status !== 'retried' ? (
        <div className="oommagic-actions">
          <button
            type="button"
            className="jp-Button jp-mod-styled jp-mod-reject oommagic-retry-cell"
            title="Run the cell again as it is"
            disabled={waiting}
            onClick={onRetry}
          >
            Retry cell
          </button>
        </div>
      ) : null}
    </li>
  );
}

/** "14:03:27" for a start time in seconds since the epoch; '' when unknown. */
function clock(started: number): string {
  if (!started) {
    return '';
  }
  const d = new Date(started * 1000);
  const two = (n: number): string => String(n).padStart(2, '0');
  return `${two(d.getHours())}:${two(d.getMinutes())}:${two(d.getSeconds())}`;
}
