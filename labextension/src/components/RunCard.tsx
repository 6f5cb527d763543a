import * as React from 'react';

import { formatBytes, percent } from '../format';
import { budgetOf, RemedyJson } from '../protocol';
import { RunEntry, STATUS_LABEL } from '../runs';
import { FindingView } from './FindingView';
import { GivenBack } from './GivenBack';
import { Sparkline } from './Sparkline';

/** How many findings of an out-of-memory run are shown (they come ranked, best first). */
export const TOP_FINDINGS = 3;

export interface IRunCardProps {
  entry: RunEntry;
  /** Whether the run's cell is in the open notebook (only then can it be revealed, retried, fixed). */
  cellPresent: boolean;
  busy: boolean;
  onReveal: () => void;
  onRetry: () => void;
  onApply: (remedy: RemedyJson) => void;
}

/**
 * One run of a `%%gpumem` cell: its cell number and status, peak against the budget with a sparkline,
 * and for an out-of-memory error the headline, the top findings and the fixes that rewrite the cell.
 * Clicking the head goes to the cell.
 */
export function RunCard({
  entry,
  cellPresent,
  busy,
  onReveal,
  onRetry,
  onApply
}: IRunCardProps): JSX.Element {
  const summary = entry.run;
  // Timeline, findings and what was given back come with live runs only.
  const live = entry.saved ? null : entry.run;
  const budget = budgetOf(summary);
  const share = percent(summary.peak_reserved, budget);
  const cell =
    entry.executionCount !== null ? `[${entry.executionCount}]` : '[ ]';
  const findings =
    live && live.outcome === 'oom' ? live.findings.slice(0, TOP_FINDINGS) : [];
  const classes = [
    'oommagic-run',
    `oommagic-run-${entry.status}`,
    entry.saved ? 'oommagic-run-saved' : 'oommagic-run-live'
  ].join(' ');
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
        <span className={`oommagic-status oommagic-status-${entry.status}`}>
          {STATUS_LABEL[entry.status]}
        </span>
        {live?.device ? (
          <span className="oommagic-run-device">{live.device}</span>
        ) : null}
        <span className="oommagic-run-time">{clock(summary.started)}</span>
      </div>
      {entry.saved ? (
        <div className="oommagic-run-saved-mark">from a saved run</div>
      ) : null}
      {live?.change ? (
        <div className="oommagic-run-change">retry: {live.change}</div>
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
      {summary.outcome !== 'ok' && summary.headline ? (
        <div className="oommagic-run-headline">{summary.headline}</div>
      ) : null}
      {live ? <GivenBack run={live} /> : null}
      {findings.length ? (
        <ul className="oommagic-findings">
          {findings.map(finding => (
            <FindingView
              key={finding.key || finding.title}
              finding={finding}
              busy={busy}
              onApply={cellPresent ? onApply : null}
            />
          ))}
        </ul>
      ) : null}
      {cellPresent && entry.status !== 'ok' && entry.status !== 'retried' ? (
        <div className="oommagic-actions">
          <button
            type="button"
            className="jp-Button jp-mod-styled jp-mod-reject oommagic-retry-cell"
            title="Run the cell again as it is"
            disabled={busy}
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
