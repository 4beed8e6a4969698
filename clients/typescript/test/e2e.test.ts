// End to end with the real TypeScript SDK server and client over Streamable
// HTTP, the real stateseal binary, two replicas behind a round-robin front.
import assert from 'node:assert/strict';
import { type ChildProcess } from 'node:child_process';
import { type Server as HttpServer } from 'node:http';
import { after, before, test } from 'node:test';

import { Status as status } from '../src/transport.js';

import { FAIL_ONCE, SEEN_ANSWERS, serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary, StatesealError } from '../src/index.js';
import { call, connect as connectTo, front, port, type Round, rpcError, startStateseal, text, yes } from './helpers.js';


let stateseal: { proc: ChildProcess; addr: string };
let replicas: HttpServer[] = [];
let lb: HttpServer & { served: number[] };
let grpcClients: RequestStateClient[] = [];

before(async () => {
  stateseal = await startStateseal();
  for (let i = 0; i < 2; i++) {
    const c = new RequestStateClient(stateseal.addr);
    grpcClients.push(c);
    const boundary = new StatesealBoundary(c, { audience: 'transfer-service', logger: quiet });
    replicas.push(await serveHttp(() => transferServer(boundary), 0));
  }
  lb = await front(replicas.map(port));
});

after(async () => {
  for (const s of [...replicas, lb]) s.close();
  for (const c of grpcClients) c.close();
  stateseal.proc.kill('SIGTERM');
});

const quiet = { info() {}, warn() {}, error() {} };
const connect = () => connectTo(`http://127.0.0.1:${port(lb)}/mcp`);



test('the SDK retry loop completes across replicas', async () => {
  const client = await connect();
  const before = lb.served!.length;
  const r = (await client.callTool({ name: 'transfer', arguments: { amount: 42 } })) as unknown as Round;
  assert.match(text(r), /transferred 42/);
  const served = lb.served!.slice(before);
  assert.equal(served.length, 2);
  assert.notEqual(served[0], served[1], 'the retry went to the other replica');
  await client.close();
});

