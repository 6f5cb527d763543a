import * as React from 'react';

import { fittedRunOf, planRows, sourceToWrite } from '../plan';
import { CellRunJson, FixPlanJson } from '../protocol';
import { RichText } from './RichText';

export interface IPlanViewProps {
  run: CellRunJson & { plan: FixPlanJson };
  /** Runs the kernel made from this one (their `parent` is its id). */
  retries: readonly CellRunJson[];
  /** Null when the run's kernel is not this page's (nothing to send the request to). */
  onRun: ((index: number, title: string) => void) | null;
  /**
   * Have the kernel run entry `index` and write it into the notebook once it fits; null when the
   * run's cell is not in the open notebook.
   */
  onApply: ((index: number, title: string) => void) | null;
  busy: boolean;
}

/**
 * The fix plan the kernel measured: each entry's title and verdict line, the recommended one first
 * with the primary button, "Apply to cell" where there is a source to write, and why nothing fits.
 */
export function PlanView({
  run,
  retries,
  onRun,
  onApply,
  busy
}: IPlanViewProps): JSX.Element | null {
  const rows = planRows(run);
  const { unfittable } = run.plan;
  if (!rows.length && !unfittable) {
    return null;
  }
  return (
    <div className="oommagic-plan">
      <div className="oommagic-plan-title">Fix plan</div>
      {rows.length ? (
        <ol className="oommagic-plan-entries">
          {rows.map(({ index, entry, recommended, runnable }) => {
            const body = sourceToWrite(entry, fittedRunOf(run, entry, retries));
            const verdict = entry.verdict.replace(/ /g, '-');
            return (
              <li
                key={index}
                className={`oommagic-plan-entry oommagic-verdict-${verdict}${recommended ? ' oommagic-plan-recommended' : ''}`}
                data-entry={index}
                data-kind={entry.kind}
              >
                <div className="oommagic-plan-entry-title">
                  {recommended ? (
                    <span className="oommagic-plan-badge">recommended</span>
                  ) : null}
                  <RichText text={entry.title} />
                </div>
                <div className={`oommagic-plan-line oommagic-verdict-text`}>
                  <RichText text={entry.line || entry.verdict} />
                </div>
                {(onRun && runnable) || (onApply && body !== null) ? (
                  <div className="oommagic-actions">
                    {onRun && runnable ? (
                      <button
                        type="button"
                        className={`jp-Button jp-mod-styled ${recommended ? 'jp-mod-accept oommagic-run-fix-primary' : 'jp-mod-reject oommagic-run-fix-small'} oommagic-run-fix`}
                        title={`Run the cell again with ${entry.title} on top of the fixes in force (the cell's text stays as it is).`}
                        disabled={busy}
                        onClick={() => onRun(index, entry.title)}
                      >
                        {recommended ? 'Run with this fix' : 'Run with this'}
                      </button>
                    ) : null}
                    {onApply && body !== null ? (
                      <button
                        type="button"
                        className={`jp-Button jp-mod-styled jp-mod-reject oommagic-apply oommagic-apply-${entry.kind.replace(/[_+]/g, '-')}`}
                        title={`Run the cell with ${entry.title} and, once it fits, write it into the notebook (undo with Ctrl+Z in the cell).`}
                        disabled={busy}
                        onClick={() => onApply(index, entry.title)}
                      >
                        Apply to cell
                      </button>
                    ) : null}
                  </div>
                ) : null}
              </li>
            );
          })}
        </ol>
      ) : null}
      {unfittable ? (
        <div className="oommagic-plan-unfittable">
          <RichText text={unfittable} />
        </div>
      ) : null}
    </div>
  );
}
