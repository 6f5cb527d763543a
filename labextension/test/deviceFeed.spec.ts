/**
 * The device feed against a real HTTP server playing the `oommagic/devices` route (NVML is the
 * hardware edge: there is no GPU here), driven through Lumino's `Poll` API: its phases, its next
 * wait, its ticks.
 */
import { setPageHidden } from './pageVisibility';

import { createServer, IncomingMessage, Server, ServerResponse } from 'http';
import { AddressInfo } from 'net';

import { ServerConnection } from '@jupyterlab/services';

import { DeviceFeed, frequencyFor, MAX_INTERVAL_MS } from '../src/deviceFeed';

const DEVICES = {
  version: 1,
  time: 1718000000,
  available: true,
  error: null,
  driver: '550.54.15',
  devices: []
};

/** The route: answers `status` (200 with DEVICES, or an error) and counts the requests. */
class Route {
  status = 200;
  requests = 0;
  server: Server = createServer((req, res) => this._answer(req, res));

  async listen(): Promise<ServerConnection.ISettings> {
    await new Promise<void>(done => this.server.listen(0, '127.0.0.1', done));
    const { port } = this.server.address() as AddressInfo;
    return ServerConnection.makeSettings({
      baseUrl: `http://127.0.0.1:${port}/`,
      wsUrl: `ws://127.0.0.1:${port}/`,
      token: 'test-token',
      appendToken: false
    });
  }

  close(): Promise<void> {
    this.server.closeAllConnections();
    return new Promise(done => this.server.close(() => done()));
  }

  private _answer(req: IncomingMessage, res: ServerResponse): void {
    if (
      new URL(req.url ?? '', 'http://host').pathname !== '/oommagic/devices'
    ) {
      res.writeHead(500).end();
      return;
    }
    this.requests++;
    if (this.status === 200) {
      res.writeHead(200, { 'Content-Type': 'application/json' });
      res.end(JSON.stringify(DEVICES));
    } else {
      res.writeHead(this.status).end();
    }
  }
}

/** Wait (at most `ticks` ticks) for the poll to reach `phase`. */
async function reach(feed: DeviceFeed, phase: string, ticks = 20) {
  for (let i = 0; i < ticks && feed.poll.state.phase !== phase; i++) {
    await feed.poll.tick;
  }
  expect(feed.poll.state.phase).toBe(phase);
  return feed.poll.state;
}

describe('DeviceFeed', () => {
  let route: Route;
  let settings: ServerConnection.ISettings;
  let feed: DeviceFeed;

  beforeEach(async () => {
    route = new Route();
    settings = await route.listen();
  });

  afterEach(async () => {
    feed?.dispose();
    setPageHidden(false);
    jest.restoreAllMocks();
    await route.close();
  });

  it('asks nothing until started, then asks at once and at every interval', async () => {
    feed = new DeviceFeed(settings, 20);
    const states: string[] = [];
    feed.changed.connect((_, state) => states.push(state.kind));
    await new Promise(done => setTimeout(done, 60));
    expect(route.requests).toBe(0);
    expect(feed.state.kind).toBe('loading');

    feed.start();
    const resolved = await reach(feed, 'resolved');
    expect(resolved.interval).toBe(20);
    expect(feed.state).toMatchObject({
      kind: 'ok',
      report: { driver: '550.54.15' }
    });
    await feed.poll.tick;
    await feed.poll.tick;
    expect(feed.poll.state.phase).toBe('resolved');
    expect(route.requests).toBeGreaterThanOrEqual(2);
    expect(states.every(kind => kind === 'ok')).toBe(true);
  });

  it('backs off while the route fails and comes back to the interval when it answers', async () => {
    // The poll draws each wait at random up to the last wait times the backoff: take the longest.
    jest.spyOn(Math, 'random').mockReturnValue(0.9999);
    route.status = 404;
    feed = new DeviceFeed(settings, 20);
    feed.start();

    await reach(feed, 'rejected');
    expect(feed.state.kind === 'unreachable' && feed.state.message).toMatch(
      /server extension is not enabled/
    );
    const waits = [feed.poll.state.interval];
    while (waits[waits.length - 1] < 4 * 20 && waits.length < 12) {
      await feed.poll.tick;
      expect(feed.poll.state.phase).toBe('rejected');
      waits.push(feed.poll.state.interval);
    }
    // From the first wait of a full interval on, each is twice the last.
    const grown = waits.slice(waits.findIndex(w => w >= 20));
    expect(grown.length).toBeGreaterThanOrEqual(3);
    grown.slice(1).forEach((wait, i) => {
      expect(wait).toBeGreaterThanOrEqual(2 * grown[i]);
    });

    route.status = 200;
    const back = await reach(feed, 'reconnected');
    expect(back.interval).toBe(20);
    expect(feed.state.kind).toBe('ok');
  });

  it('never waits longer than the ceiling, whatever the interval', () => {
    expect(frequencyFor(1000)).toEqual({
      interval: 1000,
      backoff: 2,
      max: MAX_INTERVAL_MS
    });
    expect(frequencyFor(60_000).max).toBe(60_000);
  });

  it('stands by while the tab is hidden and asks again when it shows', async () => {
    feed = new DeviceFeed(settings, 20);
    feed.start();
    await reach(feed, 'resolved');

    setPageHidden(true);
    await reach(feed, 'standby');
    const asked = route.requests;
    await feed.poll.tick;
    await feed.poll.tick;
    expect(feed.poll.state.phase).toBe('standby');
    expect(route.requests).toBe(asked);

    setPageHidden(false);
    await reach(feed, 'resolved');
    expect(route.requests).toBe(asked + 1);
  });

  it('stops asking when stopped and applies a new interval to a running feed at once', async () => {
    feed = new DeviceFeed(settings, 10_000);
    feed.start();
    await reach(feed, 'resolved');
    expect(feed.poll.state.interval).toBe(10_000);

    feed.interval = 25;
    expect(feed.poll.frequency.interval).toBe(25);
    const refreshed = await reach(feed, 'refreshed');
    expect(refreshed.interval).toBe(0);
    expect((await reach(feed, 'resolved')).interval).toBe(25);

    feed.stop();
    expect(feed.isRunning).toBe(false);
    const asked = route.requests;
    await new Promise(done => setTimeout(done, 100));
    expect(route.requests).toBe(asked);

    // A stopped feed keeps the interval for its next start and asks nothing meanwhile.
    feed.interval = 30;
    await new Promise(done => setTimeout(done, 60));
    expect(route.requests).toBe(asked);
  });
});
