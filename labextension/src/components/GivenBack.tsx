import * as React from 'react';

import { formatBytes } from '../format';
import { CellRunJson } from '../protocol';

export interface IGivenBackProps {
  run: Pick<CellRunJson, 'freed' | 'dropped'>;
}

/**
 * What the kernel gave back after a failed run: the bytes freed, and the names the failed cell had
 * bound to device memory that were dropped with it (so the user knows why `x` is gone).
 */
export function GivenBack({ run }: IGivenBackProps): JSX.Element | null {
  if (!run.freed && !run.dropped.length) {
    return null;
  }
  return (
    <div className="oommagic-run-freed">
      {run.freed ? `given back after the error: ${formatBytes(run.freed)}` : ''}
      {run.dropped.length ? (
        <div className="oommagic-run-dropped">
          names dropped:{' '}
          {run.dropped.map(([name, bytes], i) => (
            <React.Fragment key={name}>
              {i ? ', ' : ''}
              <code>{name}</code> ({formatBytes(bytes)})
            </React.Fragment>
          ))}
        </div>
      ) : null}
    </div>
  );
}
