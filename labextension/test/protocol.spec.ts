import {
  applyRequest,
  parseCellRun,
  parseKernelMessage,
  removeRequest
} from '../src/protocol';
import { oomRun } from './fixtures';

describe('parseKernelMessage', () => {
  it('reads a hello with every run so far', () => {
    const message = parseKernelMessage({
      version: 1,
      type: 'hello',
      runs: [oomRun(), oomRun({ id: 'second' })]
    });
    expect(message.kind).toBe('hello');
    expect(message.kind === 'hello' && message.runs.map(r => r.id)).toEqual([
      'run-1',
      'second'
    ]);
  });

  it('reads a run message', () => {
    const message = parseKernelMessage({
      version: 1,
      type: 'run',
      run: oomRun()
    });
    expect(message).toEqual({ kind: 'run', run: oomRun(), problems: [] });
  });

  it("reads the kernel's refusal of a sidebar action", () => {
    expect(
      parseKernelMessage({
        version: 1,
        type: 'error',
        run: 'run-1',
        message: 'run run-1 has no plan entry 5'
      })
    ).toEqual({
      kind: 'error',
      run: 'run-1',
      message: 'run run-1 has no plan entry 5'
    });
    expect(parseKernelMessage({ version: 1, type: 'error', run: 7 })).toEqual({
      kind: 'error',
      run: null,
      message: 'the kernel could not do that'
    });
  });

  it('reads the request to write a fitted run into the notebook, and refuses a broken one', () => {
    const write = {
      body: 'batch_size = 16\ntrain(model)',
      functions: [
        {
          name: 'train',
          was: 'def train(m):\n    pass\n',
          now: 'def train(m):\n    return'
        }
      ]
    };
    expect(
      parseKernelMessage({
        version: 1,
        type: 'write',
        run: 'r2',
        cell_id: 'c1',
        write
      })
    ).toEqual({ kind: 'write', run: 'r2', cellId: 'c1', write });
    expect(
      parseKernelMessage({
        version: 1,
        type: 'write',
        run: 'r2',
        write: { body: 3 }
      })
    ).toMatchObject({ kind: 'unknown' });
  });

  it('turns an unknown version into a one-line notice instead of throwing', () => {
    const message = parseKernelMessage({
      version: 2,
      type: 'run',
      run: oomRun()
    });
    expect(message).toMatchObject({
      kind: 'unknown',
      notice: 'unknown message from oommagic v2'
    });
  });

  it('turns an unknown type into a notice', () => {
    expect(parseKernelMessage({ version: 1, type: 'gossip' })).toMatchObject({
      kind: 'unknown',
      notice: 'unknown message from oommagic v1'
    });
  });

  it.each([
    null,
    'hello',
    42,
    [],
    { type: 'hello' },
    { version: 1, type: 'run' },
    { version: 1, type: 'hello' }
  ])('never throws on %j', data => {
    expect(parseKernelMessage(data).kind).toBe('unknown');
  });

  it('drops runs without an id from a hello and keeps the others', () => {
    const message = parseKernelMessage({
      version: 1,
      type: 'hello',
      runs: [{ outcome: 'ok' }, oomRun()]
    });
    expect(message.kind === 'hello' && message.runs.length).toBe(1);
  });
});

describe('parseCellRun', () => {
  it('fills what an older or broken kernel left out', () => {
    const run = parseCellRun({
      id: 'x',
      outcome: 'ok',
      peak_allocated: 'lots',
      timeline: { t: [0, 1] }
    });
    expect(run).toMatchObject({
      id: 'x',
      outcome: 'ok',
      peak_allocated: 0,
      capacity: null,
      findings: [],
      timeline: { t: [], allocated: [], reserved: [] }
    });
  });

  it('reads an outcome it does not know as an error', () => {
    expect(parseCellRun({ id: 'x', outcome: 'exploded' })?.outcome).toBe(
      'error'
    );
  });

  it('keeps a remedy without new_source as not applicable to the cell', () => {
    const run = oomRun();
    const finding = run.findings.find(f => f.remedies.length)!;
    const remedy = { ...finding.remedies[0], new_source: undefined };
    const parsed = parseCellRun({
      ...run,
      findings: [{ ...finding, remedies: [remedy] }]
    });
    expect(parsed?.findings[0].remedies[0]).toMatchObject({
      kind: 'batch',
      new_source: null
    });
  });
});

describe('the sidebar actions', () => {
  it('are the messages the kernel reads', () => {
    expect(applyRequest('run-1', 0)).toEqual({
      type: 'apply',
      run: 'run-1',
      entry: 0
    });
    expect(removeRequest('run-2', 1)).toEqual({
      type: 'remove',
      run: 'run-2',
      index: 1
    });
  });
});
