import * as React from 'react';

import { RemedyJson } from '../protocol';

export interface IAppliedFixesProps {
  applied: readonly RemedyJson[];
  /** Null when the run's kernel is not this page's. */
  onRemove: ((index: number, title: string) => void) | null;
  busy: boolean;
}

/** The fixes in force for a run, in the order applied, each with a ✕ that runs the cell without it. */
export function AppliedFixes({
  applied,
  onRemove,
  busy
}: IAppliedFixesProps): JSX.Element | null {
  if (!applied.length) {
    return null;
  }
  return (
    <div className="oommagic-applied">
      <span className="oommagic-applied-label">Fixes in force:</span>
      <ul className="oommagic-applied-list">
        {applied.map((fix, index) => (
          <li
            key={`${index}:${fix.title}`}
            className="oommagic-applied-fix"
            data-kind={fix.kind}
            title={fix.explanation}
          >
            <span className="oommagic-applied-title">{fix.title}</span>
            {onRemove ? (
              <button
                type="button"
                className="oommagic-remove-fix"
                aria-label={`Remove ${fix.title}`}
                title={`Run the cell again without ${fix.title}${applied.length > 1 ? ' (the other fixes stay)' : ''}`}
                disabled={busy}
                onClick={() => onRemove(index, fix.title)}
              >
                ✕
              </button>
            ) : null}
          </li>
        ))}
      </ul>
    </div>
  );
}
