// A returned handler's Commit is kept until it lands (issue 57). An outage
// of stateseal's audit sink (its file on a full disk, in closed mode, the
// default) or of its PostgreSQL ledger (a proxy that drops every connection
// and refuses new ones), starting as the handler returns and lasting 2 s or
// 5 s around a 3 s lease, leaves exactly one side effect, and the user's
// replay of the same retry — sent again and again, through the outage and
// after it — is refused with `requestState already used`, never run. Then
// the boundary's own parts of it, with Commits and Releases failing on
// demand: renewal goes on until the Commit lands and stops there, a failed
// handler's Release is kept the same way, the bound on what is kept, and the
// options' checks. The real stateseal binary, SDK server and client over
// Streamable HTTP.
import assert from 'node:assert/strict';
import { type ChildProcess, execFileSync, spawnSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test, type TestContext } from 'node:test';

import { acceptedContent, inputRequired, McpServer } from '@modelcontextprotocol/server';
import * as z from 'zod';

import { serveHttp } from '../examples/transfer-server.js';
import { install, RequestStateClient, StatesealBoundary, StatesealError, type BoundaryOptions } from '../src/index.js';
import { Status } from '../src/transport.js';
import { call, connect, cuttableRelay, port, recordingLogger, settle, sleep, startStateseal, text, until, yes } from './helpers.js';

const LEASE_S = 3;
/** How long the user goes on replaying before the test fails: a liveness
 * bound only, far above what the outages need. */
const REPLAY_FOR_MS = 90_000;

/** What a test cannot run without here: under STATESEAL_FAIL_ON_SKIP=1 (as
 * `.ci/run` sets) a failure, else a skip that prints SKIPPED. */
function cannotRun(t: TestContext, why: string): void {
  if (process.env.STATESEAL_FAIL_ON_SKIP === '1') assert.fail(`SKIPPED under STATESEAL_FAIL_ON_SKIP=1: ${t.name}: ${why}`);
  console.log(`SKIPPED: ${t.name}: ${why}`);
  t.skip(`SKIPPED: ${why}`);
}

/** Stops a stateseal and resolves once it has exited (SIGKILL after 10 s). */
async function stop(proc: ChildProcess): Promise<void> {
  if (proc.exitCode !== null || proc.signalCode !== null) return;
  const exited = new Promise<void>((resolve) => proc.once('exit', () => resolve()));
  proc.kill('SIGTERM');
  const kill = setTimeout(() => proc.kill('SIGKILL'), 10_000);
  await exited;
  clearTimeout(kill);
}

/** An outage of one thing stateseal depends on: `flags` start stateseal
 * with it, `begin` brings it down (resolving once stateseal is failing),
 * `end` brings it back, `close` cleans up (after stateseal has exited). */
interface Outage {
  flags: string[];
  begin(addr: string): Promise<void>;
  end(): void;
  close(): void;
}

/** The audit log on a 1 MiB tmpfs of its own; the outage is that tmpfs
 * filled (`dd`), until the filler file is removed. Undefined (the test
 * skipped) where no tmpfs can be mounted. */
