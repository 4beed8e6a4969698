// Added latency of one MRTR round trip (input_required, then the retry that
// completes) through stateseal, against the SDK's own HMAC codec
// (createRequestStateCodec) and against no protection, measured in one run
// with the real SDK server and client over Streamable HTTP on 127.0.0.1.
//
//   npm run build && STATESEAL_BIN=../../target/release/stateseal \
//     node dist/bench/roundtrip.js [rounds-per-variant, default 400]
//
// Variants run interleaved in blocks of 20, so machine noise hits all alike.
//
// It then prints where the reserve+commit variant's time goes, per round
// trip (mean over the measured round trips, in ms):
// - the boundary's time on the response path (around the handler, whose
//   own time is not counted), and within it each RPC as awaited (Seal and
//   Open RESERVE; how many Commits the next Open carried, and how many
//   went on their own, are listed apart);
// - binding v2 and the subject, and the manifest's JSON (the questions
//   when sealing, the answers sent and the filtered answers parsed back),
//   each timed over 10,000 runs on the bench's own params in the same run,
//   times the runs per round trip;
// - the server's handling of each RPC (the mean of its
//   stateseal_request_duration_seconds histogram, scraped before and
//   after) and its durable rounds (stateseal_ledger_consume_duration_seconds);
// - the gRPC client and loopback: the RPCs as awaited minus the server's
//   handling of them;
// and, last, the same three calls (Seal, Open RESERVE, Commit) one after
// another on an otherwise idle event loop: what the two calls on the
// response path cost by themselves, against what they cost beside the MCP
// client and server on one loop; then Seal and Open RESERVE 2 ms apart,
// beside a no-op RPC spaced the same (the floor of any call from here).
import { randomBytes } from 'node:crypto';
import { createServer as createNetServer } from 'node:net';
import { type Server as HttpServer } from 'node:http';

import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';
import { acceptedContent, createRequestStateCodec, inputRequired, McpServer } from '@modelcontextprotocol/server';
import * as z from 'zod';

import { serveHttp } from '../examples/transfer-server.js';
import { install, paramsDigestOf, RequestStateClient, StatesealBoundary, subjectFor } from '../src/index.js';
import { Channel } from '../src/transport.js';
import { port, startStateseal } from '../test/helpers.js';

const confirmSchema = z.object({ confirm: z.boolean() });
type Mint = (amount: number) => Promise<string>;

function server(mint: Mint, options: ConstructorParameters<typeof McpServer>[1] = {}, boundary?: StatesealBoundary) {
  const s = new McpServer({ name: 'bench', version: '1.0.0' }, options);
  if (boundary) install(s, boundary);
  s.registerTool('transfer', { inputSchema: z.object({ amount: z.number() }) }, async ({ amount }, ctx) => {
    const confirmed = acceptedContent(ctx.mcpReq.inputResponses, 'confirm', confirmSchema);
    if (ctx.mcpReq.requestState() === undefined || !confirmed) {
      return inputRequired({
        inputRequests: { confirm: inputRequired.elicit({ message: `Transfer ${amount}?`, requestedSchema: confirmSchema }) },
        requestState: await mint(amount),
      });
    }
    return { content: [{ type: 'text' as const, text: `transferred ${amount}` }] };
  });
  return s;
}

async function client(http: HttpServer): Promise<Client> {
  const c = new Client(
    { name: 'bench', version: '1.0.0' },
    { capabilities: { elicitation: { form: {} } }, versionNegotiation: { mode: { pin: '2026-07-28' } } } as never,
  );
  c.setRequestHandler('elicitation/create', async () => ({ action: 'accept', content: { confirm: true } }));
  await c.connect(new StreamableHTTPClientTransport(new URL(`http://127.0.0.1:${port(http)}/mcp`)));
  return c;
}

const quantile = (xs: number[], q: number) => {
  const s = [...xs].sort((a, b) => a - b);
  return s[Math.min(s.length - 1, Math.floor(q * s.length))];
};

/** Time spent per named step while `on`, in ms. */
class Steps {
  on = false;
  total = new Map<string, number>();
  add(name: string, ms: number) {
    if (this.on) this.total.set(name, (this.total.get(name) ?? 0) + ms);
  }
  get(name: string) {
    return this.total.get(name) ?? 0;
  }
}
const steps = new Steps();
const now = () => Number(process.hrtime.bigint()) / 1e6;

/** The boundary, its time on the response path measured around the
 * handler (whose own time is not the boundary's). */
