/**
 * Reading JSON that came over the wire (the comm, the server route, cell metadata): typed views that
 * never throw, so a field of the wrong type becomes an empty value instead of a broken panel.
 *
 * A record the panel reads field by field is declared once as a TypeScript interface and once as a
 * `Shape` of that interface (one `Reader` per field; a field added to the interface without a reader
 * does not compile). Reading against a shape is strict on the declared fields (a missing or mistyped
 * one is noted as a problem) and ignores fields it does not declare, so a newer kernel may add some.
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

/**
 * Reads the value of one declared field found at path `at`: its typed value, or the type's empty
 * value with a line added to `problems`.
 */
export type Reader<T> = (value: unknown, at: string, problems: string[]) => T;

/** A reader for every field of `T`. */
export type Shape<T> = { [K in keyof T]-?: Reader<T[K]> };

function expected(
  what: string,
  value: unknown,
  at: string,
  problems: string[]
): void {
  problems.push(
    `${at}: expected ${what}, got ${value === undefined ? 'nothing' : describe(value)}`
  );
}

export const text: Reader<string> = (value, at, problems) => {
  if (typeof value === 'string') {
    return value;
  }
  expected('a string', value, at, problems);
  return '';
};

/** A finite number (seconds, scores). */
export const real: Reader<number> = (value, at, problems) => {
  const n = num(value);
  if (n === null) {
    expected('a number', value, at, problems);
  }
  return n ?? 0;
};

/** An integer: bytes, counts, indices. */
export const integer: Reader<number> = (value, at, problems) => {
  if (typeof value === 'number' && Number.isInteger(value)) {
    return value;
  }
  expected('an integer', value, at, problems);
  return 0;
};

export const flag: Reader<boolean> = (value, at, problems) => {
  if (typeof value === 'boolean') {
    return value;
  }
  expected('true or false', value, at, problems);
  return false;
};

/** A JSON object whose content is not declared (a run's options, a remedy's params). */
export const anyObject: Reader<Record<string, unknown>> = (
  value,
  at,
  problems
) => {
  if (isObject(value)) {
    return value;
  }
  expected('an object', value, at, problems);
  return {};
};

/**
 * A field a kernel may leave out (one that newer kernels add): absent is `undefined` and no problem;
 * present, it is read by `read`.
 */
export function optional<T>(read: Reader<T>): Reader<T | undefined> {
  const reader: Reader<T | undefined> = (value, at, problems) =>
    value === undefined ? undefined : read(value, at, problems);
  return Object.assign(reader, { optional: true });
}

/** Whether `read` was made by `optional`: a record leaves the field out when it is absent. */
export function isOptional(read: Reader<unknown>): boolean {
  return (read as { optional?: boolean }).optional === true;
}

/** `null`, or a value `read` accepts; a mistyped value becomes null. */
export function nullable<T>(read: Reader<T>): Reader<T | null> {
  return (value, at, problems) => {
    if (value === null) {
      return null;
    }
    const mine: string[] = [];
    const result = read(value, at, mine);
    problems.push(...mine);
    return mine.length ? null : result;
  };
}

/** One of `values`; anything else becomes `fallback`. */
export function oneOf<T extends string>(
  values: readonly T[],
  fallback: T
): Reader<T> {
  return (value, at, problems) => {
    if ((values as readonly unknown[]).includes(value)) {
      return value as T;
    }
    expected(`one of ${values.join(', ')}`, value, at, problems);
    return fallback;
  };
}

/** A list read entry by entry; a mistyped entry becomes its empty value, so lists stay aligned. */
export function listOf<T>(read: Reader<T>): Reader<T[]> {
  return (value, at, problems) => {
    if (!Array.isArray(value)) {
      expected('a list', value, at, problems);
      return [];
    }
    return value.map((entry, i) => read(entry, `${at}[${i}]`, problems));
  };
}

/** A two-entry list, as Python writes a tuple. */
export function pair<A, B>(
  first: Reader<A>,
  second: Reader<B>
): Reader<[A, B]> {
  return (value, at, problems) => {
    if (!Array.isArray(value) || value.length !== 2) {
      expected('a list of two', value, at, problems);
      return [first(undefined, at, []), second(undefined, at, [])];
    }
    return [
      first(value[0], `${at}[0]`, problems),
      second(value[1], `${at}[1]`, problems)
    ];
  };
}

/** An object with the fields of `shape`; fields it does not declare are left out. */
export function record<T>(shape: Shape<T>): Reader<T> {
  return (value, at, problems) => {
    if (!isObject(value)) {
      expected('an object', value, at, problems);
    }
    const data = isObject(value) ? value : {};
    const out: Partial<T> = {};
    for (const key of Object.keys(shape) as (keyof T & string)[]) {
      const path = at ? `${at}.${key}` : key;
      if (key in data) {
        out[key] = shape[key](data[key], path, problems);
      } else if (isOptional(shape[key])) {
        continue;
      } else {
        problems.push(`${path}: missing`);
        out[key] = shape[key](undefined, path, []);
      }
    }
    return out as T;
  };
}

/** The readers of some fields of a shape (a record that is a part of another). */
export function pick<T, K extends keyof T>(
  shape: Shape<T>,
  keys: readonly K[]
): Shape<Pick<T, K>> {
  const out: Partial<Shape<Pick<T, K>>> = {};
  for (const key of keys) {
    out[key] = shape[key];
  }
  return out as Shape<Pick<T, K>>;
}
