import { sparklineShape, stepPath } from '../src/sparkline';

const box = { width: 100, height: 20 };

describe('sparklineShape', () => {
  it('draws memory as steps scaled to the budget', () => {
    const shape = sparklineShape(
      {
        t: [0, 1, 2],
        allocated: [0, 50, 25],
        reserved: [0, 50, 50],
        oom_at: null
      },
      100,
      box
    );
    expect(shape.allocated).toBe('M0 20 H50 V10 H100 V15 H100');
    expect(shape.reserved).toBe('M0 20 H50 V10 H100 V10 H100');
    expect(shape.budgetY).toBe(0);
    expect(shape.oomX).toBeNull();
  });

  it('scales to the peak when the run went past the budget, and marks the OOM', () => {
    const shape = sparklineShape(
      { t: [0, 1], allocated: [0, 200], reserved: [0, 200], oom_at: 2 },
      100,
      box
    );
    expect(shape.top).toBe(200);
    expect(shape.budgetY).toBe(10);
    expect(shape.oomX).toBe(100);
    expect(shape.allocated).toBe('M0 20 H50 V0 H100');
  });

  it('draws nothing without samples and a flat line for one', () => {
    expect(
      sparklineShape(
        { t: [], allocated: [], reserved: [], oom_at: null },
        null,
        box
      ).allocated
    ).toBe('');
    expect(
      sparklineShape(
        { t: [0], allocated: [5], reserved: [5], oom_at: null },
        null,
        box
      ).allocated
    ).toBe('M0 0 H100');
  });
});

describe('stepPath', () => {
  it('holds each value until the next sample', () => {
    expect(
      stepPath(
        [0, 2],
        [1, 3],
        s => s * 10,
        v => v,
        40
      )
    ).toBe('M0 1 H20 V3 H40');
  });
});
