import * as React from 'react';

import { DeviceState } from '../devices';
import { DeviceCard } from './DeviceCard';

export interface IDeviceListProps {
  state: DeviceState;
}

/**
 * The GPUs of the server's machine, or in plain words why there are none: the route is missing, NVML
 * is not there, or it lists no GPU. A card NVML fails on shows its error among the others.
 */
export function DeviceList({ state }: IDeviceListProps): JSX.Element {
  if (state.kind === 'loading') {
    return (
      <div className="oommagic-muted oommagic-devices-status">
        Reading the GPUs…
      </div>
    );
  }
  if (state.kind === 'unreachable') {
    return (
      <div className="oommagic-notice oommagic-devices-status">
        {state.message}
      </div>
    );
  }
  const { report } = state;
  if (!report.available) {
    return (
      <div className="oommagic-notice oommagic-devices-status">
        No GPU information on this machine
        {report.error ? `: ${report.error}` : ''}. Runs in CPU mode are still
        listed below.
      </div>
    );
  }
  if (!report.devices.length) {
    return (
      <div className="oommagic-notice oommagic-devices-status">
        NVML lists no GPU on this machine. Runs in CPU mode are still listed
        below.
      </div>
    );
  }
  return (
    <>
      <ul className="oommagic-devices">
        {report.devices.map(gpu => (
          <DeviceCard key={gpu.uuid ?? gpu.nvml_index} gpu={gpu} />
        ))}
      </ul>
      {report.driver ? (
        <div className="oommagic-muted">driver {report.driver}</div>
      ) : null}
    </>
  );
}
