// Three languages, one boundary: a Python replica (clients/python on the
// real Python SDK), a TypeScript replica and a Rust replica (clients/rust on
// rmcp) of the same MCP service behind one front and one stateseal. Round 1
// on one language and round 2 on another, in every pair; a replay refused in
// every language; changed arguments refused without burning the token; and
// 2^53+1 against 2^53 where the SDK's JSON parser keeps them apart.
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { type Server as HttpServer } from 'node:http';
import { dirname, join } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary } from '../src/index.js';
import { call, connect, freePort, front, listening, port, type Round, rpcError, startStateseal, text, yes } from './helpers.js';

const here = dirname(fileURLToPath(import.meta.url));
// A Python with clients/python installed, and the Rust replica
// (clients/rust's examples/transfer_server, built by `cargo test` there):
// .ci/run sets both.
const PYTHON = process.env.STATESEAL_PYTHON;
const RUST = process.env.STATESEAL_RUST_REPLICA;

let stateseal: { proc: ChildProcess; addr: string };
const procs: ChildProcess[] = [];
let ts: HttpServer;
let grpc: RequestStateClient;
const route: number[] = [];
let lb: HttpServer & { served: number[] };
const ports: Record<Lang, number> = { python: 0, typescript: 0, rust: 0 };
type Lang = 'python' | 'typescript' | 'rust';
const LANGS: Lang[] = ['python', 'typescript', 'rust'];
/** Request bodies to rewrite on their way through the front (one per call). */
const rewrites: Array<[string, string] | null> = [];

before(async () => {
  assert.ok(PYTHON, 'STATESEAL_PYTHON must name a Python with clients/python installed');
  assert.ok(RUST, "STATESEAL_RUST_REPLICA must name clients/rust's built examples/transfer_server");
  stateseal = await startStateseal();
  ports.python = await freePort();
  procs.push(
    spawn(PYTHON, [join(here, '..', '..', 'test', 'fixtures', 'py_replica.py'), stateseal.addr, String(ports.python)], {
      stdio: ['ignore', 'ignore', 'inherit'],
    }),
  );
  ports.rust = await freePort();
  procs.push(spawn(RUST, [stateseal.addr, String(ports.rust)], { stdio: ['ignore', 'ignore', 'inherit'] }));
  grpc = new RequestStateClient(stateseal.addr);
  ts = await serveHttp(() => transferServer(new StatesealBoundary(grpc, { audience: 'transfer-service' })), 0);
  ports.typescript = port(ts);
  await listening(ports.python, 30_000);
  await listening(ports.rust, 30_000);
  lb = await front(LANGS.map((l) => ports[l]), route, rewrites);
});

after(() => {
  lb?.close();
  ts?.close();
  grpc?.close();
  for (const p of procs) p.kill('SIGTERM');
  stateseal?.proc.kill('SIGTERM');
});

const url = () => `http://127.0.0.1:${port(lb)}/mcp`;
const done = (lang: Lang, amount: string) =>
  ({ python: `transferred ${amount} (python)`, typescript: `transferred ${amount}`, rust: `transferred ${amount} (rust)` })[lang];
const on = (...langs: Lang[]) => route.push(...langs.map((l) => ports[l]));
const retryOf = (r: Round) => ({ inputResponses: yes(r), requestState: r.requestState });

test('round 1 on one language, round 2 on another, in every pair; the replay refused in every language', async () => {
  const client = await connect(url());
  let amount = 100;
  for (const first of LANGS) {
    for (const second of LANGS) {
      if (first === second) continue;
      amount += 1;
      on(first);
      const r = await call(client, 'transfer', { amount });
      assert.equal(r.resultType, 'input_required', `${first} asked`);
      on(second);
      const finished = await call(client, 'transfer', { amount }, retryOf(r));
      assert.equal(text(finished), JSON.stringify([{ type: 'text', text: done(second, String(amount)) }]), `${first} → ${second}`);
      for (const replay of LANGS) {
        on(replay);
        await assert.rejects(
          call(client, 'transfer', { amount }, retryOf(r)),
          rpcError(-32602, 'requestState already used', 'request_state_used'),
          `replay on ${replay} of ${first} → ${second}`,
        );
      }
    }
  }
  await client.close();
});

test('changed arguments are refused in every language without burning the token', async () => {
  const client = await connect(url());
  let amount = 200;
  for (const first of LANGS) {
    for (const forger of LANGS) {
      amount += 1;
      on(first);
      const r = await call(client, 'transfer', { amount });
      on(forger);
      await assert.rejects(
        call(client, 'transfer', { amount: amount * 10 }, retryOf(r)),
        (e: { code?: number; message?: string }) => e.code === -32602 && e.message === 'Invalid or expired requestState',
        `${first} sealed, changed on ${forger}`,
      );
      // Not burnt: the genuine retry completes, on the next language.
      const genuine = LANGS[(LANGS.indexOf(forger) + 1) % LANGS.length];
      on(genuine);
      const ok = await call(client, 'transfer', { amount }, retryOf(r));
      assert.equal(text(ok), JSON.stringify([{ type: 'text', text: done(genuine, String(amount)) }]), `${first} → ${genuine}`);
    }
  }
  await client.close();
});

test('2^53+1 against 2^53: Python and Rust keep them apart; TypeScript cannot hold 2^53+1 and refuses its token', async () => {
  // JavaScript cannot write 2^53+1: the client sends 2^53 and the front
  // rewrites it where the test says so.
  const TWO53 = 2 ** 53;
  const big: [string, string] = [`"amount":${TWO53}`, '"amount":9007199254740993'];
  const client = await connect(url());
  for (const [first, second] of [['python', 'rust'], ['rust', 'python']] as const) {
    on(first);
    rewrites.push(big);
    const r = await call(client, 'transfer', { amount: TWO53 });
    assert.equal(r.resultType, 'input_required');
    // Round 2 with 2^53: another value, another digest.
    on(second);
    rewrites.push(null);
    await assert.rejects(
      call(client, 'transfer', { amount: TWO53 }, retryOf(r)),
      (e: { code?: number; message?: string }) => e.code === -32602 && e.message === 'Invalid or expired requestState',
      `${first} sealed 2^53+1, ${second} got 2^53`,
    );
    // Round 2 with 2^53+1: the same exact digest in both languages.
    on(second);
    rewrites.push(big);
    const ok = await call(client, 'transfer', { amount: TWO53 }, retryOf(r));
    assert.equal(text(ok), JSON.stringify([{ type: 'text', text: done(second, '9007199254740993') }]), `${first} → ${second}`);
  }
  // TypeScript's JSON.parse turns 2^53+1 into 2^53: a token sealed for
  // 2^53+1 elsewhere does not open there (it fails closed; it never opens
  // as 2^53).
  for (const first of ['python', 'rust'] as const) {
    on(first);
    rewrites.push(big);
    const r = await call(client, 'transfer', { amount: TWO53 });
    on('typescript');
    rewrites.push(big);
    await assert.rejects(
      call(client, 'transfer', { amount: TWO53 }, retryOf(r)),
      (e: { code?: number; message?: string }) => e.code === -32602 && e.message === 'Invalid or expired requestState',
      `${first} sealed 2^53+1, TypeScript saw 2^53`,
    );
  }
  assert.equal(rewrites.length, 0);
  await client.close();
});
