/**
 * oommagic's JupyterLab / Notebook 7 plugin: the "GPU Memory" panel in the right sidebar, the one
 * command that shows it (View menu through `schema/plugin.json`, and the palette), its settings, and
 * the `oommagic` comm target on the kernel of every open notebook.
 *
 * Nothing is required, so the plugin activates in Notebook 7 (on the notebook page and the others)
 * as well as in JupyterLab; the lab shell, the layout restorer, the palette, the notebook tracker and
 * the settings are used when the app has them.
 */

import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';

import { DeviceFeed } from './deviceFeed';
import { gpuIcon } from './icon';
import { NotebookRuns } from './notebookRuns';
import { GpuPanel, PANEL_ID, PANEL_TITLE } from './panel';
import {
  DEFAULT_SETTINGS,
  followSettings,
  PanelSettings,
  PLUGIN_ID
} from './settings';

export const OPEN_COMMAND = 'oommagic:open-panel';

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description:
    'GPU Memory sidebar: live devices, every %%gpumem run of the notebook, fixes written into cells.',
  autoStart: true,
  optional: [
    INotebookTracker,
    ISettingRegistry,
    ILabShell,
    ILayoutRestorer,
    ICommandPalette
  ],
  activate: (
    app: JupyterFrontEnd,
    tracker: INotebookTracker | null,
    settingRegistry: ISettingRegistry | null,
    labShell: ILabShell | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ): void => {
    const panel = new GpuPanel(
      new DeviceFeed(app.serviceManager.serverSettings)
    );
    app.shell.add(panel, 'right', { rank: 600, type: PANEL_TITLE });
    restorer?.add(panel, PANEL_ID);

    app.commands.addCommand(OPEN_COMMAND, {
      label: PANEL_TITLE,
      caption: 'GPU memory: devices and the %%gpumem runs of this notebook',
      icon: gpuIcon,
      execute: () => {
        labShell?.expandRight();
        app.shell.activateById(PANEL_ID);
      }
    });
    // Notebook 7 lists every sidebar panel in the palette itself ("Show GPU Memory", from the
    // panel's caption): a second entry there would be the same thing twice.
    if (labShell) {
      palette?.addItem({ command: OPEN_COMMAND, category: 'View' });
    }

    // Every open notebook keeps its runs, so a run ending in a background notebook is still saved
    // into its cell; the panel shows the current one.
    const runsOf = new Map<NotebookPanel, NotebookRuns>();
    let settings: PanelSettings = DEFAULT_SETTINGS;
    const track = (notebook: NotebookPanel): NotebookRuns => {
      let runs = runsOf.get(notebook);
      if (!runs) {
        runs = new NotebookRuns(notebook);
        runs.keep = settings.runsKept;
        runs.writeFixes = settings.writeFixes;
        runsOf.set(notebook, runs);
        notebook.disposed.connect(() => {
          runsOf.get(notebook)?.dispose();
          runsOf.delete(notebook);
          if (tracker?.currentWidget === null) {
            panel.follow(null);
          }
        });
      }
      return runs;
    };
    if (tracker) {
      tracker.forEach(track);
      tracker.widgetAdded.connect((_, notebook) => void track(notebook));
      const followCurrent = (): void => {
        const current = tracker.currentWidget;
        panel.follow(current && !current.isDisposed ? track(current) : null);
      };
      tracker.currentChanged.connect(followCurrent);
      followCurrent();
    }

    if (settingRegistry) {
      settingRegistry
        .load(PLUGIN_ID)
        .then(loaded =>
          followSettings(loaded, values => {
            settings = values;
            panel.configure(values);
            runsOf.forEach(runs => {
              runs.keep = values.runsKept;
              runs.writeFixes = values.writeFixes;
            });
          })
        )
        .catch(reason =>
          console.warn('oommagic: settings not loaded, using defaults', reason)
        );
    }
  }
};

export default plugin;
