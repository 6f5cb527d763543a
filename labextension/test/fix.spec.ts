import { fixedCellSource } from '../src/fix';

describe('fixedCellSource', () => {
  it('keeps the %%gpumem line and its options over the new body', () => {
    expect(
      fixedCellSource(
        '%%gpumem --limit 64MiB\nbatch_size = 64\nrun()',
        'batch_size = 8\nrun()'
      )
    ).toBe('%%gpumem --limit 64MiB\nbatch_size = 8\nrun()');
  });

  it('takes a new source that brings its own cell magic as it is', () => {
    expect(fixedCellSource('%%gpumem\nx', '%%gpumem --limit 1GiB\ny')).toBe(
      '%%gpumem --limit 1GiB\ny'
    );
  });

  it('writes the body alone into a cell without the magic', () => {
    expect(fixedCellSource('batch_size = 64', 'batch_size = 8')).toBe(
      'batch_size = 8'
    );
  });
});