function auditOnSmallDisk(t: TestContext): Outage | undefined {
  const dir = mkdtempSync(join(tmpdir(), 'stateseal-ts-audit-'));
  try {
    execFileSync('mount', ['-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', dir], { stdio: 'pipe' });
  } catch (e) {
    rmSync(dir, { recursive: true, force: true });
    cannotRun(t, `cannot mount a tmpfs for the audit log (root is needed): ${String((e as Error).message).split('\n')[0]}`);
    return undefined;
  }
  const fill = join(dir, 'fill');
  return {
    flags: ['--audit-log', join(dir, 'audit.log')],
    async begin(addr: string) {
      // Until the disk is full (dd ends with "No space left on device").
      const dd = spawnSync('dd', ['if=/dev/zero', `of=${fill}`, 'bs=4096'], { stdio: 'pipe' });
      assert.match(String(dd.stderr), /No space left on device/, `dd did not fill the disk: ${String(dd.stderr)}`);
      // The sink learns it at its next write: Seal until one is refused,
      // so that the outage is in force when the handler's Commit comes.
      const probe = new RequestStateClient(addr);
      try {
        for (let i = 0; ; i++) {
          try {
            await probe.seal({ binding: { subject: 'probe', method: 'tools/call', paramsJson: '{"name":"probe"}' }, state: Buffer.from('p') });
          } catch (e) {
            if (e instanceof StatesealError && e.reason === 'AUDIT_UNAVAILABLE') return;
            throw e;
          }
          assert.ok(i < 1000, 'the audit sink never failed on a full disk');
        }
      } finally {
        probe.close();
      }
    },
    end() {
      rmSync(fill, { force: true });
    },
    close() {
      spawnSync('umount', [dir], { stdio: 'ignore' });
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** The PostgreSQL ledger behind a TCP proxy; the outage is the proxy down:
 * its connections dropped, new ones closed as soon as accepted. Undefined
 * (the test skipped) without STATESEAL_TEST_DATABASE_URL. */
async function ledgerBehindProxy(t: TestContext): Promise<Outage | undefined> {
  const url = process.env.STATESEAL_TEST_DATABASE_URL;
  if (!url) {
    cannotRun(t, 'STATESEAL_TEST_DATABASE_URL is not set');
    return undefined;
  }
  const u = new URL(url);
  const relay = await cuttableRelay(`${u.hostname}:${u.port || '5432'}`);
  u.host = relay.addr;
  return {
    flags: ['--ledger', 'postgres', '--database-url', u.toString()],
    async begin() {
      relay.cut();
    },
    end() {
      relay.restore();
    },
    close() {
      relay.close();
    },
  };
}

const confirmSchema = z.object({ confirm: z.boolean() });

/** A service with one tool, `close_account`: its first round asks for
 * confirmation; its confirmed run is the side effect (counted in
 * `effects`), after which it calls `onEffect` — where the outage begins —
 * and returns. */
function accountService(boundary: StatesealBoundary, effects: { n: number }, onEffect: () => Promise<void>): McpServer {
  const server = new McpServer({ name: 'account-service', version: '1.0.0' });
  install(server, boundary);
  server.registerTool('close_account', { inputSchema: z.object({ account: z.string() }) }, async ({ account }, ctx) => {
    const state = ctx.mcpReq.requestState<string>();
    const confirmed = acceptedContent(ctx.mcpReq.inputResponses, 'confirm', confirmSchema);
    if (state === undefined || confirmed === undefined) {
      return inputRequired({
        inputRequests: { confirm: inputRequired.elicit({ message: `Close ${account}?`, requestedSchema: confirmSchema }) },
        requestState: JSON.stringify({ account }),
      });
    }
    effects.n++;
    await onEffect();
    return { content: [{ type: 'text' as const, text: `closed ${account}` }] };
  });
  return server;
}

/** The user's replays of `retry` every 250 ms until one is answered for
 * good: each must be a retryable -32603 (in progress, or stateseal
 * temporarily unavailable) until the last, `requestState already used`.
 * Resolves with when that answer came, and how many replays it took. */
async function replayUntilRefused(client: Awaited<ReturnType<typeof connect>>, args: Record<string, unknown>, retry: Record<string, unknown>, effects: { n: number }) {
  const end = performance.now() + REPLAY_FOR_MS;
  const seen: string[] = [];
  for (;;) {
    const a = await settle(call(client, 'close_account', args, retry));
    assert.ok(!a.ok, `a replay ran the handler again (side effects: ${effects.n}; answers before it: ${seen.join(', ')})`);
    const e = a.error as { code?: number; message?: string; data?: { reason?: string } };
    if (e.code === -32602 && e.data?.reason === 'request_state_used') return { at: performance.now(), replays: seen.length + 1, seen };
    const retryable = e.code === -32603 && (e.data?.reason === 'in_progress' || e.message === 'Temporarily unavailable; retry');
    assert.ok(retryable, `a replay got ${e.code} ${e.message} (${e.data?.reason})`);
    seen.push(e.data?.reason ?? 'unavailable');
    assert.ok(performance.now() < end, `no definite answer to the replay in ${REPLAY_FOR_MS} ms: ${seen.join(', ')}`);
    await sleep(250);
  }
}

/** Round 1, then the confirmed retry whose handler brings `outage` down as
 * it returns, for `outageMs`; then the user replays that retry until it is
 * refused. One side effect, and the boundary has nothing left to commit. */
async function outageAsTheHandlerReturns(outage: Outage, outageMs: number, kind: 'audit' | 'ledger'): Promise<void> {
  let ss: { proc: ChildProcess; addr: string } | undefined;
  let grpc: RequestStateClient | undefined;
  let http: Awaited<ReturnType<typeof serveHttp>> | undefined;
  let client: Awaited<ReturnType<typeof connect>> | undefined;
  let restore: NodeJS.Timeout | undefined;
  try {
    ss = await startStateseal('--default-lease-s', String(LEASE_S), ...outage.flags);
    const addr = ss.addr;
    grpc = new RequestStateClient(addr);
    const logger = recordingLogger();
    const boundary = new StatesealBoundary(grpc, { audience: 'account-service', logger });
    const effects = { n: 0 };
    let outageEnds = Infinity;
    const down = async () => {
      await outage.begin(addr);
      outageEnds = performance.now() + outageMs;
      restore = setTimeout(() => outage.end(), outageMs);
    };
    http = await serveHttp(() => accountService(boundary, effects, down), 0);
    client = await connect(`http://127.0.0.1:${port(http)}/mcp`);
    const args = { account: `A-${kind}-${outageMs}` };

    const r = await call(client, 'close_account', args);
    assert.equal(r.resultType, 'input_required');
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const started = performance.now();
    assert.match(text(await call(client, 'close_account', args, retry)), /closed A-/);
    assert.equal(effects.n, 1);

    const refused = await replayUntilRefused(client, args, retry, effects);
    console.log(
      `${kind} outage of ${outageMs} ms: replay refused ${Math.round(refused.at - started)} ms after the retry, ` +
        `${Math.round(refused.at - outageEnds)} ms after the outage, after ${refused.replays} replays (${[...new Set(refused.seen)].join(', ') || 'none retryable'})`,
    );
    assert.ok(refused.at >= outageEnds, 'refused before the outage ended');
    assert.equal(effects.n, 1, 'the handler ran exactly once');
    assert.equal(await boundary.drain(30_000), true, 'drain() found a Commit still kept');
    assert.equal(boundary.pendingCommits, 0);
    assert.equal(boundary.commitsNotKept, 0);
    // No lost lease, no failed Commit: nothing an operator must act on.
    assert.deepEqual(logger.lines.error, []);
    if (kind === 'ledger') {
      // The Commit met the outage, and was kept until it landed.
      assert.ok(logger.lines.warn.some((m) => /^stateseal: commit on tools\/call: \w+; kept, retrying for up to 60000 ms$/.test(m)), logger.lines.warn.join('\n'));
      assert.ok(logger.lines.info.some((m) => /^stateseal: commit on tools\/call landed after \d+ tries$/.test(m)), logger.lines.info.join('\n'));
    }
  } finally {
    clearTimeout(restore);
    outage.end();
    await client?.close();
    http?.close();
    grpc?.close();
    if (ss) await stop(ss.proc);
    outage.close();
  }
}

for (const ms of [2000, 5000]) {
  test(`the audit sink (closed) on a full disk for ${ms / 1000} s as the handler returns: one side effect, the replay refused`, async (t) => {
    const outage = auditOnSmallDisk(t);
    if (outage) await outageAsTheHandlerReturns(outage, ms, 'audit');
  });
}

for (const ms of [2000, 5000]) {
  test(`the PostgreSQL ledger unreachable for ${ms / 1000} s as the handler returns: one side effect, the replay refused`, async (t) => {
    const outage = await ledgerBehindProxy(t);
    if (outage) await outageAsTheHandlerReturns(outage, ms, 'ledger');
  });
}

/** A client whose Commits and Releases fail with UNAVAILABLE (as when
 * stateseal cannot be reached) while `failing` is set; it records the order
 * of its calls. */
class FailingClient extends RequestStateClient {
  failing = false;
  /** Renewals fail the same way while set. */
  renewFailing = false;
  /** The next Open waits for `until` before it is sent, `sent()` called as
   * it starts waiting (then cleared). */
  holdNextOpen: { sent: () => void; until: Promise<void> } | undefined;
  readonly calls: string[] = [];
  override async open(req: Parameters<RequestStateClient['open']>[0]) {
    const hold = this.holdNextOpen;
    if (hold) {
      this.holdNextOpen = undefined;
      hold.sent();
      await hold.until;
    }
    return super.open(req);
  }
  override async commit(reservation: string, timeoutMs?: number): Promise<void> {
    if (this.failing) {
      this.calls.push('commit failed');
      throw new StatesealError('UNAVAILABLE', Status.UNAVAILABLE, false);
    }
    await super.commit(reservation, timeoutMs);
    this.calls.push('commit');
  }
  override async release(reservation: string): Promise<void> {
    if (this.failing) {
      this.calls.push('release failed');
      throw new StatesealError('UNAVAILABLE', Status.UNAVAILABLE, false);
    }
    await super.release(reservation);
    this.calls.push('release');
  }
  override async renew(reservation: string, leaseSeconds = 0) {
    if (this.renewFailing) {
      this.calls.push('renew failed');
      throw new StatesealError('UNAVAILABLE', Status.UNAVAILABLE, false);
    }
    const lease = await super.renew(reservation, leaseSeconds);
    this.calls.push('renew');
    return lease;
  }
}

/** One stateseal, a boundary over a FailingClient, the account service. */
async function failing(options: Partial<BoundaryOptions>, flags: string[] = []) {
  const ss = await startStateseal(...flags);
  const grpc = new FailingClient(ss.addr);
  const logger = recordingLogger();
  // Each Commit on its own (none carried by an Open, which would bypass
  // the failing client).
  const boundary = new StatesealBoundary(grpc, { audience: 'account-service', logger, commitDelayMs: 0, ...options });
  const effects = { n: 0 };
  const hooks = { onEffect: async () => {} };
  const http = await serveHttp(() => accountService(boundary, effects, () => hooks.onEffect()), 0);
  const client = await connect(`http://127.0.0.1:${port(http)}/mcp`);
  return {
    grpc,
    logger,
    boundary,
    effects,
    hooks,
    client,
    async close() {
      await client.close();
      http.close();
      grpc.close();
      await stop(ss.proc);
    },
  };
}

test('the lease is renewed until the kept Commit lands, and never after it', async () => {
  // A 2 s lease (renewed every 0.67 s) and Commits failing for 3.5 s after
  // the handler returned.
  const s = await failing({ leaseSeconds: 2 });
  try {
    const args = { account: 'R-1' };
    const r = await call(s.client, 'close_account', args);
    s.hooks.onEffect = async () => {
      s.grpc.failing = true;
    };
    assert.match(text(await call(s.client, 'close_account', args, { inputResponses: yes(r), requestState: r.requestState })), /closed R-1/);
    await sleep(3500);
    s.grpc.failing = false;
    assert.equal(await s.boundary.drain(30_000), true);
    const calls = s.grpc.calls;
    const firstFailure = calls.indexOf('commit failed');
    assert.ok(firstFailure >= 0, calls.join(' '));
    assert.ok(calls.slice(firstFailure).filter((c) => c === 'renew').length >= 3, `renewals while the Commit was kept: ${calls.join(' ')}`);
    assert.equal(calls.at(-1), 'commit', `a call after the Commit landed: ${calls.join(' ')}`);
    assert.equal(calls.filter((c) => c === 'commit').length, 1);
    // Wait past a renewal period: still nothing after the Commit.
    await sleep(1500);
    assert.equal(calls.at(-1), 'commit', `a call after the Commit landed: ${calls.join(' ')}`);
    assert.deepEqual(s.logger.lines.error, []);
    assert.ok(s.logger.lines.warn.includes('stateseal: commit on tools/call: UNAVAILABLE; kept, retrying for up to 60000 ms'), s.logger.lines.warn.join('\n'));
    await assert.rejects(
      call(s.client, 'close_account', args, { inputResponses: yes(r), requestState: r.requestState }),
      (e: { data?: { reason?: string } }) => e.data?.reason === 'request_state_used',
    );
    assert.equal(s.effects.n, 1);
  } finally {
    await s.close();
  }
});

/** The first run's hook (once): Commits and renewals fail from then on, and a
 * second call of `retry` is sent, its Open held on its way; the run goes on
 * (to `end`, if given) once that Open waits. `letGo()` sends the Open and
 * resolves with the second call's outcome. */
function holdASecondCall(s: Awaited<ReturnType<typeof failing>>, args: Record<string, unknown>, retry: Record<string, unknown>, end?: () => void) {
  let release!: () => void;
  const until = new Promise<void>((resolve) => (release = resolve));
  let second: ReturnType<typeof settle<Awaited<ReturnType<typeof call>>>> | undefined;
  s.hooks.onEffect = async () => {
    s.hooks.onEffect = async () => {};
    s.grpc.failing = true;
    s.grpc.renewFailing = true;
    await new Promise<void>((sent) => {
      s.grpc.holdNextOpen = { sent, until };
      second = settle(call(s.client, 'close_account', args, retry));
    });
    end?.();
  };
  return {
    letGo() {
      release();
      assert.ok(second, 'the first run never sent the second call');
      return second;
    },
  };
}

test("an Open on its way as this process's handler answers, decided once its lease ran out, never runs it again", async () => {
  // The nemesis's finding (seed 16257906604647455624): that Open took the
  // token over and ran the handler again while the first run's Commit was
  // still kept. A 2 s lease; Commits and renewals fail from the handler's
  // run on; the second call's Open is held on its way from before the
  // handler answers until past the lease. It gets the token: the handler
  // does not run again, and the call is answered in progress. Once the
  // outage ends, the replay is refused as already used.
  const s = await failing({ leaseSeconds: 2 });
  try {
    const args = { account: 'R-7' };
    const r = await call(s.client, 'close_account', args);
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const held = holdASecondCall(s, args, retry);
    assert.match(text(await call(s.client, 'close_account', args, retry)), /closed R-7/);
    // Past the 2 s lease, which no renewal extended.
    await sleep(3000);
    const a = await held.letGo();
    assert.ok(!a.ok, `the handler ran again (side effects: ${s.effects.n})`);
    const e = a.error as { code?: number; data?: { reason?: string } };
    assert.deepEqual([e.code, e.data?.reason], [-32603, 'in_progress']);
    assert.ok(s.logger.lines.warn.some((l) => l.includes('not run again')), s.logger.lines.warn.join('\n'));
    s.grpc.failing = false;
    s.grpc.renewFailing = false;
    await replayUntilRefused(s.client, args, retry, s.effects);
    assert.equal(await s.boundary.drain(30_000), true);
    assert.equal(s.effects.n, 1);
  } finally {
    await s.close();
  }
});

test("an Open on its way as this process's handler fails, granted while its Release is kept, runs it: the failure does not burn the retry", async () => {
  // Beside the test above: only a kept Commit stops an Open on its way.
  const s = await failing({ leaseSeconds: 2 });
  try {
    const args = { account: 'F-7' };
    const r = await call(s.client, 'close_account', args);
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const held = holdASecondCall(s, args, retry, () => {
      throw new Error('the backend failed');
    });
    assert.equal((await call(s.client, 'close_account', args, retry)).isError, true);
    assert.equal(s.boundary.pendingCommits, 1, 'the Release is kept');
    await sleep(3000);
    const a = await held.letGo();
    assert.ok(a.ok, `the retry was refused: ${!a.ok && JSON.stringify(a.error)}`);
    if (a.ok) assert.match(text(a.value), /closed F-7/);
    assert.equal(s.effects.n, 2, 'the failed run and the retry');
    s.grpc.failing = false;
    s.grpc.renewFailing = false;
    assert.equal(await s.boundary.drain(30_000), true);
  } finally {
    await s.close();
  }
});

test("a failed handler's Release is kept until it lands; the user's retry then runs it", async () => {
  const s = await failing({});
  try {
    const args = { account: 'F-1' };
    const r = await call(s.client, 'close_account', args);
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    s.hooks.onEffect = async () => {
      s.grpc.failing = true;
      throw new Error('the backend failed');
    };
    const failed = await call(s.client, 'close_account', args, retry);
    assert.equal(failed.isError, true);
    assert.equal(s.boundary.pendingCommits, 1, 'the Release is kept');
    // The user's retry, in this process: it waits for the kept Release (or
    // is answered as in progress, and sent again), then runs.
    s.hooks.onEffect = async () => {};
    const retried = (async () => {
      const end = performance.now() + REPLAY_FOR_MS;
      for (;;) {
        const a = await settle(call(s.client, 'close_account', args, retry));
        if (a.ok || (a.error as { data?: { reason?: string } }).data?.reason !== 'in_progress' || performance.now() > end) return a;
        await sleep(250);
      }
    })();
    await sleep(1000);
    assert.equal(s.effects.n, 1, 'the retry ran before the Release landed');
    s.grpc.failing = false;
    const done = await retried;
    assert.ok(done.ok, `the retry after the Release failed: ${!done.ok && JSON.stringify(done.error)}`);
    if (done.ok) assert.match(text(done.value), /closed F-1/);
    assert.equal(s.effects.n, 2, 'the failed run and the retry');
    assert.equal(await s.boundary.drain(30_000), true);
    assert.ok(s.logger.lines.warn.includes('stateseal: release on tools/call: UNAVAILABLE; kept, retrying beside the answer'), s.logger.lines.warn.join('\n'));
    assert.ok(s.logger.lines.info.some((m) => /^stateseal: release on tools\/call landed after \d+ tries$/.test(m)), s.logger.lines.info.join('\n'));
    assert.deepEqual(s.logger.lines.error, []);
  } finally {
    await s.close();
  }
});

test('Commits over maxPendingCommits are tried once, logged and counted', async () => {
  const s = await failing({ maxPendingCommits: 1 });
  try {
    s.hooks.onEffect = async () => {
      s.grpc.failing = true;
    };
    const rounds = [];
    for (const account of ['B-1', 'B-2']) {
      const r = await call(s.client, 'close_account', { account });
      rounds.push(r);
      assert.match(text(await call(s.client, 'close_account', { account }, { inputResponses: yes(r), requestState: r.requestState })), /closed B-/);
    }
    await until(() => s.boundary.commitsNotKept === 1, 30_000, 'the second Commit to find the bound full');
    assert.equal(s.boundary.pendingCommits, 1);
    await until(() => s.logger.lines.error.length >= 2, 30_000, 'the error lines');
    assert.deepEqual(s.logger.lines.error, [
      'stateseal: commit on tools/call not kept: 1 commits and releases already pending (maxPendingCommits); it is tried once, and the token may open again after its lease',
      'stateseal: commit failed on tools/call: UNAVAILABLE (not kept); the token may open again after its lease',
    ]);
    s.grpc.failing = false;
    assert.equal(await s.boundary.drain(30_000), true);
    assert.equal(s.boundary.pendingCommits, 0);
    // The kept one landed.
    await assert.rejects(
      call(s.client, 'close_account', { account: 'B-1' }, { inputResponses: yes(rounds[0]), requestState: rounds[0].requestState }),
      (e: { data?: { reason?: string } }) => e.data?.reason === 'request_state_used',
    );
  } finally {
    await s.close();
  }
});

test('commitWindowMs and maxPendingCommits are checked', () => {
  const c = new RequestStateClient('127.0.0.1:1');
  try {
    const make = (o: Partial<BoundaryOptions>) => () => new StatesealBoundary(c, { audience: 'x', ...o });
    assert.throws(make({ leaseSeconds: 61 }), /commitWindowMs \(60000\) must not be shorter than leaseSeconds \(61 s\)/);
    assert.throws(make({ leaseSeconds: 5, commitWindowMs: 4999 }), TypeError);
    make({ leaseSeconds: 5, commitWindowMs: 5000 })();
    make({ leaseSeconds: 120, commitWindowMs: 120_000 })();
    for (const commitWindowMs of [0, -1, Infinity, Number.NaN]) assert.throws(make({ commitWindowMs }), TypeError, String(commitWindowMs));
    for (const maxPendingCommits of [0, 1.5, -1, Infinity]) assert.throws(make({ maxPendingCommits }), TypeError, String(maxPendingCommits));
    assert.equal(new StatesealBoundary(c, { audience: 'x' }).pendingCommits, 0);
  } finally {
    c.close();
  }
});
