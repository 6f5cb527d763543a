/**
 * The geometry of a run's memory sparkline: SVG paths for allocated and reserved bytes over time, the
 * budget line and the moment of the out-of-memory error. Pure, so it is tested without a DOM.
 *
 * Memory is a step function (each sample holds until the next event), so the paths are drawn as
 * steps, not as lines between samples that would invent values that never existed.
 */

import type { TimelineJson } from './protocol';

export interface SparklineBox {
  width: number;
  height: number;
}

export interface SparklineShape {
  /** Step path of allocated bytes; '' without samples. */
  allocated: string;
  /** Step path of reserved bytes; '' without samples. */
  reserved: string;
  /** y of the budget (limit or capacity), null when unknown or off the chart. */
  budgetY: number | null;
  /** x of the out-of-memory event, null without one. */
  oomX: number | null;
  /** The byte value at the top edge. */
  top: number;
}

/**
 * Shape of `timeline` scaled into `box`. The y axis runs from 0 to the largest of the budget and the
 * peaks, so "how close to the limit" reads at a glance; time runs from 0 to the last sample (or the
 * OOM).
 */
export function sparklineShape(
  timeline: Pick<TimelineJson, 't' | 'allocated' | 'reserved' | 'oom_at'>,
  budget: number | null,
  box: SparklineBox
): SparklineShape {
  const n = Math.min(timeline.t.length, timeline.allocated.length);
  const t = timeline.t.slice(0, n);
  const allocated = timeline.allocated.slice(0, n);
  const reserved =
    timeline.reserved.length >= n ? timeline.reserved.slice(0, n) : allocated;
  const peak = Math.max(0, ...allocated, ...reserved);
  const top = Math.max(peak, budget ?? 0, 1);
  const end = Math.max(t.length ? t[t.length - 1] : 0, timeline.oom_at ?? 0);
  const x = (s: number): number => (end > 0 ? (s / end) * box.width : 0);
  const y = (bytes: number): number => box.height - (bytes / top) * box.height;
  return {
    allocated: stepPath(t, allocated, x, y, box.width),
    reserved: stepPath(t, reserved, x, y, box.width),
    budgetY: budget !== null && budget > 0 ? round(y(budget)) : null,
    oomX: timeline.oom_at !== null && n > 0 ? round(x(timeline.oom_at)) : null,
    top
  };
}

/** `M x0 y0 H x1 V y1 H x2 …`: each value holds until the next sample; the last one to `right`. */
export function stepPath(
  t: readonly number[],
  values: readonly number[],
  x: (s: number) => number,
  y: (bytes: number) => number,
  right: number
): string {
  if (t.length === 0) {
    return '';
  }
  const parts = [`M${round(x(t[0]))} ${round(y(values[0]))}`];
  for (let i = 1; i < t.length; i++) {
    parts.push(`H${round(x(t[i]))}`, `V${round(y(values[i]))}`);
  }
  parts.push(`H${round(right)}`);
  return parts.join(' ');
}

function round(v: number): number {
  return Math.round(v * 10) / 10;
}
