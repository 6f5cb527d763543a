import * as React from 'react';

import { RemedyJson } from '../protocol';
import { RunEntry } from '../runs';
import { RunCard } from './RunCard';

export interface IRunListProps {
  entries: readonly RunEntry[];
  /** Model ids of the cells in the open notebook. */
  cellIds: ReadonlySet<string>;
  notices: readonly string[];
  busy: boolean;
  onDismissNotices: () => void;
  onReveal: (entry: RunEntry) => void;
  onRetry: (entry: RunEntry) => void;
  onApply: (entry: RunEntry, remedy: RemedyJson) => void;
}

/** The notebook's runs, newest first, under the notices the panel has for it. */
export function RunList(props: IRunListProps): JSX.Element {
  const { entries, cellIds, notices, busy } = props;
  return (
    <>
      {notices.length ? (
        <div className="oommagic-notices">
          {notices.map(line => (
            <div key={line} className="oommagic-notice oommagic-kernel-notice">
              {line}
            </div>
          ))}
          <button
            type="button"
            className="oommagic-link"
            onClick={props.onDismissNotices}
          >
            dismiss
          </button>
        </div>
      ) : null}
      {entries.length ? (
        <ul className="oommagic-runs">
          {entries.map(entry => (
            <RunCard
              key={entry.run.id}
              entry={entry}
              cellPresent={entry.cellId !== null && cellIds.has(entry.cellId)}
              busy={busy}
              onReveal={() => props.onReveal(entry)}
              onRetry={() => props.onRetry(entry)}
              onApply={remedy => props.onApply(entry, remedy)}
            />
          ))}
        </ul>
      ) : (
        <div className="oommagic-muted oommagic-runs-empty">
          No <code>%%gpumem</code> run in this notebook yet. Run{' '}
          <code>%load_ext oommagic</code>, then start a cell with{' '}
          <code>%%gpumem</code>.
        </div>
      )}
    </>
  );
}
