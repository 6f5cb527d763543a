import { IRunCardProps } from '../src/components/RunCard';
import { RunEntry } from '../src/runs';

/** The props of a `RunCard` for `entry`: its cell in the notebook, nothing pending, callbacks doing nothing. */
export function cardProps(
  entry: RunEntry,
  overrides: Partial<IRunCardProps> = {}
): IRunCardProps {
  const noop = (): void => undefined;
  return {
    entry,
    cellPresent: true,
    busy: false,
    retries: [],
    pending: null,
    refusal: null,
    onReveal: noop,
    onRetry: noop,
    onApply: noop,
    onApplyEntry: noop,
    onWriteFitted: noop,
    written: false,
    onRunPlanEntry: noop,
    onRemoveFix: noop,
    ...overrides
  };
}
