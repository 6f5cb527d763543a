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
  /** What the kernel is doing for a run, by run id. */
  pending: ReadonlyMap<string, string>;
  /** The kernel's refusals, by run id. */
  refusals: ReadonlyMap<string, string>;
  onDismissNotices: () => void;
  onReveal: (entry: RunEntry) => void;
  onRetry: (entry: RunEntry) => void;
  onApply: (entry: RunEntry, remedy: RemedyJson) => void;
  onApplyEntry: (entry: RunEntry, index: number, title: string) => void;
  onWriteFitted: (entry: RunEntry) => void;
  /** Ids of the fitted runs the notebook already holds. */
  written: ReadonlySet<string>;
  onRunPlanEntry: (entry: RunEntry, index: number, title: string) => void;
  onRemoveFix: (entry: RunEntry, index: number, title: string) => void;
}

/** The notebook's runs, newest first, under the notices the panel has for it. */
export function RunList(props: IRunListProps): JSX.Element {
  const { entries, cellIds, notices, busy, pending, refusals } = props;
  const live = entries.flatMap(e => (e.saved ? [] : [e.run]));
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
              retries={live.filter(r => r.parent === entry.run.id)}
              pending={pending.get(entry.run.id) ?? null}
              refusal={refusals.get(entry.run.id) ?? null}
              onReveal={() => props.onReveal(entry)}
              onRetry={() => props.onRetry(entry)}
              onApply={remedy => props.onApply(entry, remedy)}
              onApplyEntry={(index, title) =>
                props.onApplyEntry(entry, index, title)
              }
              onWriteFitted={() => props.onWriteFitted(entry)}
              written={props.written.has(entry.run.id)}
              onRunPlanEntry={(index, title) =>
                props.onRunPlanEntry(entry, index, title)
              }
              onRemoveFix={(index, title) =>
                props.onRemoveFix(entry, index, title)
              }
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
