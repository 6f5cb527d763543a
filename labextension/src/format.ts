/**
 * Sizes for people, formatted the way PyTorch's out-of-memory message does: 1024-based units, two
 * decimals, `bytes`/KiB/MiB/GiB/TiB. The kernel and the sidebar print the same figure for the same
 * byte count, so a number in the panel can be found in the error text.
 */

const UNITS: ReadonlyArray<[string, bigint]> = [
  ['KiB', 1024n],
  ['MiB', 1024n ** 2n],
  ['GiB', 1024n ** 3n],
  ['TiB', 1024n ** 4n]
];

/**
 * `formatBytes(20 * 2 ** 20)` is `"20.00 MiB"`; `null`/`undefined` (a figure nobody measured) is `"?"`.
 *
 * Rounding is exact and half-to-even, like C++ `std::fixed` and Python's `format(x, ".2f")` on the
 * exact binary value: 1152 bytes is 1.125 KiB and prints `"1.12 KiB"` where `toFixed` would say 1.13.
 */
export function formatBytes(n: number | null | undefined): string {
  if (n === null || n === undefined || !Number.isFinite(n)) {
    return '?';
  }
  const sign = n < 0 ? '-' : '';
  const bytes = BigInt(Math.round(Math.abs(n)));
  if (bytes < 1024n) {
    return `${sign}${bytes} bytes`;
  }
  let [unit, scale] = UNITS[UNITS.length - 1];
  for (const [name, size] of UNITS) {
    if (bytes < size * 1024n) {
      [unit, scale] = [name, size];
      break;
    }
  }
  return `${sign}${hundredths(bytes, scale)} ${unit}`;
}

/** `bytes / scale` with two decimals, rounded half-to-even in integer arithmetic. */
function hundredths(bytes: bigint, scale: bigint): string {
  const scaled = bytes * 100n;
  let q = scaled / scale;
  const twiceRest = (scaled - q * scale) * 2n;
  if (twiceRest > scale || (twiceRest === scale && q % 2n === 1n)) {
    q += 1n;
  }
  const cents = (q % 100n).toString().padStart(2, '0');
  return `${q / 100n}.${cents}`;
}

/** `0.25` → `"25%"`; null when either side is unknown or the total is zero. */
export function percent(
  part: number | null,
  total: number | null
): string | null {
  if (part === null || total === null || total <= 0) {
    return null;
  }
  return `${Math.round((100 * part) / total)}%`;
}