class TimedBoundary extends StatesealBoundary {
  override wrapHandler<H extends (request: never, ctx: never) => unknown>(method: Parameters<StatesealBoundary['wrapHandler']>[0], handler: H): H {
    let inner = 0;
    const timedInner = (async (request: never, ctx: never) => {
      const t0 = now();
      try {
        return await (handler as unknown as (r: never, c: never) => unknown)(request, ctx);
      } finally {
        inner += now() - t0;
      }
    }) as unknown as H;
    const wrapped = super.wrapHandler(method, timedInner) as unknown as (r: never, c: never) => Promise<unknown>;
    return (async (request: never, ctx: never) => {
      inner = 0;
      const t0 = now();
      try {
        return await wrapped(request, ctx);
      } finally {
        steps.add('boundary', now() - t0 - inner);
      }
    }) as unknown as H;
  }
}

/** Each RPC of `client` timed as awaited. */
function instrument(client: RequestStateClient) {
  for (const rpc of ['seal', 'open', 'commit', 'renew'] as const) {
    const original = (client[rpc] as (...a: unknown[]) => Promise<unknown>).bind(client);
    (client as unknown as Record<string, unknown>)[rpc] = async (...a: unknown[]) => {
      if (rpc === 'open') steps.add('carried commits', (a[0] as { commit?: string[] }).commit?.length ?? 0);
      const t0 = now();
      try {
        return await original(...a);
      } finally {
        steps.add(`rpc ${rpc}`, now() - t0);
      }
    };
  }
}

/** Mean ms of `f` over 10,000 runs. */
function mean(f: () => unknown): number {
  for (let i = 0; i < 1000; i++) f();
  const t0 = now();
  for (let i = 0; i < 10_000; i++) f();
  return (now() - t0) / 10_000;
}

async function freePort(): Promise<number> {
  const s = createNetServer();
  await new Promise<void>((resolve) => s.listen(0, '127.0.0.1', resolve));
  const p = (s.address() as { port: number }).port;
  await new Promise((resolve) => s.close(resolve));
  return p;
}

/** The server's request and ledger histograms: sum and count by name. */
async function scrape(addr: string): Promise<Map<string, number>> {
  const text = await (await fetch(`http://${addr}/metrics`)).text();
  const out = new Map<string, number>();
  for (const line of text.split('\n')) {
    if (/^stateseal_(request|ledger_consume)_duration_seconds_(sum|count)/.test(line)) {
      const at = line.lastIndexOf(' ');
      out.set(line.slice(0, at), Number(line.slice(at + 1)));
    }
  }
  return out;
}

/** Waits until the server has handled every RPC sent so far (a Commit
 * beside an answer may still be running). */
