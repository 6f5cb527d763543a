import * as React from 'react';
import { renderToStaticMarkup } from 'react-dom/server';

import { DeviceList } from '../src/components/DeviceList';
import { GpuPanelView } from '../src/components/GpuPanelView';
import { RunCard } from '../src/components/RunCard';
import { DeviceState, parseDevices } from '../src/devices';
import { listRuns } from '../src/runs';
import { DEFAULT_SETTINGS, PanelSettings } from '../src/settings';
import { cardProps } from './cardProps';
import { oomRun } from './fixtures';

const GiB = 2 ** 30;

function devices(
  devs: unknown[],
  extra: Record<string, unknown> = {}
): DeviceState {
  return parseDevices({
    version: 1,
    time: 1718000000,
    available: true,
    error: null,
    driver: '550.54.15',
    devices: devs,
    ...extra
  });
}

const healthy = {
  nvml_index: 0,
  cuda_index: 0,
  uuid: 'GPU-0',
  name: 'NVIDIA H200',
  used: 3532587008,
  total: 150110011392,
  free: 146577424384,
  processes: [{ pid: 4242, name: '/usr/bin/python3', used: GiB }],
  error: null
};

const broken = {
  nvml_index: 1,
  cuda_index: null,
  uuid: 'GPU-1',
  name: 'NVIDIA H200',
  used: null,
  total: null,
  free: null,
  processes: [],
  error: 'memory: GPU is lost'
};

describe('DeviceList', () => {
  it('shows a card in error next to a healthy one', () => {
    const html = renderToStaticMarkup(
      <DeviceList state={devices([healthy, broken])} />
    );
    expect(html).toContain('GPU 0');
    expect(html).toContain('3.29 GiB used of 139.80 GiB');
    expect(html).toContain('4242');
    expect(html).toContain('/usr/bin/python3');
    expect(html).toContain('1.00 GiB');
    expect(html).toContain('oommagic-device-error');
    expect(html).toContain('memory: GPU is lost');
    expect((html.match(/<li class="oommagic-device/g) ?? []).length).toBe(2);
  });

  it('says plainly when NVML is not there', () => {
    const state = devices([], {
      available: false,
      error: 'NVML Shared Library Not Found',
      driver: null
    });
    const html = renderToStaticMarkup(<DeviceList state={state} />);
    expect(html).toContain(
      'No GPU information on this machine: NVML Shared Library Not Found'
    );
    expect(html).toContain('CPU mode');
  });

  it('says when the server route is not there', () => {
    const state: DeviceState = {
      kind: 'unreachable',
      message: 'The oommagic server extension is not enabled'
    };
    expect(renderToStaticMarkup(<DeviceList state={state} />)).toContain(
      'not enabled'
    );
  });

  it('names the CUDA ordinal when it differs from NVML order', () => {
    const html = renderToStaticMarkup(
      <DeviceList
        state={devices([{ ...healthy, nvml_index: 3, cuda_index: 0 }])}
      />
    );
    expect(html).toContain('GPU 3 (cuda:0)');
  });
});

describe('RunCard', () => {
  it('shows an OOM run with its headline, finding, sparkline and fix button', () => {
    const [entry] = listRuns([oomRun()], []);
    const html = renderToStaticMarkup(<RunCard {...cardProps(entry)} />);
    expect(html).toContain('[2]');
    expect(html).toContain('OOM');
    expect(html).toContain(
      'peak 64.00 MiB allocated, 64.00 MiB reserved of 64.00 MiB limit (100%)'
    );
    expect(html).toContain(
      'needed 256.00 MiB more than the 64.00 MiB limit had'
    );
    expect(html).toContain('Activations of the batch');
    expect(html).toContain('oommagic-sparkline');
    expect(html).toContain('oommagic-apply-batch');
    expect(html).toContain('Retry cell');
  });

  it('offers no fix for a cell that is not in the notebook', () => {
    const [entry] = listRuns([oomRun()], []);
    const html = renderToStaticMarkup(
      <RunCard {...cardProps(entry, { cellPresent: false })} />
    );
    expect(html).not.toContain('oommagic-apply');
    expect(html).not.toContain('Retry cell');
    // The kernel still has the run: it can run the cell with a fix.
    expect(html).toContain('Run with this fix');
  });
});

function render(settings: PanelSettings): string {
  return renderToStaticMarkup(
    <GpuPanelView
      devices={{ kind: 'loading' }}
      showDevices={settings.showDevices}
      showRuns={settings.showRuns}
      notebook={null}
      busy={false}
      onDismissNotices={() => undefined}
      onReveal={() => undefined}
      onRetry={() => undefined}
      onApply={() => undefined}
      onApplyEntry={() => undefined}
      onWriteFitted={() => undefined}
      onRunPlanEntry={() => undefined}
      onRemoveFix={() => undefined}
    />
  );
}

describe('the panel sections', () => {
  it('show the devices and the runs by default', () => {
    const html = render(DEFAULT_SETTINGS);
    expect(html).toContain('oommagic-devices-section');
    expect(html).toContain('oommagic-notebook-section');
  });

  it('leave out what the settings switch off, and say so when both are off', () => {
    const noRuns = render({ ...DEFAULT_SETTINGS, showRuns: false });
    expect(noRuns).toContain('oommagic-devices-section');
    expect(noRuns).not.toContain('oommagic-notebook-section');
    const none = render({
      ...DEFAULT_SETTINGS,
      showRuns: false,
      showDevices: false
    });
    expect(none).not.toContain('oommagic-devices-section');
    expect(none).toContain('switched off in Settings › GPU Memory');
  });
});
