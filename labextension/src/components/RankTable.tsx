import * as React from 'react';

import { formatBytes } from '../format';
import { RankJson } from '../protocol';

export interface IRankTableProps {
  ranks: readonly RankJson[];
}

/** One row per process of a distributed run: its peak, what PyTorch does not see, what failed. */
export function RankTable({ ranks }: IRankTableProps): JSX.Element | null {
  if (!ranks.length) {
    return null;
  }
  return (
    <table className="oommagic-ranks">
      <thead>
        <tr>
          <th>rank</th>
          <th>device</th>
          <th>peak reserved</th>
          <th>outside</th>
          <th />
        </tr>
      </thead>
      <tbody>
        {ranks.map(r => (
          <tr
            key={r.rank}
            className={`oommagic-rank${r.oom ? ' oommagic-rank-oom' : ''}${r.bottleneck ? ' oommagic-rank-bottleneck' : ''}`}
            data-rank={r.rank}
            title={`pid ${r.pid}, peak allocated ${formatBytes(r.peak_allocated)}`}
          >
            <td>{r.rank}</td>
            <td>{r.device}</td>
            <td>{formatBytes(r.peak_reserved)}</td>
            <td>{r.outside === null ? '—' : formatBytes(r.outside)}</td>
            <td>{rankNotes(r).join(', ')}</td>
          </tr>
        ))}
      </tbody>
    </table>
  );
}

/** "OOM (asked 2.00 GiB)", "failed first", "bottleneck": what a rank's flags say. */
export function rankNotes(rank: RankJson): string[] {
  const notes: string[] = [];
  if (rank.oom) {
    notes.push(
      rank.requested !== null
        ? `OOM (asked ${formatBytes(rank.requested)})`
        : 'OOM'
    );
  }
  if (rank.first_failed) {
    notes.push('failed first');
  }
  if (rank.bottleneck) {
    notes.push('bottleneck');
  }
  return notes;
}
