// Added latency of one MRTR round trip (input_required, then the retry that
// completes) through stateseal, against the SDK's own HMAC codec
// (createRequestStateCodec) and against no protection, measured in one run
// with the real SDK server and client over Streamable HTTP on 127.0.0.1.
//
//   npm run build && STATESEAL_BIN=../../target/release/stateseal \
//     node dist/bench/roundtrip.js [rounds-per-variant, default 400]
//
// Variants run interleaved in blocks of 20, so machine noise hits all alike.
import { randomBytes } from 'node:crypto';
import { type Server as HttpServer } from 'node:http';

import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';
import { acceptedContent, createRequestStateCodec, inputRequired, McpServer } from '@modelcontextprotocol/server';
import * as z from 'zod';

import { serveHttp } from '../examples/transfer-server.js';
import { install, RequestStateClient, StatesealBoundary } from '../src/index.js';
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

const n = Number(process.argv[2] ?? 400);
const stateseal = await startStateseal();
const grpc = new RequestStateClient(stateseal.addr);
const codec = createRequestStateCodec<{ amount: number }>({ key: randomBytes(32), ttlSeconds: 600 });
const quiet = { info() {}, warn() {}, error() {} };
const boundary = new StatesealBoundary(grpc, { audience: 'bench', logger: quiet });
const consume = new StatesealBoundary(grpc, { audience: 'bench', logger: quiet, atMostOnce: ['transfer'] });
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
const base = quantile(times[1], 0.5);
console.log(`round trips per variant: ${times[0].length} (2 MCP requests each), node ${process.version}`);
console.log('variant | p50 ms | p90 ms | p99 ms | p50 vs SDK codec');
for (let v = 0; v < variants.length; v++) {
  const p50 = quantile(times[v], 0.5);
  console.log(
    `${variants[v][0]} | ${p50.toFixed(2)} | ${quantile(times[v], 0.9).toFixed(2)} | ${quantile(times[v], 0.99).toFixed(2)} | ${(p50 - base >= 0 ? '+' : '') + (p50 - base).toFixed(2)} ms (×${(p50 / base).toFixed(2)})`,
  );
}
for (const c of clients) await c.close();
for (const [, h] of variants) h.close();
grpc.close();
stateseal.proc.kill('SIGTERM');
