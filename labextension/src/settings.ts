/**
 * The panel's settings (`schema/plugin.json`, edited in JupyterLab's settings editor): read into a
 * typed record, and applied again whenever the user changes them.
 */

import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IDisposable } from '@lumino/disposable';

import { DEFAULT_INTERVAL_MS } from './deviceFeed';
import { isObject } from './json';
import { KEEP } from './savedRuns';

/** The plugin's id, which is also the id its settings are stored under (`schema/plugin.json`). */
export const PLUGIN_ID = 'oommagic:plugin';

export interface PanelSettings {
  /** Milliseconds between two requests for the devices while the panel is shown. */
  pollInterval: number;
  showDevices: boolean;
  showRuns: boolean;
  /** How many runs each cell keeps in its metadata. */
  runsKept: number;
  /** Write a fix pressed in the report into the notebook once it fits. */
  writeFixes: boolean;
}

/** The bounds `schema/plugin.json` sets on the numbers (a test holds the two together). */
export const BOUNDS = {
  pollInterval: { min: 250, max: 60_000 },
  runsKept: { min: 1, max: 50 }
} as const;

export const DEFAULT_SETTINGS: PanelSettings = {
  pollInterval: DEFAULT_INTERVAL_MS,
  showDevices: true,
  showRuns: true,
  runsKept: KEEP,
  writeFixes: true
};

/**
 * The settings in `composite` (the registry's merge of defaults and the user's values); a value the
 * schema would refuse (hand-edited JSON) becomes the default, or the nearest bound.
 */
export function readPanelSettings(composite: unknown): PanelSettings {
  const data = isObject(composite) ? composite : {};
  const integer = (
    value: unknown,
    fallback: number,
    { min, max }: { min: number; max: number }
  ): number =>
    typeof value === 'number' && Number.isFinite(value)
      ? Math.min(max, Math.max(min, Math.round(value)))
      : fallback;
  const flag = (value: unknown, fallback: boolean): boolean =>
    typeof value === 'boolean' ? value : fallback;
  return {
    pollInterval: integer(
      data.pollInterval,
      DEFAULT_SETTINGS.pollInterval,
      BOUNDS.pollInterval
    ),
    showDevices: flag(data.showDevices, DEFAULT_SETTINGS.showDevices),
    showRuns: flag(data.showRuns, DEFAULT_SETTINGS.showRuns),
    runsKept: integer(
      data.runsKept,
      DEFAULT_SETTINGS.runsKept,
      BOUNDS.runsKept
    ),
    writeFixes: flag(data.writeFixes, DEFAULT_SETTINGS.writeFixes)
  };
}

/** Apply the settings now and after every change, until the returned handle is disposed. */
export function followSettings(
  settings: ISettingRegistry.ISettings,
  apply: (values: PanelSettings) => void
): IDisposable {
  const onChange = (): void => apply(readPanelSettings(settings.composite));
  settings.changed.connect(onChange);
  onChange();
  let disposed = false;
  return {
    get isDisposed() {
      return disposed;
    },
    dispose() {
      if (!disposed) {
        disposed = true;
        settings.changed.disconnect(onChange);
      }
    }
  };
}
