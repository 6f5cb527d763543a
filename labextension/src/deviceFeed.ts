/**
 * Asks `GET <base_url>oommagic/devices` every `interval` ms while someone looks at the panel, through
 * a Lumino `Poll`: the next request is scheduled when the previous answer arrived (a slow server is
 * never asked twice at once), the poll stands by while the browser tab is hidden, and while the route
 * fails (not enabled, server gone) it waits longer after each failure, up to `MAX_INTERVAL_MS`.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { IDisposable } from '@lumino/disposable';
import { IPoll, Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { DeviceState, parseDevices, unreachableMessage } from './devices';

export const DEFAULT_INTERVAL_MS = 1000;
/** The longest wait between two requests while the route keeps failing. */
export const MAX_INTERVAL_MS = 30_000;
/** After a failure the next wait is drawn between the interval and this many times the last wait. */
export const BACKOFF = 2;

/** The poll's frequency for an interval (the backoff's ceiling is never below the interval). */
export function frequencyFor(interval: number): IPoll.Frequency {
  return {
    interval,
    backoff: BACKOFF,
    max: Math.max(interval, MAX_INTERVAL_MS)
  };
}

export class DeviceFeed implements IDisposable {
  constructor(
    settings: ServerConnection.ISettings = ServerConnection.makeSettings(),
    interval = DEFAULT_INTERVAL_MS
  ) {
    this._settings = settings;
    this._poll = new Poll<DeviceState, DeviceState>({
      name: 'oommagic:devices',
      auto: false,
      factory: () => this._request(),
      frequency: frequencyFor(interval),
      standby: 'when-hidden'
    });
  }

  get state(): DeviceState {
    return this._state;
  }

  get changed(): ISignal<this, DeviceState> {
    return this._changed;
  }

  /** The poll itself, to read its phase and its next wait; start, stop and the interval go through the feed. */
  get poll(): IPoll<DeviceState, DeviceState, 'standby'> {
    return this._poll;
  }

  get url(): string {
    return URLExt.join(this._settings.baseUrl, 'oommagic', 'devices');
  }

  /** Milliseconds between two answers and the next request while the route answers. */
  get interval(): number {
    return this._poll.frequency.interval;
  }

  /** A new interval applies at once: a running feed asks now and then keeps the new pace. */
  set interval(ms: number) {
    if (ms === this.interval) {
      return;
    }
    this._poll.frequency = frequencyFor(ms);
    if (this.isRunning) {
      void this._poll.refresh();
    }
  }

  /** Whether the feed was started and not stopped since (it may stand by while the tab is hidden). */
  get isRunning(): boolean {
    const { phase } = this._poll.state;
    return (
      phase !== 'constructed' && phase !== 'stopped' && phase !== 'disposed'
    );
  }

  get isDisposed(): boolean {
    return this._poll.isDisposed;
  }

  /** Start polling (at once); calling it while running does nothing. */
  start(): void {
    void this._poll.start();
  }

  /** Stop polling; an answer still in flight is shown but schedules nothing. */
  stop(): void {
    void this._poll.stop();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    Signal.clearData(this);
  }

  /** One request; rejects with the state when the route failed, so that the poll backs off. */
  private async _request(): Promise<DeviceState> {
    let state: DeviceState;
    try {
      const response = await ServerConnection.makeRequest(
        this.url,
        { method: 'GET' },
        this._settings
      );
      state = response.ok
        ? parseDevices(await response.json())
        : {
            kind: 'unreachable',
            message: unreachableMessage(response.status, this.url)
          };
    } catch {
      state = {
        kind: 'unreachable',
        message: unreachableMessage(null, this.url)
      };
    }
    this._state = state;
    this._changed.emit(state);
    if (state.kind === 'unreachable') {
      throw state;
    }
    return state;
  }

  private _settings: ServerConnection.ISettings;
  private _poll: Poll<DeviceState, DeviceState>;
  private _state: DeviceState = { kind: 'loading' };
  private _changed = new Signal<this, DeviceState>(this);
}
