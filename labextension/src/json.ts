/**
 * Reading JSON that came over the wire (the comm, the server route, cell metadata): typed views that
 * never throw, so a field of the wrong type becomes an empty value instead of a broken panel.
 */

export function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

/** A finite number, else null. */
export function num(value: unknown): number | null {
  return typeof value === 'number' && Number.isFinite(value) ? value : null;
}

/** A string, else null. */
export function str(value: unknown): string | null {
  return typeof value === 'string' ? value : null;
}

/** A list of numbers; a non-number entry becomes 0 so that parallel lists keep their alignment. */
export function numbers(value: unknown): number[] {
  return Array.isArray(value) ? value.map(v => num(v) ?? 0) : [];
}

/** A short printable form of any value, for notices. */
export function describe(value: unknown): string {
  try {
    return (JSON.stringify(value) ?? String(value)).slice(0, 40);
  } catch {
    return String(value);
  }
}
