import * as React from 'react';

import { formatBytes } from '../format';
import { CategoryJson } from '../protocol';

export interface ICategoryBarProps {
  categories: readonly CategoryJson[];
  budget: number | null;
}

/**
 * Memory by category as one stacked bar against the budget, with a legend. Each key has its colour
 * (`oommagic-cat-<key>` in the style sheet, the kernel report's colours), the same on every card.
 */
export function CategoryBar({
  categories,
  budget
}: ICategoryBarProps): JSX.Element | null {
  const parts = categories.filter(c => c.bytes > 0);
  const total = parts.reduce((sum, c) => sum + c.bytes, 0);
  if (!total) {
    return null;
  }
  const scale = Math.max(total, budget ?? 0);
  const width = (bytes: number): string =>
    `${((100 * bytes) / scale).toFixed(2)}%`;
  return (
    <div className="oommagic-categories">
      <div
        className="oommagic-category-bar"
        role="img"
        aria-label={`${formatBytes(total)} by category${budget ? ` of ${formatBytes(budget)}` : ''}`}
      >
        {parts.map(c => (
          <span
            key={c.key}
            className={`oommagic-cat oommagic-cat-${c.key}`}
            data-key={c.key}
            style={{ width: width(c.bytes) }}
            title={`${c.label}: ${formatBytes(c.bytes)}`}
          />
        ))}
        {budget && budget < scale ? (
          <span
            className="oommagic-category-budget"
            style={{ left: width(budget) }}
            title={`budget ${formatBytes(budget)}`}
          />
        ) : null}
      </div>
      <ul className="oommagic-category-legend">
        {parts.map(c => (
          <li key={c.key} data-key={c.key}>
            <span className={`oommagic-cat-swatch oommagic-cat-${c.key}`} />
            {c.label} {formatBytes(c.bytes)}
          </li>
        ))}
      </ul>
    </div>
  );
}
