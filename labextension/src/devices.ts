/**
 * The server's answer about the GPUs (`GET <base_url>oommagic/devices`, written by
 * `oommagic/server/handlers.py`) and what the panel makes of it. Pure: fetching lives in
 * `deviceFeed.ts`.
 */

import { isObject, num, str } from './json';

export interface GpuProcessJson {
  pid: number;
  name: string | null;
  used: number | null;
}

export interface GpuJson {
  nvml_index: number;
  cuda_index: number | null;
  uuid: string | null;
  name: string | null;
  used: number | null;
  total: number | null;
  free: number | null;
  processes: GpuProcessJson[];
  error: string | null;
}

export interface DevicesJson {
  version: number;
  time: number;
  available: boolean;
  error: string | null;
  driver: string | null;
  devices: GpuJson[];
}

/** What the device section shows: still asking, an answer, or why there is none. */
export type DeviceState =
  | { kind: 'loading' }
  | { kind: 'ok'; report: DevicesJson }
  | { kind: 'unreachable'; message: string };

export const DEVICES_VERSION = 1;

/** Read the route's JSON; an answer of another shape becomes `unreachable` with a reason. */
export function parseDevices(value: unknown): DeviceState {
  if (!isObject(value)) {
    return {
      kind: 'unreachable',
      message: 'The GPU route answered something that is not JSON.'
    };
  }
  if (value.version !== DEVICES_VERSION) {
    return {
      kind: 'unreachable',
      message: `The GPU route answered version ${String(value.version)}; this panel reads version ${DEVICES_VERSION}. Update oommagic so both sides match.`
    };
  }
  const devices = Array.isArray(value.devices)
    ? value.devices.filter(isObject).map(parseGpu)
    : [];
  return {
    kind: 'ok',
    report: {
      version: DEVICES_VERSION,
      time: num(value.time) ?? 0,
      available: value.available === true,
      error: str(value.error),
      driver: str(value.driver),
      devices
    }
  };
}

/** The panel's line for an HTTP failure of the route. */
export function unreachableMessage(status: number | null, url: string): string {
  if (status === 404) {
    return `The oommagic server extension is not enabled (${url} answered 404). Run \`jupyter server extension enable oommagic\` and restart Jupyter.`;
  }
  if (status === 403 || status === 401) {
    return `The Jupyter server refused the GPU route (${status}): log in again.`;
  }
  if (status === null) {
    return `The Jupyter server cannot be reached for ${url}.`;
  }
  return `The GPU route answered ${status}; see the Jupyter server's log.`;
}

function parseGpu(value: Record<string, unknown>): GpuJson {
  return {
    nvml_index: num(value.nvml_index) ?? 0,
    cuda_index: num(value.cuda_index),
    uuid: str(value.uuid),
    name: str(value.name),
    used: num(value.used),
    total: num(value.total),
    free: num(value.free),
    processes: Array.isArray(value.processes)
      ? value.processes.filter(isObject).map(p => ({
          pid: num(p.pid) ?? 0,
          name: str(p.name),
          used: num(p.used)
        }))
      : [],
    error: str(value.error)
  };
}
