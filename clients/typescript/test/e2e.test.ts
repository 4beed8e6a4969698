// End to end with the real TypeScript SDK server and client over Streamable
// HTTP, the real stateseal binary, two replicas behind a round-robin front.
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { createServer, request as httpRequest, type Server as HttpServer } from 'node:http';
import { type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';

import { FAIL_ONCE, SEEN_ANSWERS, serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary } from '../src/index.js';

const here = dirname(fileURLToPath(import.meta.url));
const BIN = process.env.STATESEAL_BIN ?? join(here, '..', '..', '..', '..', 'target', 'debug', 'stateseal');

/** Starts a stateseal process on 127.0.0.1; resolves with it and its address. */
export function startStateseal(): Promise<{ proc: ChildProcess; addr: string }> {
  const dir = mkdtempSync(join(tmpdir(), 'stateseal-ts-'));
  const env = { ...process.env };
  delete env.STATESEAL_LOG;
  const proc = spawn(BIN, ['serve', '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'data')], {
    stdio: ['ignore', 'ignore', 'pipe'],
    env,
  });
  return new Promise((resolve, reject) => {
    let buf = '';
    const timer = setTimeout(() => reject(new Error('stateseal did not start')), 20_000);
    proc.stderr!.on('data', (d: Buffer) => {
      buf += d.toString();
      const m = /listening.*addr=(\S+)/.exec(buf);
      if (m) {
        clearTimeout(timer);
        buf = '';
        resolve({ proc, addr: m[1] });
      } else if (buf.length > 1 << 16) {
        buf = buf.slice(-4096);
      }
    });
    proc.on('exit', () => reject(new Error('stateseal exited')));
  });
}

/** A round-robin front: every tools/call goes to the next backend. */
export async function front(backends: number[]): Promise<HttpServer> {
  let next = 0;
  const served: number[] = [];
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      const body = Buffer.concat(chunks);
      let port = backends[0];
      try {
        if (JSON.parse(body.toString() || '{}').method === 'tools/call') {
          port = backends[next++ % backends.length];
          served.push(port);
        }
      } catch {
        // not JSON: first backend
      }
      const headers = { ...req.headers, host: `127.0.0.1:${port}` };
      delete headers['content-length'];
      const up = httpRequest(
        { host: '127.0.0.1', port, path: req.url, method: req.method, headers: { ...headers, 'content-length': body.length } },
        (r) => {
          res.writeHead(r.statusCode ?? 502, r.headers);
          r.pipe(res);
        },
      );
      up.on('error', () => res.writeHead(502).end());
      up.end(body);
    });
  });
  (server as HttpServer & { served: number[] }).served = served;
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return server;
}

export const port = (s: HttpServer) => (s.address() as AddressInfo).port;

let stateseal: { proc: ChildProcess; addr: string };
let replicas: HttpServer[] = [];
let lb: HttpServer & { served?: number[] };
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

async function connect(): Promise<Client> {
  const client = new Client(
    { name: 'e2e', version: '1.0.0' },
    { capabilities: { elicitation: { form: {} } }, versionNegotiation: { mode: { pin: '2026-07-28' } } } as never,
  );
  client.setRequestHandler('elicitation/create', async () => ({ action: 'accept', content: { confirm: true } }));
  await client.connect(new StreamableHTTPClientTransport(new URL(`http://127.0.0.1:${port(lb)}/mcp`)));
  return client;
}

type Round = { resultType: string; requestState?: string; inputRequests?: Record<string, unknown>; isError?: boolean; content?: Array<{ text?: string }> };

async function call(client: Client, name: string, args: Record<string, unknown>, extra: Record<string, unknown> = {}): Promise<Round> {
  return (await client.callTool({ name, arguments: args, ...extra } as never, { allowInputRequired: true } as never)) as unknown as Round;
}

const yes = (r: Round) =>
  Object.fromEntries(Object.keys(r.inputRequests ?? {}).map((k) => [k, { action: 'accept', content: { confirm: true } }]));
const text = (r: Round) => JSON.stringify(r.content ?? []);

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

test('a replay is asked again, never executed twice', async () => {
  const client = await connect();
  const r = await call(client, 'transfer', { amount: 7 });
  assert.equal(r.resultType, 'input_required');
  assert.ok(r.requestState && !r.requestState.includes('amount'), 'the token is sealed, not readable');
  const done = await call(client, 'transfer', { amount: 7 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /transferred 7/);
  const again = await call(client, 'transfer', { amount: 7 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.equal(again.resultType, 'input_required');
  assert.notEqual(again.requestState, r.requestState);
  await client.close();
});

test('changed arguments are refused and do not burn the token', async () => {
  const client = await connect();
  const r = await call(client, 'transfer', { amount: 42 });
  const forged = await call(client, 'transfer', { amount: 1000000 }, { inputResponses: yes(r), requestState: r.requestState });
  // The SDK turns a refusal inside a tool into an error result.
  assert.equal(forged.isError, true);
  assert.match(text(forged), /Invalid or expired requestState/);
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
  const again = await call(client, 'pay', { amount: 5 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.equal(again.resultType, 'input_required', 'consumed by the success');
  await client.close();
});

test('the manifest drops an unasked answer, and a wrongly typed one is asked again', async () => {
  const client = await connect();
  const r = await call(client, 'transfer', { amount: 3 });
  SEEN_ANSWERS.length = 0;
  const forged = { ...yes(r), admin_override: { action: 'accept', content: { admin: true } } };
  const done = await call(client, 'transfer', { amount: 3 }, { inputResponses: forged, requestState: r.requestState });
  assert.match(text(done), /transferred 3/);
  assert.deepEqual(SEEN_ANSWERS.at(-1), yes(r));
  // A wrongly typed answer is dropped: the handler asks again.
  const r2 = await call(client, 'transfer', { amount: 3 });
  const wrong = Object.fromEntries(Object.keys(r2.inputRequests ?? {}).map((k) => [k, { action: 'accept', content: { confirm: 'yes' } }]));
  const again = await call(client, 'transfer', { amount: 3 }, { inputResponses: wrong, requestState: r2.requestState });
  assert.equal(again.resultType, 'input_required');
  assert.deepEqual(SEEN_ANSWERS.at(-1), {});
  await client.close();
});
