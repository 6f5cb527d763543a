import { CellRunJson } from '../src/protocol';

/** A CellRun json as `oommagic.cellrun.CellRun.to_json()` writes it: an OOM under a 64 MiB limit. */
export function oomRun(overrides: Partial<CellRunJson> = {}): CellRunJson {
  return {
    version: 1,
    id: 'a1b2c3d4e5f6',
    parent: null,
    source:
      'import torch\nbatch_size = 64\nx = torch.empty(batch_size, 1024, 1024, dtype=torch.uint8)\n',
    device: 'cpu',
    options: { limit: '64MiB' },
    execution_count: 2,
    cell_id: 'cell-2',
    started: 1718000000.5,
    wall_s: 0.42,
    outcome: 'oom',
    headline: 'needed 256.00 MiB more than the 64.00 MiB limit had',
    before_allocated: 0,
    before_reserved: 0,
    after_allocated: 0,
    after_reserved: 0,
    peak_allocated: 64 * 2 ** 20,
    peak_reserved: 64 * 2 ** 20,
    capacity: 16 * 2 ** 30,
    limit: 64 * 2 ** 20,
    headroom: 0,
    timeline: {
      t: [0, 0.1, 0.2],
      allocated: [0, 64 * 2 ** 20, 64 * 2 ** 20],
      reserved: [0, 64 * 2 ** 20, 64 * 2 ** 20],
      steps: [],
      oom_at: 0.2,
      truncated: false,
      events: 2
    },
    report: null,
    freed: 64 * 2 ** 20,
    error: null,
    findings: [
      {
        key: 'batch',
        title: 'The batch does not fit',
        evidence: 'batch_size = 64 needs 320.00 MiB; 64.00 MiB are allowed',
        saving: 256 * 2 ** 20,
        score: 0.9,
        remedies: [
          {
            kind: 'batch',
            title: 'batch_size 64 → 8',
            explanation: 'a smaller batch',
            code: 'batch_size = 8',
            automatic: true,
            saving: 256 * 2 ** 20,
            params: { name: 'batch_size', new: 8 },
            new_source:
              'import torch\nbatch_size = 8\nx = torch.empty(batch_size, 1024, 1024, dtype=torch.uint8)\n'
          }
        ]
      }
    ],
    change: null,
    ...overrides
  };
}
