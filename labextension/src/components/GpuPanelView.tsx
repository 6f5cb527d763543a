import * as React from 'react';

import { DeviceState } from '../devices';
import { RemedyJson } from '../protocol';
import { RunEntry } from '../runs';
import { DeviceList } from './DeviceList';
import { RunList } from './RunList';

export interface INotebookView {
  /** The notebook's file name. */
  name: string;
  /** "python3 · idle", "no kernel". */
  kernel: string;
  entries: readonly RunEntry[];
  cellIds: ReadonlySet<string>;
  notices: readonly string[];
  pending: ReadonlyMap<string, string>;
  refusals: ReadonlyMap<string, string>;
  /** Ids of the fitted runs the notebook already holds. */
  written: ReadonlySet<string>;
}

export interface IGpuPanelViewProps {
  devices: DeviceState;
  /** The sections the settings switch on. */
  showDevices: boolean;
  showRuns: boolean;
  /** Null when no notebook is open. */
  notebook: INotebookView | null;
  busy: boolean;
  onDismissNotices: () => void;
  onReveal: (entry: RunEntry) => void;
  onRetry: (entry: RunEntry) => void;
  onApply: (entry: RunEntry, remedy: RemedyJson) => void;
  onApplyEntry: (entry: RunEntry, index: number, title: string) => void;
  onWriteFitted: (entry: RunEntry) => void;
  onRunPlanEntry: (entry: RunEntry, index: number, title: string) => void;
  onRemoveFix: (entry: RunEntry, index: number, title: string) => void;
}

/** The sidebar's content: the devices, then the runs of the notebook being looked at. */
export function GpuPanelView(props: IGpuPanelViewProps): JSX.Element {
  const { notebook, showDevices, showRuns } = props;
  return (
    <div className="oommagic-panel-body">
      {showDevices ? (
        <section className="oommagic-section oommagic-devices-section">
          <h2 className="oommagic-section-title">Devices</h2>
          <DeviceList state={props.devices} />
        </section>
      ) : null}
      {showRuns ? (
        <section className="oommagic-section oommagic-notebook-section">
          <h2 className="oommagic-section-title">
            This notebook
            {notebook ? (
              <span className="oommagic-notebook-name"> · {notebook.name}</span>
            ) : null}
          </h2>
          {notebook ? (
            <>
              <div className="oommagic-muted oommagic-kernel-state">
                kernel: {notebook.kernel}
              </div>
              <RunList
                entries={notebook.entries}
                cellIds={notebook.cellIds}
                notices={notebook.notices}
                pending={notebook.pending}
                refusals={notebook.refusals}
                busy={props.busy}
                onDismissNotices={props.onDismissNotices}
                onReveal={props.onReveal}
                onRetry={props.onRetry}
                onApply={props.onApply}
                onApplyEntry={props.onApplyEntry}
                onWriteFitted={props.onWriteFitted}
                written={notebook.written}
                onRunPlanEntry={props.onRunPlanEntry}
                onRemoveFix={props.onRemoveFix}
              />
            </>
          ) : (
            <div className="oommagic-muted">
              Open a notebook to see its %%gpumem runs.
            </div>
          )}
        </section>
      ) : null}
      {!showDevices && !showRuns ? (
        <div className="oommagic-muted oommagic-all-hidden">
          Devices and runs are both switched off in Settings › GPU Memory.
        </div>
      ) : null}
    </div>
  );
}
