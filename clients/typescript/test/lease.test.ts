// A handler slower than its lease: stateseal runs with a 2 s lease, the tool
// takes at least 5 s. The boundary renews the reservation while the handler
// runs, so the exact retry replayed (on the other replica) past the first
// lease is answered `-32603 Request in progress; retry later`, never run;
// after the handler returned it is `-32602 requestState already used`. The
// handler runs exactly once. On sled, and on PostgreSQL when
// STATESEAL_TEST_DATABASE_URL is set. Then the documented limit: stateseal
// unreachable from the holder for longer than the lease. Then a Renew that
// hangs: abandoned within the lease, and the next one lands (issue 58,
// finding 5).
import assert from 'node:assert/strict';
import { type Server as HttpServer } from 'node:http';
import { createConnection, createServer as createNetServer, type Socket } from 'node:net';
import { test } from 'node:test';

import { serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary, StatesealError } from '../src/index.js';
import {
  addSlowTool,
  call,
  connect,
  cuttableRelay,
  front,
  port,
  recordingLogger,
  type Round,
  rpcError,
  settle,
  SlowTool,
  sleep,
  startStateseal,
  text,
  until,
  yes,
} from './helpers.js';

const LEASE_S = 2;
const HANDLER_MS = 5000;

/** Counts renewals, and records the leases asked for and granted. */
class CountingClient extends RequestStateClient {
  renewals = 0;
  readonly asked: Array<['open' | 'renew', number | undefined]> = [];
  readonly granted: number[] = [];
  override async open(req: Parameters<RequestStateClient['open']>[0]) {
    this.asked.push(['open', req.leaseSeconds]);
    const opened = await super.open(req);
    this.granted.push(opened.leaseSeconds);
    return opened;
  }
  override async renew(reservation: string, leaseSeconds = 0) {
    this.asked.push(['renew', leaseSeconds]);
    const lease = await super.renew(reservation, leaseSeconds);
    this.renewals++;
    this.granted.push(lease.leaseSeconds);
    return lease;
  }
}

async function slowerThanTheLease(ledger: string[]): Promise<void> {
  const ss = await startStateseal('--default-lease-s', String(LEASE_S), ...ledger);
  const slow = new SlowTool(HANDLER_MS);
  const logs = [recordingLogger(), recordingLogger()];
  const grpc: CountingClient[] = [];
  const replicas: HttpServer[] = [];
  const route: number[] = [];
  let lb: (HttpServer & { served: number[] }) | undefined;
  let client: Awaited<ReturnType<typeof connect>> | undefined;
  try {
    for (const logger of logs) {
      const c = new CountingClient(ss.addr);
      grpc.push(c);
      const boundary = new StatesealBoundary(c, { audience: 'transfer-service', logger });
      replicas.push(await serveHttp(() => addSlowTool(transferServer(boundary), slow), 0));
    }
    const [a, b] = replicas.map(port);
    lb = await front([a, b], route);
    client = await connect(`http://127.0.0.1:${port(lb)}/mcp`);
    const args = { amount: 9 };

    route.push(a, a);
    const r = await call(client, 'slow_transfer', args);
    assert.equal(r.resultType, 'input_required');
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const running = settle(call(client, 'slow_transfer', args, retry));
    await until(() => slow.started >= 1, 60_000, 'the handler to start');
    // The lease granted at the Open has ended by now: only renewals keep
    // another attempt from taking the token over.
    await sleep((LEASE_S + 1.5) * 1000);
    assert.equal(slow.finished, 0, 'the handler still runs');

    route.push(b);
    const during = await settle(call(client, 'slow_transfer', args, retry));
    assert.equal(slow.started, 1, 'the replay during the handler did not run it');
    assert.equal(during.ok, false, `the replay during the handler got a result: ${during.ok && `${during.value.resultType} ${text(during.value)}`}`);
    if (!during.ok) rpcError(-32603, 'Request in progress; retry later', 'in_progress')(during.error as never);
    assert.equal(slow.finished, 0, 'answered while the handler still ran');

    slow.release();
    const done = await running;
    assert.ok(done.ok, `the slow retry failed: ${!done.ok && String(done.error)}`);
    if (done.ok) assert.match(text(done.value), /slow 9 done/);

    route.push(b);
    const afterwards = await settle(call(client, 'slow_transfer', args, retry));
    assert.equal(afterwards.ok, false, 'the replay after the handler got a result');
    if (!afterwards.ok) rpcError(-32602, 'requestState already used', 'request_state_used')(afterwards.error as never);

    assert.equal(slow.started, 1, 'executed exactly once');
    assert.equal(slow.finished, 1);
    assert.deepEqual(lb.served.slice(-4), [a, a, b, b]);
    // The reservation held throughout, and was committed.
    assert.deepEqual([...logs[0].lines.error, ...logs[1].lines.error], []);
    assert.deepEqual(logs[0].lines.warn, [], 'no renewal failed');
    assert.ok(grpc[0].renewals >= 1, 'the holder renewed its lease');
  } finally {
    slow.release();
    await client?.close();
    lb?.close();
    for (const s of replicas) s.close();
    for (const c of grpc) c.close();
    ss.proc.kill('SIGTERM');
  }
}

