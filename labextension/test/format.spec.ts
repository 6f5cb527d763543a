import { formatBytes, percent } from '../src/format';

describe('formatBytes prints sizes the way PyTorch does', () => {
  it.each([
    [0, '0 bytes'],
    [1, '1 bytes'],
    [1023, '1023 bytes'],
    [1024, '1.00 KiB'],
    [1536, '1.50 KiB'],
    [20 * 2 ** 20, '20.00 MiB'],
    [3532587008, '3.29 GiB'],
    [150110011392, '139.80 GiB'],
    [8 * 2 ** 30, '8.00 GiB'],
    [2 * 2 ** 40, '2.00 TiB'],
    [5253120, '5.01 MiB']
  ])('%d bytes is %s', (bytes, text) => {
    expect(formatBytes(bytes)).toBe(text);
  });

  it('rounds exact ties to even, like C++ std::fixed and Python', () => {
    expect(formatBytes(1152)).toBe('1.12 KiB'); // 1.125 KiB
    expect(formatBytes(1408)).toBe('1.38 KiB'); // 1.375 KiB
  });

  it('keeps a value just under the next unit in the smaller unit', () => {
    expect(formatBytes(2 ** 30 - 1)).toBe('1024.00 MiB');
  });

  it('prints negative sizes (memory a cell gave back) with a sign', () => {
    expect(formatBytes(-2048)).toBe('-2.00 KiB');
  });

  it('prints ? for a figure nobody measured', () => {
    expect(formatBytes(null)).toBe('?');
    expect(formatBytes(undefined)).toBe('?');
    expect(formatBytes(Number.NaN)).toBe('?');
  });
});

describe('percent', () => {
  it('rounds to a whole percent and gives up without a total', () => {
    expect(percent(1, 3)).toBe('33%');
    expect(percent(5, null)).toBeNull();
    expect(percent(5, 0)).toBeNull();
  });
});
