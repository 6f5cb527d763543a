import * as React from 'react';

import { GpuJson } from '../devices';
import { formatBytes } from '../format';
import { MemoryBar } from './MemoryBar';

export interface IDeviceCardProps {
  gpu: GpuJson;
}

/** One GPU: name, used of total with a bar, the processes holding memory on it, and its error. */
export function DeviceCard({ gpu }: IDeviceCardProps): JSX.Element {
  const cuda =
    gpu.cuda_index !== null && gpu.cuda_index !== gpu.nvml_index
      ? ` (cuda:${gpu.cuda_index})`
      : '';
  const title = `GPU ${gpu.nvml_index}${cuda}`;
  return (
    <li
      className={`oommagic-device${gpu.error ? ' oommagic-device-error' : ''}`}
      data-uuid={gpu.uuid ?? undefined}
    >
      <div className="oommagic-device-title">
        <span className="oommagic-device-index">{title}</span>
        <span className="oommagic-device-name">
          {gpu.name ?? 'unknown GPU'}
        </span>
      </div>
      {gpu.total !== null || gpu.used !== null ? (
        <>
          <MemoryBar
            used={gpu.used}
            total={gpu.total}
            label={`${title} memory`}
          />
          <div className="oommagic-device-figures">
            {formatBytes(gpu.used)} used of {formatBytes(gpu.total)}
            {gpu.free !== null ? ` · ${formatBytes(gpu.free)} free` : ''}
          </div>
        </>
      ) : null}
      {gpu.error ? <div className="oommagic-error">{gpu.error}</div> : null}
      {gpu.processes.length ? (
        <table className="oommagic-processes">
          <thead>
            <tr>
              <th>PID</th>
              <th>process</th>
              <th>memory</th>
            </tr>
          </thead>
          <tbody>
            {gpu.processes.map(p => (
              <tr key={p.pid}>
                <td>{p.pid}</td>
                <td
                  className="oommagic-process-name"
                  title={p.name ?? undefined}
                >
                  {p.name ?? '?'}
                </td>
                <td>{formatBytes(p.used)}</td>
              </tr>
            ))}
          </tbody>
        </table>
      ) : gpu.error ? null : (
        <div className="oommagic-muted">no process holds memory on it</div>
      )}
    </li>
  );
}