test('a handler slower than the lease (sled): renewed, one execution, replays refused', async () => {
  await slowerThanTheLease([]);
});

test('a handler slower than the lease (PostgreSQL): renewed, one execution, replays refused', async (t) => {
  const url = process.env.STATESEAL_TEST_DATABASE_URL;
  if (!url) {
    console.log('SKIPPED: a handler slower than the lease on PostgreSQL (set STATESEAL_TEST_DATABASE_URL)');
    t.skip('SKIPPED: STATESEAL_TEST_DATABASE_URL is not set');
    return;
  }
  await slowerThanTheLease(['--ledger', 'postgres', '--database-url', url]);
});

test('the leaseSeconds option is asked for on Open and on every renewal', async () => {
  // The server's default lease is 30 s; the boundary asks for 1 s.
  const ss = await startStateseal();
  const slow = new SlowTool(2500);
  const grpc = new CountingClient(ss.addr);
  const logger = recordingLogger();
  const boundary = new StatesealBoundary(grpc, { audience: 'transfer-service', logger, leaseSeconds: 1 });
  const http = await serveHttp(() => addSlowTool(transferServer(boundary), slow), 0);
  const client = await connect(`http://127.0.0.1:${port(http)}/mcp`);
  try {
    const r = await call(client, 'slow_transfer', { amount: 3 });
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const running = call(client, 'slow_transfer', { amount: 3 }, retry);
    await until(() => slow.started >= 1, 60_000, 'the handler to start');
    await until(() => grpc.renewals >= 1, 60_000, 'a renewal');
    slow.release();
    assert.match(text(await running), /slow 3 done/);
    assert.ok(grpc.asked.length >= 2);
    assert.deepEqual(grpc.asked[0], ['open', 1]);
    for (const a of grpc.asked.slice(1)) assert.deepEqual(a, ['renew', 1]);
    assert.ok(grpc.granted.every((g) => g === 1), `granted ${JSON.stringify(grpc.granted)}`);
    assert.deepEqual(logger.lines.error, []);
    assert.equal(slow.started, 1);
  } finally {
    slow.release();
    await client.close();
    http.close();
    grpc.close();
    ss.proc.kill('SIGTERM');
  }
});

