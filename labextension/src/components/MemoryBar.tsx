import * as React from 'react';

import { formatBytes } from '../format';

export interface IMemoryBarProps {
  used: number | null;
  total: number | null;
  /** Accessible name, e.g. "GPU 0 memory". */
  label: string;
}

/** A horizontal bar of `used` out of `total` bytes; amber past 80 %, red past 95 %. */
export function MemoryBar({
  used,
  total,
  label
}: IMemoryBarProps): JSX.Element {
  const known = used !== null && total !== null && total > 0;
  const fraction = known ? Math.min(1, Math.max(0, used / total)) : 0;
  const level = fraction > 0.95 ? 'full' : fraction > 0.8 ? 'high' : 'normal';
  return (
    <div
      className={`oommagic-bar oommagic-bar-${level}`}
      role="meter"
      aria-label={label}
      aria-valuemin={0}
      aria-valuemax={total ?? undefined}
      aria-valuenow={used ?? undefined}
      aria-valuetext={
        known ? `${formatBytes(used)} of ${formatBytes(total)}` : 'unknown'
      }
    >
      <div
        className="oommagic-bar-fill"
        style={{ width: `${(fraction * 100).toFixed(1)}%` }}
      />
    </div>
  );
}
