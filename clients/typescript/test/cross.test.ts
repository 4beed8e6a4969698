// One boundary across languages: a Python replica (clients/python on the
// real Python SDK) and a TypeScript replica of the same MCP service behind
// one front and one stateseal (2 s leases). Round 1 on Python and round 2 on
// TypeScript, then the reverse; a replay is refused across languages; a slow
// handler on TypeScript holds its token against a replay on Python.
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { type Server as HttpServer } from 'node:http';
import { dirname, join } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary } from '../src/index.js';
import {
  addSlowTool,
  call,
  connect,
  freePort,
  front,
  listening,
  port,
  recordingLogger,
  rpcError,
  settle,
  SlowTool,
  sleep,
  startStateseal,
  text,
  until,
  yes,
} from './helpers.js';

const here = dirname(fileURLToPath(import.meta.url));
// A Python with clients/python and its test requirements installed (.ci/run
// sets it to the venv of the Python step).
const PYTHON = process.env.STATESEAL_PYTHON;

let stateseal: { proc: ChildProcess; addr: string };
let py: ChildProcess;
let pyPort: number;
let ts: HttpServer;
let grpc: RequestStateClient;
const route: number[] = [];
let lb: HttpServer & { served: number[] };
const LEASE_S = 2;
const slow = new SlowTool(5000);
const tsLog = recordingLogger();

before(async () => {
  assert.ok(PYTHON, 'STATESEAL_PYTHON must name a Python with clients/python installed');
  stateseal = await startStateseal('--default-lease-s', String(LEASE_S));
  pyPort = await freePort();
  py = spawn(PYTHON, [join(here, '..', '..', 'test', 'fixtures', 'py_replica.py'), stateseal.addr, String(pyPort)], {
    stdio: ['ignore', 'ignore', 'inherit'],
  });
  await listening(pyPort, 30_000);
  grpc = new RequestStateClient(stateseal.addr);
  ts = await serveHttp(
    () => addSlowTool(transferServer(new StatesealBoundary(grpc, { audience: 'transfer-service', logger: tsLog })), slow),
    0,
  );
  lb = await front([port(ts), pyPort], route);
});

after(() => {
  slow.release();
  lb?.close();
  ts?.close();
  grpc?.close();
  py?.kill('SIGTERM');
  stateseal?.proc.kill('SIGTERM');
});

const url = () => `http://127.0.0.1:${port(lb)}/mcp`;

test('round 1 on Python, round 2 on TypeScript, and a replay refused on Python', async () => {
  const client = await connect(url());
  route.push(pyPort, port(ts));
  const r = await call(client, 'transfer', { amount: 42 });
  assert.equal(r.resultType, 'input_required');
  const done = await call(client, 'transfer', { amount: 42 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.equal(text(done), JSON.stringify([{ type: 'text', text: 'transferred 42' }]), 'served by TypeScript');
  // The token was consumed on the TypeScript replica: Python refuses it.
  route.push(pyPort);
  await assert.rejects(
    call(client, 'transfer', { amount: 42 }, { inputResponses: yes(r), requestState: r.requestState }),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
  );
  assert.deepEqual(lb.served.slice(-3), [pyPort, port(ts), pyPort]);
  await client.close();
});

test('round 1 on TypeScript, round 2 on Python, and a replay refused on TypeScript', async () => {
  const client = await connect(url());
  route.push(port(ts), pyPort);
  const r = await call(client, 'transfer', { amount: 7 });
  assert.equal(r.resultType, 'input_required');
  const done = await call(client, 'transfer', { amount: 7 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /transferred 7 \(python\)/, 'served by Python');
  route.push(port(ts));
  await assert.rejects(
    call(client, 'transfer', { amount: 7 }, { inputResponses: yes(r), requestState: r.requestState }),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
  );
  // Changed arguments are refused across languages too.
  route.push(port(ts), pyPort);
  const r2 = await call(client, 'transfer', { amount: 8 });
  // (The Python SDK answers a refusal with JSON-RPC -32602.)
  await assert.rejects(
    call(client, 'transfer', { amount: 800 }, { inputResponses: yes(r2), requestState: r2.requestState }),
    (e: { code?: number; message?: string }) => e.code === -32602 && e.message === 'Invalid or expired requestState',
  );
  // ... and did not burn the token: the genuine retry completes on Python.
  route.push(pyPort);
  const genuine = await call(client, 'transfer', { amount: 8 }, { inputResponses: yes(r2), requestState: r2.requestState });
  assert.match(text(genuine), /transferred 8 \(python\)/);
  await client.close();
});

test('a slow handler on TypeScript holds its token: the replay on Python is in progress, then used; one execution', async () => {
  const client = await connect(url());
  const args = { amount: 5 };
  route.push(port(ts), port(ts));
  const r = await call(client, 'slow_transfer', args);
  assert.equal(r.resultType, 'input_required');
  const retry = { inputResponses: yes(r), requestState: r.requestState };
  const running = settle(call(client, 'slow_transfer', args, retry));
  await until(() => slow.started >= 1, 60_000, 'the TypeScript handler to start');
  // Past the lease granted at the Open: only the TypeScript replica's
  // renewals keep the Python replica from taking the token over.
  await sleep((LEASE_S + 1.5) * 1000);

  route.push(pyPort);
  const during = await settle(call(client, 'slow_transfer', args, retry));
  assert.equal(during.ok, false, `the replay on Python got a result: ${during.ok && `${during.value.resultType} ${text(during.value)}`}`);
  if (!during.ok) rpcError(-32603, 'Request in progress; retry later', 'in_progress')(during.error as never);
  assert.equal(slow.finished, 0, 'answered while the TypeScript handler still ran');

  slow.release();
  const done = await running;
  assert.ok(done.ok, `the slow retry failed: ${!done.ok && String(done.error)}`);
  if (done.ok) assert.equal(text(done.value), JSON.stringify([{ type: 'text', text: 'slow 5 done' }]), 'served by TypeScript');

  route.push(pyPort);
  await assert.rejects(call(client, 'slow_transfer', args, retry), rpcError(-32602, 'requestState already used', 'request_state_used'));
  assert.equal(slow.started, 1, 'executed exactly once');
  assert.deepEqual(lb.served.slice(-4), [port(ts), port(ts), pyPort, pyPort]);
  assert.deepEqual(tsLog.lines.error, [], 'the reservation held and was committed');
  await client.close();
});