test('stateseal unreachable from the holder for longer than the lease: another attempt takes over; the holder logs it', async () => {
  const ss = await startStateseal('--default-lease-s', String(LEASE_S));
  const relay = await cuttableRelay(ss.addr);
  const slow = new SlowTool(0);
  const holderLog = recordingLogger();
  // The holder reaches stateseal through the relay; the other replica directly.
  const holderGrpc = new RequestStateClient(relay.addr, { timeoutMs: 2000 });
  const otherGrpc = new RequestStateClient(ss.addr);
  const replicas: HttpServer[] = [];
  const boundaries: StatesealBoundary[] = [];
  const route: number[] = [];
  let lb: (HttpServer & { served: number[] }) | undefined;
  let client: Awaited<ReturnType<typeof connect>> | undefined;
  try {
    for (const [c, logger] of [
      [holderGrpc, holderLog],
      [otherGrpc, recordingLogger()],
    ] as const) {
      const boundary = new StatesealBoundary(c, { audience: 'transfer-service', logger });
      boundaries.push(boundary);
      replicas.push(await serveHttp(() => addSlowTool(transferServer(boundary), slow), 0));
    }
    const [holder, other] = replicas.map(port);
    lb = await front([holder, other], route);
    client = await connect(`http://127.0.0.1:${port(lb)}/mcp`);
    const args = { amount: 13 };

    route.push(other, holder);
    const r = await call(client, 'slow_transfer', args);
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const running = settle(call(client, 'slow_transfer', args, retry));
    await until(() => slow.started >= 1, 60_000, 'the handler to start');
    relay.cut();
    // Renewals fail (and are retried) while the lease runs out.
    await until(() => holderLog.lines.warn.some((m) => /renew on tools\/call failed: \w+; retrying/.test(m)), 60_000, 'a failed renewal');
    await sleep((LEASE_S + 1.5) * 1000);

    // Past the lease: the replay on the other replica takes the token over
    // and runs the handler (a second execution: what reserve mode allows
    // when the holder cannot reach stateseal; atMostOnce targets never).
    route.push(other);
    const takeover = await call(client, 'slow_transfer', args, retry);
    assert.match(text(takeover), /slow 13 done/);
    assert.equal(slow.started, 2);

    relay.restore();
    await until(
      () => holderLog.lines.error.some((m) => m.includes('reservation lost while the handler ran; another attempt may run it')),
      60_000,
      'the holder to learn that its reservation was lost',
    );
    const failedBefore = holderLog.lines.warn.length;
    slow.release();
    const done = await running;
    assert.ok(done.ok, 'the holder\'s result stands');
    if (done.ok) assert.match(text(done.value), /slow 13 done/);
    // The holder's Commit runs beside its answer.
    await boundaries[0].drain();
    assert.ok(
      holderLog.lines.error.some((m) => /commit failed on tools\/call: LEASE_EXPIRED: the token was taken over by another attempt/.test(m)),
      holderLog.lines.error.join('\n'),
    );
    assert.equal(holderLog.lines.warn.length, failedBefore, 'renewals stopped once the reservation was lost');
    // Consumed (by the attempt that took it over).
    route.push(holder);
    await assert.rejects(call(client, 'slow_transfer', args, retry), rpcError(-32602, 'requestState already used', 'request_state_used'));
  } finally {
    slow.release();
    await client?.close();
    lb?.close();
    for (const s of replicas) s.close();
    holderGrpc.close();
    otherGrpc.close();
    relay.close();
    ss.proc.kill('SIGTERM');
  }
});

/** A TCP relay to `addr` whose connections can hang: `hang()` stops
 * forwarding, both ways, on every connection open now (their bytes wait),
 * while connections made later go through; `flow()` lets the held ones go
 * on. */