test('a replay is refused (requestState already used), never executed twice', async () => {
  const client = await connect();
  const r = await call(client, 'transfer', { amount: 7 });
  assert.equal(r.resultType, 'input_required');
  assert.ok(r.requestState && !r.requestState.includes('amount'), 'the token is sealed, not readable');
  const done = await call(client, 'transfer', { amount: 7 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /transferred 7/);
  // The other replica (round robin) refuses the exact retry.
  await assert.rejects(
    call(client, 'transfer', { amount: 7 }, { inputResponses: yes(r), requestState: r.requestState }),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
  );
  await client.close();
});

test('changed arguments are refused and do not burn the token', async () => {
  const client = await connect();
  const r = await call(client, 'transfer', { amount: 42 });
  await assert.rejects(
    call(client, 'transfer', { amount: 1000000 }, { inputResponses: yes(r), requestState: r.requestState }),
    (e: { code?: number; message?: string }) => e.code === -32602 && e.message === 'Invalid or expired requestState',
  );
  // A tampered token too.
  const tampered = r.requestState!.slice(0, -2) + (r.requestState!.at(-2) === 'A' ? 'B' : 'A') + r.requestState!.at(-1);
  await assert.rejects(
    call(client, 'transfer', { amount: 42 }, { inputResponses: yes(r), requestState: tampered }),
    (e: { code?: number }) => e.code === -32602,
  );
  const done = await call(client, 'transfer', { amount: 42 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /transferred 42/);
  await client.close();
});

test('a failed handler does not burn the retry', async () => {
  FAIL_ONCE.add('pay');
  const client = await connect();
  const r = await call(client, 'pay', { amount: 5 });
  const failed = await call(client, 'pay', { amount: 5 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.equal(failed.isError, true);
  const done = await call(client, 'pay', { amount: 5 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /paid 5/);
  await assert.rejects(
    call(client, 'pay', { amount: 5 }, { inputResponses: yes(r), requestState: r.requestState }),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
    'consumed by the success',
  );
  await client.close();
});

test('an at-most-once target spends the token even when its handler fails', async () => {
  // The operator's choice (DESIGN guarantee 11): a target in `atMostOnce` is
  // consumed before its handler runs, so a failed handler costs the user's
  // retry, where the default (reserve, above) gives it back. One replica of
  // its own, so that the choice is the only difference.
  const c = new RequestStateClient(stateseal.addr);
  const boundary = new StatesealBoundary(c, { audience: 'transfer-service', logger: quiet, atMostOnce: ['pay'] });
  const own = await serveHttp(() => transferServer(boundary), 0);
  try {
    FAIL_ONCE.add('pay');
    const client = await connectTo(`http://127.0.0.1:${port(own)}/mcp`);
    const r = await call(client, 'pay', { amount: 6 });
    const failed = await call(client, 'pay', { amount: 6 }, { inputResponses: yes(r), requestState: r.requestState });
    assert.equal(failed.isError, true);
    assert.equal(FAIL_ONCE.has('pay'), false, 'the handler ran (and failed)');
    await assert.rejects(
      call(client, 'pay', { amount: 6 }, { inputResponses: yes(r), requestState: r.requestState }),
      rpcError(-32602, 'requestState already used', 'request_state_used'),
      'consumed before the failed handler ran',
    );
    await client.close();
  } finally {
    FAIL_ONCE.delete('pay');
    own.close();
    c.close();
  }
});

test('the manifest drops an unasked answer, and a wrongly typed one is asked again', async () => {
  const client = await connect();
  const r = await call(client, 'transfer', { amount: 3 });
  SEEN_ANSWERS.length = 0;
  const forged = { ...yes(r), admin_override: { action: 'accept', content: { admin: true } } };
  const done = await call(client, 'transfer', { amount: 3 }, { inputResponses: forged, requestState: r.requestState });
  assert.match(text(done), /transferred 3/);
  assert.deepEqual(SEEN_ANSWERS.at(-1), yes(r));
  // A wrongly typed answer is dropped and the request runs afresh: a new
  // question, no answers reach the handler; the new question then works.
  const r2 = await call(client, 'transfer', { amount: 3 });
  const seen = SEEN_ANSWERS.length;
  const wrong = Object.fromEntries(Object.keys(r2.inputRequests ?? {}).map((k) => [k, { action: 'accept', content: { confirm: 'yes' } }]));
  const again = await call(client, 'transfer', { amount: 3 }, { inputResponses: wrong, requestState: r2.requestState });
  assert.equal(again.resultType, 'input_required');
  assert.notEqual(again.requestState, r2.requestState);
  assert.equal(SEEN_ANSWERS.length, seen);
  const ok = await call(client, 'transfer', { amount: 3 }, { inputResponses: yes(again), requestState: again.requestState });
  assert.match(text(ok), /transferred 3/);
  await client.close();
});

test('URL-mode answers reach the handler without content', async () => {
  const client = await connect();
  const r = await call(client, 'login', {});
  assert.equal(r.resultType, 'input_required');
  SEEN_ANSWERS.length = 0;
  const done = await call(client, 'login', {}, {
    inputResponses: { signin: { action: 'accept', content: { access_token: 'stolen-or-phished' } } },
    requestState: r.requestState,
  });
  assert.match(text(done), /signed in/);
  assert.deepEqual(SEEN_ANSWERS.at(-1), { signin: { action: 'accept' } });
  await client.close();
});

test('an Open carries commits and reports each', async () => {
  const c = grpcClients[0];
  const binding = { subject: 's', method: 'tools/call' as const, paramsJson: '{"name":"t"}' };
  const tokens = await Promise.all(
    [0, 1, 2].map(async () => (await c.seal({ binding, state: Buffer.from('s'), singleUse: true })).requestState),
  );
  const held = (await c.open({ requestState: tokens[0], binding, reserve: true })).reservation;
  const opened = await c.open({ requestState: tokens[1], binding, reserve: true, commit: [held, 'garbage'] });
  assert.ok(opened.reservation);
  assert.equal(opened.commits.length, 2);
  assert.equal(opened.commits[0], null);
  const bad = opened.commits[1];
  assert.ok(bad instanceof StatesealError);
  assert.deepEqual([bad.reason, bad.code, bad.fromStateseal, bad.clientFault], ['MALFORMED', status.INVALID_ARGUMENT, true, true]);
  await assert.rejects(c.open({ requestState: tokens[0], binding }), (e: unknown) => (e as StatesealError).reason === 'REPLAYED');
  assert.deepEqual((await c.open({ requestState: tokens[2], binding })).commits, []);
  await assert.rejects(c.open({ requestState: tokens[2], binding, commit: Array(17).fill('r') }), RangeError);
});

test('each Commit rides on the next durable Open of its replica, and drain() sends the one still waiting', async () => {
  const alone: string[] = [];
  const carried: string[] = [];
  class Counting extends RequestStateClient {
    override async commit(reservation: string, timeoutMs?: number): Promise<void> {
      alone.push(reservation);
      await super.commit(reservation, timeoutMs);
    }
    override async open(req: Parameters<RequestStateClient['open']>[0]) {
      carried.push(...(req.commit ?? []));
      return super.open(req);
    }
  }
  const grpc = new Counting(stateseal.addr);
  // The longest delay, and the next Open sent right after the answer: the
  // Commit waits for it.
  const boundary = new StatesealBoundary(grpc, { audience: 'transfer-service', logger: quiet, commitDelayMs: 250 });
  const server = await serveHttp(() => transferServer(boundary), 0);
  const c = await connectTo(`http://127.0.0.1:${port(server)}/mcp`);
  try {
    const rounds = [await call(c, 'transfer', { amount: 1 }), await call(c, 'transfer', { amount: 2 })];
    const retries = rounds.map((r) => ({ inputResponses: yes(r), requestState: r.requestState }));
    assert.match(text(await call(c, 'transfer', { amount: 1 }, retries[0])), /transferred 1/);
    assert.match(text(await call(c, 'transfer', { amount: 2 }, retries[1])), /transferred 2/);
    assert.equal(carried.length, 1, 'the first Commit rode on the second Open');
    assert.deepEqual(alone, []);
    assert.equal(await boundary.drain(5000), true);
    assert.equal(alone.length, 1, 'drain() sent the second on its own');
    assert.ok(!carried.includes(alone[0]));
    for (const [i, retry] of retries.entries()) {
      await assert.rejects(
        call(c, 'transfer', { amount: i + 1 }, retry),
        rpcError(-32602, 'requestState already used', 'request_state_used'),
      );
    }
  } finally {
    await c.close();
    server.close();
    grpc.close();
  }
});

test('the Commit runs beside the answer, and a replay on another replica of the process waits for it', async () => {
  // Every Commit is held until the test lets it go.
  const landed: string[] = [];
  let letGo: () => void = () => {};
  const gate = new Promise<void>((resolve) => {
    letGo = resolve;
  });
  class HeldCommit extends RequestStateClient {
    override async commit(reservation: string, timeoutMs?: number): Promise<void> {
      await gate;
      await super.commit(reservation, timeoutMs);
      landed.push(reservation);
    }
  }
  const grpc = new HeldCommit(stateseal.addr);
  const boundaries = [0, 1].map(() => new StatesealBoundary(grpc, { audience: 'transfer-service', logger: quiet }));
  const pair = await Promise.all(boundaries.map((b) => serveHttp(() => transferServer(b), 0)));
  const [a, b] = await Promise.all(pair.map((r) => connectTo(`http://127.0.0.1:${port(r)}/mcp`)));
  try {
    const r = await call(a, 'transfer', { amount: 9 });
    const retry = { inputResponses: yes(r), requestState: r.requestState };
    const done = await call(a, 'transfer', { amount: 9 }, retry);
    assert.match(text(done), /transferred 9/);
    assert.deepEqual(landed, [], 'the answer waited for the Commit');
    // On the other replica, while the Commit is held: it waits for it. The
    // Commit is let go after 1 s, longer than the 375 ms an Open would
    // otherwise retry IN_USE for.
    const replay = call(b, 'transfer', { amount: 9 }, retry).then(
      () => assert.fail('the replay ran'),
      (e: unknown) => e,
    );
    await new Promise((resolve) => setTimeout(resolve, 1000));
    letGo();
    rpcError(-32602, 'requestState already used', 'request_state_used')((await replay) as never);
    assert.equal(landed.length, 1);
    assert.equal(await boundaries[0].drain(5000), true);
  } finally {
    letGo();
    await a.close();
    await b.close();
    for (const r of pair) r.close();
    grpc.close();
  }
});
