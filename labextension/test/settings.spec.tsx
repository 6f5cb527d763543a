/**
 * @jest-environment jsdom
 */
/**
 * The settings through JupyterLab's own setting registry, loaded with the extension's real schema
 * (`schema/plugin.json`) from an in-memory store standing in for the server's settings route: what
 * the settings editor writes is validated by the registry and applied to the feed and the panel's
 * sections at once. (In jsdom: Lumino's commands, which the registry imports, need a DOM to load.)
 */
import { ISettingRegistry, SettingRegistry } from '@jupyterlab/settingregistry';
import { IDataConnector } from '@jupyterlab/statedb';

import {
  BOUNDS,
  DEFAULT_SETTINGS,
  followSettings,
  PanelSettings,
  PLUGIN_ID,
  readPanelSettings
} from '../src/settings';
import schema from '../schema/plugin.json';

/** The user's settings file for the plugin, as the server keeps it. */
class SettingsStore implements IDataConnector<
  ISettingRegistry.IPlugin,
  string,
  string
> {
  raw = '{}';

  async fetch(id: string): Promise<ISettingRegistry.IPlugin | undefined> {
    if (id !== PLUGIN_ID) {
      return undefined;
    }
    return {
      id,
      raw: this.raw,
      schema: schema as unknown as ISettingRegistry.ISchema,
      version: '0.1.0',
      data: { composite: {}, user: {} }
    };
  }

  async list(): Promise<{ ids: string[]; values: ISettingRegistry.IPlugin[] }> {
    const plugin = (await this.fetch(PLUGIN_ID))!;
    return { ids: [PLUGIN_ID], values: [plugin] };
  }

  async save(_id: string, raw: string): Promise<void> {
    this.raw = raw;
  }

  async remove(): Promise<void> {
    this.raw = '{}';
  }
}

async function load(raw = '{}'): Promise<ISettingRegistry.ISettings> {
  const store = new SettingsStore();
  store.raw = raw;
  const registry = new SettingRegistry({ connector: store });
  return registry.load(PLUGIN_ID);
}

describe('the settings schema', () => {
  it("gives the registry the panel's defaults", async () => {
    const settings = await load();
    expect(readPanelSettings(settings.composite)).toEqual(DEFAULT_SETTINGS);
  });

  it('bounds the numbers as the panel does', () => {
    const { properties } = schema;
    expect({
      min: properties.pollInterval.minimum,
      max: properties.pollInterval.maximum
    }).toEqual(BOUNDS.pollInterval);
    expect({
      min: properties.runsKept.minimum,
      max: properties.runsKept.maximum
    }).toEqual(BOUNDS.runsKept);
  });

  it("puts the panel's one command in the View menu", () => {
    expect(schema['jupyter.lab.menus'].main).toEqual([
      {
        id: 'jp-mainmenu-view',
        items: [{ command: 'oommagic:open-panel', rank: 900 }]
      }
    ]);
  });

  it('refuses a value of the wrong type', async () => {
    const settings = await load();
    const complaints = jest.spyOn(console, 'warn').mockImplementation(() => {});
    await expect(settings.set('pollInterval', 'fast')).rejects.toBeTruthy();
    await expect(settings.set('runsKept', 0)).rejects.toBeTruthy();
    expect(readPanelSettings(settings.composite)).toEqual(DEFAULT_SETTINGS);
    expect(complaints).toHaveBeenCalled();
    complaints.mockRestore();
  });
});

describe('followSettings', () => {
  it('applies the settings now and every change after, until disposed', async () => {
    const settings = await load('{"pollInterval": 5000}');
    const seen: PanelSettings[] = [];
    const following = followSettings(settings, values => seen.push(values));
    expect(seen).toEqual([{ ...DEFAULT_SETTINGS, pollInterval: 5000 }]);

    await settings.set('pollInterval', 250);
    await settings.set('showDevices', false);
    expect(seen.slice(1)).toEqual([
      { ...DEFAULT_SETTINGS, pollInterval: 250 },
      { ...DEFAULT_SETTINGS, pollInterval: 250, showDevices: false }
    ]);

    following.dispose();
    await settings.set('runsKept', 9);
    expect(seen).toHaveLength(3);
  });
});

describe('readPanelSettings', () => {
  it('takes hand-edited values the schema would refuse as the default or the nearest bound', () => {
    expect(
      readPanelSettings({
        pollInterval: 10,
        runsKept: 1e6,
        showDevices: 'yes',
        showRuns: false,
        writeFixes: 'no'
      })
    ).toEqual({
      pollInterval: 250,
      runsKept: 50,
      showDevices: true,
      showRuns: false,
      writeFixes: true
    });
    expect(readPanelSettings(null)).toEqual(DEFAULT_SETTINGS);
  });
});
