import { fixedCellSource, writtenSources } from '../src/fix';

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

describe('writtenSources', () => {
  const TRAIN =
    'def train(model, batch_size):\n    loss = model(batch_size)\n    loss.backward()\n';
  const NEW_TRAIN =
    'def train(model, batch_size):\n    for _ in range(16):\n        (model(batch_size) / 16).backward()';
  const defs = `import torch\n\n${TRAIN}\n\ndef make_model():\n    return 1`;
  const failing =
    '%%gpumem --limit $LIMIT\nbatch_size = 256\ntrain(model, batch_size)';
  const write = {
    body: 'batch_size = 16\ntrain(model, batch_size)',
    functions: [{ name: 'train', was: TRAIN, now: NEW_TRAIN }]
  };

  it('writes a redefined function back into the cell that defines it, and the body under the magic', () => {
    const next = writtenSources(
      ['%load_ext oommagic', defs, failing],
      2,
      write
    );
    expect([...next.keys()].sort()).toEqual([1, 2]);
    expect(next.get(1)).toBe(
      `import torch\n\n${NEW_TRAIN}\n\n\ndef make_model():\n    return 1`
    );
    expect(next.get(2)).toBe(
      '%%gpumem --limit $LIMIT\nbatch_size = 16\ntrain(model, batch_size)'
    );
    // One definition of train in the notebook.
    const after = ['%load_ext oommagic', next.get(1)!, next.get(2)!].join('\n');
    expect(after.match(/def train/g)).toHaveLength(1);
  });

  it('puts a function found in no other cell on top of the cell, once', () => {
    const next = writtenSources(['x = 1', failing], 1, write);
    expect([...next.keys()]).toEqual([1]);
    expect(next.get(1)).toBe(
      `%%gpumem --limit $LIMIT\n${NEW_TRAIN}\n\nbatch_size = 16\ntrain(model, batch_size)`
    );
  });

  it('changes nothing once written: the notebook already says it', () => {
    const sources = ['%load_ext oommagic', defs, failing];
    for (const [i, source] of writtenSources(sources, 2, write)) {
      sources[i] = source;
    }
    expect(writtenSources(sources, 2, write).size).toBe(0);
  });
});