async function hangingRelay(addr: string) {
  const i = addr.lastIndexOf(':');
  const [host, p] = [addr.slice(0, i), Number(addr.slice(i + 1))];
  const pairs = new Set<[Socket, Socket]>();
  const held = new Set<[Socket, Socket]>();
  const server = createNetServer((down: Socket) => {
    const up = createConnection({ host, port: p });
    const pair: [Socket, Socket] = [down, up];
    pairs.add(pair);
    for (const s of pair) s.on('error', () => undefined);
    down.pipe(up);
    up.pipe(down);
    up.on('close', () => {
      down.destroy();
      pairs.delete(pair);
      held.delete(pair);
    });
    down.on('close', () => up.destroy());
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    addr: `127.0.0.1:${(server.address() as { port: number }).port}`,
    hang() {
      for (const pair of pairs) {
        const [down, up] = pair;
        down.unpipe(up);
        up.unpipe(down);
        down.pause();
        up.pause();
        held.add(pair);
      }
    },
    flow() {
      for (const [down, up] of held) {
        down.pipe(up);
        up.pipe(down);
      }
      held.clear();
    },
    close() {
      for (const [down, up] of pairs) {
        down.destroy();
        up.destroy();
      }
      server.close();
    },
  };
}

/** Records each renewal: when it was sent and ended (ms, monotonic), and
 * the reason it failed with. */
class RenewalLog extends RequestStateClient {
  readonly renewals: Array<{ sent: number; ended: number; failed?: string }> = [];
  override async renew(reservation: string, leaseSeconds = 0, timeoutMs?: number) {
    const sent = performance.now();
    try {
      const lease = await super.renew(reservation, leaseSeconds, timeoutMs);
      this.renewals.push({ sent, ended: performance.now() });
      return lease;
    } catch (e) {
      this.renewals.push({ sent, ended: performance.now(), failed: e instanceof StatesealError ? e.reason : String(e) });
      throw e;
    }
  }
  /** A renewal ran out its deadline, and one sent after it landed. */
  abandonedThenRenewed(): boolean {
    const hung = this.renewals.find((r) => r.failed === 'DEADLINE_EXCEEDED');
    return hung !== undefined && this.renewals.some((r) => r.failed === undefined && r.sent >= hung.ended);
  }
}

test('a Renew that hangs is abandoned within the lease and the next one lands: one execution, replays refused', async () => {
  // Issue 58, finding 5: a Renew's deadline is a third of the lease (not
  // the client's 5 s), and the next goes at once. The holder reaches
  // stateseal through a relay whose connection hangs as the handler starts
  // (3 s lease, a handler slower than it): every byte on it waits. For at
  // least 7 s (a hung Renew with the 5 s deadline, sent a third of a lease
  // after the last one landed, outlasts the lease) the user's replay goes
  // again and again to the other replica: each is answered "in progress",
  // because the Renew after the abandoned one, on a new connection, lands
  // in time. Then the handler returns, and the replay is refused as used.
  const leaseS = 3;
  const ss = await startStateseal('--default-lease-s', String(leaseS));
  const relay = await hangingRelay(ss.addr);
  const slow = new SlowTool(0);
  const holderLog = recordingLogger();
  const otherLog = recordingLogger();
  const holderGrpc = new RenewalLog(relay.addr);
  const otherGrpc = new RequestStateClient(ss.addr);
  const replicas: HttpServer[] = [];
  const boundaries: StatesealBoundary[] = [];
  const route: number[] = [];
  let lb: (HttpServer & { served: number[] }) | undefined;
  let client: Awaited<ReturnType<typeof connect>> | undefined;
  try {
    for (const [c, logger] of [
      [holderGrpc, holderLog],
      [otherGrpc, otherLog],
    ] as const) {
      const boundary = new StatesealBoundary(c, { audience: 'transfer-service', logger });
      boundaries.push(boundary);
      replicas.push(await serveHttp(() => addSlowTool(transferServer(boundary), slow), 0));
    }
    const [holder, other] = replicas.map(port);
    lb = await front([holder, other], route);
    client = await connect(`http://127.0.0.1:${port(lb)}/mcp`);
    const args = { amount: 15 };

    route.push(other, holder);
    const r = await call(client, 'slow_transfer', args);
    assert.equal(r.resultType, 'input_required');
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const running = settle(call(client, 'slow_transfer', args, retry));
    await until(() => slow.started >= 1, 60_000, 'the handler to start');
    relay.hang();
    const since = performance.now();
    let replays = 0;
    while (performance.now() - since < 7000 || !holderGrpc.abandonedThenRenewed()) {
      assert.ok(performance.now() - since < 90_000, `no renewal landed after a hung one: ${JSON.stringify(holderGrpc.renewals)}`);
      route.push(other);
      const replay: { ok: true; value: Round } | { ok: false; error: unknown } = await settle(call(client, 'slow_transfer', args, retry));
      assert.equal(slow.started, 1, 'a replay took the token over and ran the handler again');
      assert.equal(replay.ok, false, `a replay got a result: ${replay.ok && `${replay.value.resultType} ${text(replay.value)}`}`);
      if (!replay.ok) rpcError(-32603, 'Request in progress; retry later', 'in_progress')(replay.error as never);
      replays++;
      await sleep(250);
    }
    relay.flow();
    slow.release();
    const done = await running;
    assert.ok(done.ok, `the slow retry failed: ${!done.ok && String(done.error)}`);
    if (done.ok) assert.match(text(done.value), /slow 15 done/);
    assert.equal(await boundaries[0].drain(60_000), true, 'a Commit is still kept');
    route.push(other);
    await assert.rejects(call(client, 'slow_transfer', args, retry), rpcError(-32602, 'requestState already used', 'request_state_used'));

    assert.equal(slow.started, 1, 'executed exactly once');
    assert.ok(replays >= 2, `replays: ${replays}`);
    // A Renew was abandoned well within the lease, and a later one landed.
    const hung = holderGrpc.renewals.filter((x) => x.failed === 'DEADLINE_EXCEEDED').map((x) => x.ended - x.sent);
    assert.ok(hung.length > 0 && Math.max(...hung) < leaseS * 1000, JSON.stringify(holderGrpc.renewals));
    assert.ok(holderGrpc.abandonedThenRenewed(), JSON.stringify(holderGrpc.renewals));
    assert.ok(
      holderLog.lines.warn.some((m) => m === 'stateseal: renew on tools/call failed: DEADLINE_EXCEEDED; retrying'),
      holderLog.lines.warn.join('\n'),
    );
    assert.deepEqual([...holderLog.lines.error, ...otherLog.lines.error], []);
  } finally {
    slow.release();
    relay.flow();
    await client?.close();
    lb?.close();
    for (const s of replicas) s.close();
    holderGrpc.close();
    otherGrpc.close();
    relay.close();
    ss.proc.kill('SIGTERM');
  }
});

/** Records each Commit try: when it was sent and ended (ms, monotonic),
 * and the reason it failed with. */
class CommitLog extends RequestStateClient {
  readonly tries: Array<{ sent: number; ended: number; failed?: string }> = [];
  override async commit(reservation: string, timeoutMs?: number) {
    const sent = performance.now();
    try {
      await super.commit(reservation, timeoutMs);
      this.tries.push({ sent, ended: performance.now() });
    } catch (e) {
      this.tries.push({ sent, ended: performance.now(), failed: e instanceof StatesealError ? e.reason : String(e) });
      throw e;
    }
  }
}

test('a Commit try against a hung stateseal is abandoned within the lease and a later one lands: one execution, replay refused', async () => {
  // Review F4: each Commit try's deadline is a third of the lease (not the
  // client's 5 s), so the lease is renewed before the next try (no Renew
  // goes while a try is in flight). The boundary reaches stateseal through
  // a relay whose connection hangs as the handler returns (3 s lease, no
  // commit delay: the first try goes at once, on the hung connection). It
  // is abandoned well within the lease; a later try lands.
  const leaseS = 3;
  const ss = await startStateseal('--default-lease-s', String(leaseS));
  const relay = await hangingRelay(ss.addr);
  const slow = new SlowTool(0);
  const logger = recordingLogger();
  const grpc = new CommitLog(relay.addr);
  let replica: HttpServer | undefined;
  let client: Awaited<ReturnType<typeof connect>> | undefined;
  try {
    const boundary = new StatesealBoundary(grpc, { audience: 'transfer-service', logger, commitDelayMs: 0 });
    replica = await serveHttp(() => addSlowTool(transferServer(boundary), slow), 0);
    client = await connect(`http://127.0.0.1:${port(replica)}/mcp`);
    const args = { amount: 16 };
    const r = await call(client, 'slow_transfer', args);
    assert.equal(r.resultType, 'input_required');
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const running = settle(call(client, 'slow_transfer', args, retry));
    await until(() => slow.started >= 1, 60_000, 'the handler to start');
    relay.hang();
    slow.release();
    const done = await running;
    assert.ok(done.ok, `the slow retry failed: ${!done.ok && String(done.error)}`);
    await until(() => grpc.tries.some((t) => t.failed === 'DEADLINE_EXCEEDED'), 60_000, 'a Commit try to run out its deadline');
    relay.flow();
    assert.equal(await boundary.drain(60_000), true, 'a Commit is still kept');
    await assert.rejects(call(client, 'slow_transfer', args, retry), rpcError(-32602, 'requestState already used', 'request_state_used'));
    assert.equal(slow.started, 1, 'executed exactly once');
    const hung = grpc.tries.filter((t) => t.failed === 'DEADLINE_EXCEEDED').map((t) => t.ended - t.sent);
    assert.ok(Math.max(...hung) < leaseS * 1000, JSON.stringify(grpc.tries));
    assert.equal(grpc.tries.at(-1)?.failed, undefined, JSON.stringify(grpc.tries));
  } finally {
    slow.release();
    relay.flow();
    await client?.close();
    replica?.close();
    grpc.close();
    relay.close();
    ss.proc.kill('SIGTERM');
  }
});

test('a token sealed with the low-level defaults lets no answer through; an explicit empty manifest does', async () => {
  // Review note on issue 58: seal()'s default manifest asks nothing.
  const ss = await startStateseal();
  const c = new RequestStateClient(ss.addr);
  try {
    const binding = { subject: 'alice', method: 'tools/call' as const, paramsJson: '{"name":"t"}' };
    const forged = '{"confirm":{"action":"accept","content":{"ok":true}}}';
    const sealed = await c.seal({ binding, state: Buffer.from('s') });
    const opened = await c.open({ requestState: sealed.requestState, binding, inputResponsesJson: forged });
    assert.ok(!opened.inputResponsesJson.includes('confirm'), opened.inputResponsesJson);
    assert.deepEqual(opened.dropped, [{ key: 'confirm', reason: 'UNASKED' }]);
    const bare = await c.seal({ binding, state: Buffer.from('s'), inputRequestsJson: '' });
    const raw = await c.open({ requestState: bare.requestState, binding, inputResponsesJson: forged });
    assert.ok(raw.inputResponsesJson.includes('confirm'), raw.inputResponsesJson);
  } finally {
    c.close();
    ss.proc.kill('SIGTERM');
  }
});
