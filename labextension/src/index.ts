/**
 * oommagic's JupyterLab / Notebook 7 plugin: the "GPU memory" sidebar panel and the `oommagic` comm
 * target on the kernel of every open notebook.
 *
 * Only the notebook tracker is required, so the plugin also activates in Notebook 7; the lab shell
 * and the layout restorer are used when there.
 */

import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';

import { DeviceFeed } from './deviceFeed';
import { gpuIcon } from './icon';
import { NotebookRuns } from './notebookRuns';
import { GpuPanel, PANEL_ID } from './panel';

export const OPEN_COMMAND = 'oommagic:open-panel';

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'oommagic:plugin',
  description:
    'GPU memory sidebar: live devices, every %%gpumem run of the notebook, fixes written into cells.',
  autoStart: true,
  requires: [INotebookTracker],
  optional: [ILabShell, ILayoutRestorer, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker,
    labShell: ILabShell | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ): void => {
    const panel = new GpuPanel(
      new DeviceFeed(app.serviceManager.serverSettings)
    );
    app.shell.add(panel, 'right', { rank: 600, type: 'GPU memory' });
    restorer?.add(panel, PANEL_ID);

    // Every open notebook keeps its runs, so a run ending in a background notebook is still saved
    // into its cell; the panel shows the current one.
    const runsOf = new Map<NotebookPanel, NotebookRuns>();
    const track = (notebook: NotebookPanel): NotebookRuns => {
      let runs = runsOf.get(notebook);
      if (!runs) {
        runs = new NotebookRuns(notebook);
        runsOf.set(notebook, runs);
        notebook.disposed.connect(() => {
          runsOf.get(notebook)?.dispose();
          runsOf.delete(notebook);
          if (tracker.currentWidget === null) {
            panel.follow(null);
          }
        });
      }
      return runs;
    };
    tracker.forEach(track);
    tracker.widgetAdded.connect((_, notebook) => void track(notebook));
    const followCurrent = (): void => {
      const current = tracker.currentWidget;
      panel.follow(current && !current.isDisposed ? track(current) : null);
    };
    tracker.currentChanged.connect(followCurrent);
    followCurrent();

    app.commands.addCommand(OPEN_COMMAND, {
      label: 'Show GPU Memory Panel',
      caption: 'GPU memory: devices and the %%gpumem runs of this notebook',
      icon: gpuIcon,
      execute: () => {
        labShell?.expandRight();
        app.shell.activateById(PANEL_ID);
      }
    });
    palette?.addItem({ command: OPEN_COMMAND, category: 'GPU memory' });
  }
};

export default plugin;