async function settle(addr: string) {
  let last = -1;
  for (let i = 0; i < 50; i++) {
    let count = 0;
    for (const [k, v] of await scrape(addr)) if (k.startsWith('stateseal_request_duration_seconds_count')) count += v;
    if (count === last) return;
    last = count;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

const n = Number(process.argv[2] ?? 400);
const metrics = `127.0.0.1:${await freePort()}`;
const stateseal = await startStateseal('--metrics-listen', metrics);
const grpc = new RequestStateClient(stateseal.addr);
instrument(grpc);
const codec = createRequestStateCodec<{ amount: number }>({ key: randomBytes(32), ttlSeconds: 600 });
const quiet = { info() {}, warn() {}, error() {} };
const boundary = new TimedBoundary(grpc, { audience: 'bench', logger: quiet });
// Its calls are not in the breakdown: a stateseal and a client of its own.
const other = await startStateseal();
const otherGrpc = new RequestStateClient(other.addr);
const consume = new StatesealBoundary(otherGrpc, { audience: 'bench', logger: quiet, atMostOnce: ['transfer'] });
const variants: Array<[string, HttpServer]> = [
  ['none (plain JSON state)', await serveHttp(() => server(async (a) => JSON.stringify({ amount: a })), 0)],
  ['SDK HMAC codec', await serveHttp(() => server((a) => codec.mint({ amount: a }), { requestState: { verify: codec.verify } }), 0)],
  ['stateseal (reserve+commit, manifest)', await serveHttp(() => server(async (a) => JSON.stringify({ amount: a }), {}, boundary), 0)],
  ['stateseal (consume, manifest)', await serveHttp(() => server(async (a) => JSON.stringify({ amount: a }), {}, consume), 0)],
];
const clients = await Promise.all(variants.map(([, h]) => client(h)));
const times: number[][] = variants.map(() => []);
// Warm up every path.
for (const c of clients) for (let i = 0; i < 20; i++) await c.callTool({ name: 'transfer', arguments: { amount: i } });
await boundary.drain();
await settle(metrics);
const before = await scrape(metrics);
steps.on = true;
for (let done = 0; done < n; done += 20) {
  for (let v = 0; v < variants.length; v++) {
    for (let i = 0; i < 20; i++) {
      const t0 = process.hrtime.bigint();
      const r = (await clients[v].callTool({ name: 'transfer', arguments: { amount: done + i } })) as { content?: Array<{ text?: string }> };
      times[v].push(Number(process.hrtime.bigint() - t0) / 1e6);
      if (!r.content?.[0]?.text?.startsWith('transferred')) throw new Error(`${variants[v][0]}: round trip failed`);
    }
  }
}
await boundary.drain();
await settle(metrics);
steps.on = false;
const after = await scrape(metrics);
const base = quantile(times[1], 0.5);
console.log(`round trips per variant: ${times[0].length} (2 MCP requests each), node ${process.version}`);
console.log('variant | p50 ms | p90 ms | p99 ms | p50 vs SDK codec');
for (let v = 0; v < variants.length; v++) {
  const p50 = quantile(times[v], 0.5);
  console.log(
    `${variants[v][0]} | ${p50.toFixed(2)} | ${quantile(times[v], 0.9).toFixed(2)} | ${quantile(times[v], 0.99).toFixed(2)} | ${(p50 - base >= 0 ? '+' : '') + (p50 - base).toFixed(2)} ms (×${(p50 / base).toFixed(2)})`,
  );
}
const rounds = times[2].length;
const per = (ms: number) => (ms / rounds).toFixed(3);
const handling = (rpc: string): [number, number] => {
  const d = (k: string) => (after.get(k) ?? 0) - (before.get(k) ?? 0);
  return [d(`stateseal_request_duration_seconds_sum{rpc="${rpc}"}`) * 1000, d(`stateseal_request_duration_seconds_count{rpc="${rpc}"}`)];
};
let durable = 0;
for (const [k, v] of after) if (k.startsWith('stateseal_ledger_consume_duration_seconds_sum')) durable += (v - (before.get(k) ?? 0)) * 1000;
// What the boundary computes per round trip, on the bench's own params:
// binding v2 and the subject twice (the Seal, then the Open); the
// questions' JSON once, the answers' JSON sent and the filtered answers
// parsed back once.
const round1 = { name: 'transfer', arguments: { amount: 123 } };
const round2 = { ...round1, requestState: 'A'.repeat(200), inputResponses: { confirm: { action: 'accept', content: { confirm: true } } } };
const bindingMs = mean(() => [subjectFor('bench', null), paramsDigestOf('tools/call', round1)]) + mean(() => [subjectFor('bench', null), paramsDigestOf('tools/call', round2)]);
const questions = { confirm: inputRequired.elicit({ message: 'Transfer 123?', requestedSchema: confirmSchema }) };
const manifestMs = mean(() => [JSON.stringify(questions), JSON.stringify(round2.inputResponses), JSON.parse(JSON.stringify(round2.inputResponses))]);
const onPath = ['seal', 'open'];
const awaited = onPath.reduce((a, r) => a + steps.get(`rpc ${r}`), 0);
const handled = ['Seal', 'Open'].reduce((a, r) => a + handling(r)[0], 0);
console.log(`where the stateseal (reserve+commit) variant's time goes, ms per round trip (mean of ${rounds}):`);
console.log('step | ms');
console.log(`boundary on the response path, in all | ${per(steps.get('boundary'))}`);
console.log(`  its own work (not the steps below; binding and manifest are in it) | ${per(steps.get('boundary') - awaited)}`);
console.log(`  binding v2 and subject, computed twice (10,000 runs each) | ${bindingMs.toFixed(3)}`);
console.log(`  manifest: questions and answers JSON (10,000 runs) | ${manifestMs.toFixed(3)}`);
for (const [rpc, name] of [['seal', 'Seal'], ['open', 'Open']]) {
  const [ms, calls] = handling(name);
  console.log(`  ${name} as awaited (${(calls / rounds).toFixed(2)} per round trip) | ${per(steps.get(`rpc ${rpc}`))}`);
  console.log(`    the server's handling of it | ${per(ms)}`);
}
console.log(`  gRPC client and loopback (awaited minus handled) | ${per(awaited - handled)}`);
const carried = steps.get('carried commits');
console.log(`Commits carried by the next Open, per round trip | ${(carried / rounds).toFixed(2)}`);
for (const [rpc, name] of [['commit', 'Commit'], ['renew', 'Renew']]) {
  const [ms, calls] = handling(name);
  if (rpc === 'commit') {
    // The server counts a carried commit as a Commit (handled beside the
    // Open that carried it); the rest were sent alone.
    console.log(`Commits sent alone, per round trip | ${((calls - carried) / rounds).toFixed(2)}`);
    console.log(`  the server's handling of every commit, carried or not | ${per(ms)}`);
    console.log(`  a Commit sent alone, as awaited, per round trip | ${per(steps.get('rpc commit'))}`);
    continue;
  }
  if (calls === 0) continue;
  console.log(`off the response path: ${name} as awaited (${(calls / rounds).toFixed(2)} per round trip) | ${per(steps.get(`rpc ${rpc}`))}`);
  console.log(`  the server's handling of it | ${per(ms)}`);
}
console.log(`the server's durable rounds (Open RESERVE and Commit, within their handling) | ${per(durable)}`);
// The same calls from a fresh client on an otherwise idle event loop: what
// the two calls on the response path cost by themselves.
const idle = new RequestStateClient(stateseal.addr);
const idleMs: Record<string, number[]> = { Seal: [], 'Open RESERVE': [], Commit: [] };
const binding = { subject: 'bench', method: 'tools/call' as const, paramsDigest: Buffer.alloc(32) };
for (let i = 0; i < n + 20; i++) {
  const t0 = performance.now();
  const sealed = await idle.seal({ binding, state: Buffer.alloc(64, 0x78), singleUse: true });
  const t1 = performance.now();
  const opened = await idle.open({ requestState: sealed.requestState, binding, reserve: true });
  const t2 = performance.now();
  await idle.commit(opened.reservation);
  const t3 = performance.now();
  if (i < 20) continue; // a warm-up
  idleMs.Seal.push(t1 - t0);
  idleMs['Open RESERVE'].push(t2 - t1);
  idleMs.Commit.push(t3 - t2);
}
/** A table of calls: p50 and p99 of each, in ms. */
const reportCalls = (heading: string, calls: Record<string, number[]>) => {
  console.log(`${heading} (${n} each):`);
  console.log('call | p50 ms | p99 ms');
  for (const [name, t] of Object.entries(calls)) console.log(`${name} | ${quantile(t, 0.5).toFixed(3)} | ${quantile(t, 0.99).toFixed(3)}`);
};
reportCalls('the same calls on an idle event loop, one after another', idleMs);
console.log(`the response path's two calls at their idle p50 (Seal + Open RESERVE) | ${(quantile(idleMs.Seal, 0.5) + quantile(idleMs['Open RESERVE'], 0.5)).toFixed(3)}`);
// The same calls 2 ms apart, as on the response path (where the MCP work
// of the round trip separates them): each leaves an event loop that was
// waiting in the kernel for a server whose threads were parked. Beside
// them, a no-op RPC (grpc.health.v1 Health/Check, no ledger, no crypto)
// on the package's transport, spaced the same: what any call from this
// process costs on this machine, the floor under the two calls.
const noop = new Channel(stateseal.addr);
const spacedMs: Record<string, number[]> = { 'no-op (Health/Check)': [], Seal: [], 'Open RESERVE': [] };
const pause = () => new Promise((resolve) => setTimeout(resolve, 2));
for (let i = 0; i < n + 20; i++) {
  await pause();
  const t0 = performance.now();
  await noop.call('/grpc.health.v1.Health/Check', new Uint8Array(0), 5000);
  const t1 = performance.now();
  await pause();
  const t2 = performance.now();
  const sealed = await idle.seal({ binding, state: Buffer.alloc(64, 0x78), singleUse: true });
  const t3 = performance.now();
  await pause();
  const t4 = performance.now();
  const opened = await idle.open({ requestState: sealed.requestState, binding, reserve: true });
  const t5 = performance.now();
  await idle.commit(opened.reservation);
  if (i < 20) continue; // a warm-up
  spacedMs['no-op (Health/Check)'].push(t1 - t0);
  spacedMs.Seal.push(t3 - t2);
  spacedMs['Open RESERVE'].push(t5 - t4);
}
idle.close();
noop.close();
reportCalls('the same calls 2 ms apart, each from an idle event loop to an idle server', spacedMs);
const p50 = (name: string) => quantile(spacedMs[name], 0.5);
console.log(`the response path's two calls 2 ms apart, at p50 (Seal + Open RESERVE) | ${(p50('Seal') + p50('Open RESERVE')).toFixed(3)}`);
console.log(`two no-op calls 2 ms apart, at p50: the floor of any two calls | ${(2 * p50('no-op (Health/Check)')).toFixed(3)}`);
for (const c of clients) await c.close();
for (const [, h] of variants) h.close();
grpc.close();
otherGrpc.close();
stateseal.proc.kill('SIGTERM');
other.proc.kill('SIGTERM');
