import * as React from 'react';

import { formatBytes } from '../format';
import { FindingJson, RemedyJson } from '../protocol';
import { RichText } from './RichText';

export interface IFindingViewProps {
  finding: FindingJson;
  /** Null when the run's cell is not in this notebook: nothing to apply the fix to. */
  onApply: ((remedy: RemedyJson) => void) | null;
  busy: boolean;
}

/** A finding's title and evidence, and for each remedy that rewrites the cell an "Apply to cell". */
export function FindingView({
  finding,
  onApply,
  busy
}: IFindingViewProps): JSX.Element {
  const rewrites = finding.remedies.filter(r => r.new_source !== null);
  return (
    <li className="oommagic-finding" data-key={finding.key}>
      <div className="oommagic-finding-title">
        <RichText text={finding.title} />
        {finding.saving ? (
          <span className="oommagic-muted">
            {' '}
            · saves ~{formatBytes(finding.saving)}
          </span>
        ) : null}
      </div>
      {finding.evidence ? (
        <div className="oommagic-finding-evidence">
          <RichText text={finding.evidence} />
        </div>
      ) : null}
      {onApply && rewrites.length ? (
        <div className="oommagic-actions">
          {rewrites.map(remedy => (
            <button
              key={`${remedy.kind}:${remedy.title}`}
              type="button"
              className={`jp-Button jp-mod-styled jp-mod-accept oommagic-apply oommagic-apply-${remedy.kind.replace(/_/g, '-')}`}
              title={`${remedy.title}: ${remedy.explanation}\n\nWrites the change into the cell (undo with Ctrl+Z) and runs it.`}
              disabled={busy}
              onClick={() => onApply(remedy)}
            >
              Apply to cell: {remedy.title}
            </button>
          ))}
        </div>
      ) : null}
    </li>
  );
}
