/**
 * Polls `GET <base_url>oommagic/devices` about once a second while someone looks at the panel. The
 * next request is scheduled when the previous answer arrived, so a slow server is never asked twice
 * at once, and nothing is asked while the panel or the browser tab is hidden.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { ISignal, Signal } from '@lumino/signaling';

import { DeviceState, parseDevices, unreachableMessage } from './devices';

export const POLL_MS = 1000;

export class DeviceFeed {
  constructor(
    settings: ServerConnection.ISettings = ServerConnection.makeSettings()
  ) {
    this._settings = settings;
  }

  get state(): DeviceState {
    return this._state;
  }

  get changed(): ISignal<this, DeviceState> {
    return this._changed;
  }

  get url(): string {
    return URLExt.join(this._settings.baseUrl, 'oommagic', 'devices');
  }

  /** Start polling (at once); calling it while running does nothing. */
  start(): void {
    if (this._running) {
      return;
    }
    this._running = true;
    void this._tick(++this._generation);
  }

  stop(): void {
    this._running = false;
    // A request still in flight finds its loop ended and schedules nothing.
    this._generation++;
    if (this._timer !== null) {
      clearTimeout(this._timer);
      this._timer = null;
    }
  }

  /** One request now; the state it produced. */
  async refresh(): Promise<DeviceState> {
    let state: DeviceState;
    try {
      const response = await ServerConnection.makeRequest(
        this.url,
        { method: 'GET' },
        this._settings
      );
      if (!response.ok) {
        state = {
          kind: 'unreachable',
          message: unreachableMessage(response.status, this.url)
        };
      } else {
        state = parseDevices(await response.json());
      }
    } catch {
      state = {
        kind: 'unreachable',
        message: unreachableMessage(null, this.url)
      };
    }
    this._state = state;
    this._changed.emit(state);
    return state;
  }

  private async _tick(generation: number): Promise<void> {
    this._timer = null;
    if (generation !== this._generation) {
      return;
    }
    if (typeof document === 'undefined' || !document.hidden) {
      await this.refresh();
    }
    if (generation === this._generation) {
      this._timer = setTimeout(() => void this._tick(generation), POLL_MS);
    }
  }

  private _settings: ServerConnection.ISettings;
  private _state: DeviceState = { kind: 'loading' };
  private _timer: ReturnType<typeof setTimeout> | null = null;
  private _running = false;
  private _generation = 0;
  private _changed = new Signal<this, DeviceState>(this);
}
