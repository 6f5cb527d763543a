import * as React from 'react';

import { formatBytes } from '../format';
import { TimelineJson } from '../protocol';
import { sparklineShape } from '../sparkline';

export interface ISparklineProps {
  timeline: TimelineJson;
  /** The limit or capacity, drawn as a dashed line. */
  budget: number | null;
  width?: number;
  height?: number;
}

/** Allocated (filled line) and reserved (light line) memory over the run, the budget, the OOM. */
export function Sparkline({
  timeline,
  budget,
  width = 220,
  height = 36
}: ISparklineProps): JSX.Element | null {
  if (!timeline.t.length) {
    return null;
  }
  const shape = sparklineShape(timeline, budget, { width, height });
  const seconds = timeline.t[timeline.t.length - 1];
  return (
    <svg
      className="oommagic-sparkline"
      width={width}
      height={height}
      viewBox={`0 0 ${width} ${height}`}
      role="img"
      aria-label={`memory over ${seconds.toFixed(2)} s, chart top ${formatBytes(shape.top)}`}
    >
      <title>{`allocated and reserved memory; top of chart ${formatBytes(shape.top)}`}</title>
      {shape.budgetY !== null ? (
        <line
          className="oommagic-sparkline-budget"
          x1={0}
          x2={width}
          y1={shape.budgetY}
          y2={shape.budgetY}
        />
      ) : null}
      <path className="oommagic-sparkline-reserved" d={shape.reserved} />
      <path className="oommagic-sparkline-allocated" d={shape.allocated} />
      {shape.oomX !== null ? (
        <line
          className="oommagic-sparkline-oom"
          x1={shape.oomX}
          x2={shape.oomX}
          y1={0}
          y2={height}
        />
      ) : null}
    </svg>
  );
}
