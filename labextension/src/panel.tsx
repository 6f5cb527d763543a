/**
 * The right sidebar panel (widget id `oommagic-panel`): devices polled from the server while the
 * panel is visible, and the runs of the notebook the user is looking at, with the actions that edit
 * and run its cells.
 */

import { ReactWidget } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import * as React from 'react';

import { applyFix, isWritten, retryCell, revealCell } from './cellActions';
import { GpuPanelView, INotebookView } from './components/GpuPanelView';
import { DeviceFeed } from './deviceFeed';
import { gpuIcon } from './icon';
import { NotebookRuns } from './notebookRuns';
import {
  applyRequest,
  CellRunJson,
  CellWriteJson,
  RemedyJson,
  removeRequest
} from './protocol';
import { RunEntry } from './runs';
import { DEFAULT_SETTINGS, PanelSettings } from './settings';

export const PANEL_ID = 'oommagic-panel';
export const PANEL_TITLE = 'GPU Memory';

/** What writing `run` into the notebook changes (a kernel without `write`: its source, whole). */
function writeOf(run: CellRunJson): CellWriteJson {
  return run.write ?? { body: run.source, functions: [] };
}

export class GpuPanel extends ReactWidget {
  constructor(feed: DeviceFeed) {
    super();
    this.id = PANEL_ID;
    this.title.icon = gpuIcon;
    this.title.caption = PANEL_TITLE;
    this.addClass('oommagic-panel');
    this._feed = feed;
    feed.changed.connect(this._refresh, this);
  }

  get settings(): PanelSettings {
    return this._settings;
  }

  /** Apply the settings: what the panel shows, how often it asks for the devices, at once. */
  configure(settings: PanelSettings): void {
    this._settings = settings;
    this._feed.interval = settings.pollInterval;
    this._followVisibility();
    this.update();
  }

  /** Show the runs of this notebook (null: none is open). */
  follow(runs: NotebookRuns | null): void {
    if (runs === this._runs) {
      return;
    }
    if (this._runs && !this._runs.isDisposed) {
      this._runs.changed.disconnect(this._refresh, this);
      this._runs.panel.sessionContext.statusChanged.disconnect(
        this._refresh,
        this
      );
      this._runs.panel.model?.cells.changed.disconnect(this._refresh, this);
    }
    this._runs = runs;
    if (runs) {
      runs.changed.connect(this._refresh, this);
      runs.panel.sessionContext.statusChanged.connect(this._refresh, this);
      void runs.panel.context.ready.then(() => {
        if (this._runs === runs && !runs.isDisposed) {
          runs.panel.model?.cells.changed.connect(this._refresh, this);
          this.update();
        }
      });
    }
    this.update();
  }

  dispose(): void {
    this._feed.dispose();
    this.follow(null);
    super.dispose();
  }

  protected render(): JSX.Element {
    return (
      <GpuPanelView
        devices={this._feed.state}
        showDevices={this._settings.showDevices}
        showRuns={this._settings.showRuns}
        notebook={this._notebookView()}
        busy={this._busy || this._kernelBusy()}
        onDismissNotices={() => this._runs?.dismissNotices()}
        onReveal={entry => void this._reveal(entry)}
        onRetry={entry =>
          void this._act(entry, panel => retryCell(panel, entry.cellId))
        }
        onApply={(entry, remedy) => void this._apply(entry, remedy)}
        onApplyEntry={(entry, index, title) =>
          this._runs?.ask(
            applyRequest(entry.run.id, index),
            `running with: ${title}; written into the cell once it fits`,
            true
          )
        }
        onWriteFitted={entry => {
          const run = entry.saved ? null : entry.run;
          if (run) {
            this._runs?.write(run.id, run.cell_id, writeOf(run));
          }
        }}
        onRunPlanEntry={(entry, index, title) =>
          this._runs?.ask(
            applyRequest(entry.run.id, index),
            `running with: ${title}`
          )
        }
        onRemoveFix={(entry, index, title) =>
          this._runs?.ask(
            removeRequest(entry.run.id, index),
            `running without: ${title}`
          )
        }
      />
    );
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    this._followVisibility();
  }

  protected onAfterHide(msg: Message): void {
    super.onAfterHide(msg);
    this._followVisibility();
  }

  protected onAfterAttach(msg: Message): void {
    super.onAfterAttach(msg);
    // A panel restored open at start-up is attached visible and gets no after-show.
    this._followVisibility();
  }

  protected onBeforeDetach(msg: Message): void {
    this._feed.stop();
    super.onBeforeDetach(msg);
  }

  /** Poll the devices only while someone can see them. */
  private _followVisibility(): void {
    if (this.isAttached && this.isVisible && this._settings.showDevices) {
      this._feed.start();
    } else {
      this._feed.stop();
    }
  }

  private _notebookView(): INotebookView | null {
    const runs = this._runs;
    if (!runs || runs.isDisposed) {
      return null;
    }
    const { panel } = runs;
    const cellIds = new Set<string>();
    const cells = panel.model?.cells;
    for (let i = 0; cells && i < cells.length; i++) {
      cellIds.add(cells.get(i).id);
    }
    const session = panel.sessionContext;
    return {
      name: panel.context.localPath.split('/').pop() ?? panel.title.label,
      kernel: session.session?.kernel
        ? `${session.kernelDisplayName} · ${session.kernelDisplayStatus}`
        : session.kernelDisplayStatus === 'starting'
          ? 'starting'
          : 'no kernel',
      entries: runs.entries(),
      cellIds,
      notices: runs.notices,
      pending: runs.pending,
      refusals: runs.refusals,
      written: new Set(
        runs.live
          .filter(
            run =>
              run.outcome === 'ok' &&
              run.source !== (run.original ?? run.source) &&
              isWritten(panel, run.cell_id, writeOf(run))
          )
          .map(run => run.id)
      )
    };
  }

  /**
   * Whether the notebook's kernel is busy (running a cell, or a fix pressed in a report, which the
   * kernel runs as a comm message): the buttons that would start a second run wait for it.
   */
  private _kernelBusy(): boolean {
    return this._runs?.panel.sessionContext.session?.kernel?.status === 'busy';
  }

  private async _reveal(entry: RunEntry): Promise<void> {
    const runs = this._runs;
    if (runs && !(await revealCell(runs.panel, entry.cellId))) {
      runs.notify('The cell of that run is not in this notebook any more.');
    }
  }

  private async _apply(entry: RunEntry, remedy: RemedyJson): Promise<void> {
    const body = remedy.new_source;
    if (body === null) {
      return;
    }
    await this._act(entry, panel => applyFix(panel, entry.cellId, body));
  }

  /** Run an action on the run's cell, one at a time; a vanished cell becomes a notice. */
  private async _act(
    entry: RunEntry,
    action: (panel: NotebookRuns['panel']) => Promise<boolean>
  ): Promise<void> {
    const runs = this._runs;
    if (!runs || this._busy) {
      return;
    }
    this._busy = true;
    this.update();
    try {
      if (!(await action(runs.panel))) {
        runs.notify('The cell of that run is not in this notebook any more.');
      }
    } catch (error) {
      runs.notify(
        `Could not run the cell: ${error instanceof Error ? error.message : String(error)}`
      );
    } finally {
      this._busy = false;
      this.update();
    }
  }

  private _refresh(): void {
    this.update();
  }

  private _feed: DeviceFeed;
  private _settings: PanelSettings = DEFAULT_SETTINGS;
  private _runs: NotebookRuns | null = null;
  private _busy = false;
}
