// Shared by the end-to-end tests: the real stateseal binary, a round-robin
// front, and the real SDK client.
import assert from 'node:assert/strict';
import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import { createServer, request as httpRequest, type Server as HttpServer } from 'node:http';
import { type AddressInfo, createConnection, createServer as createNetServer, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';
import { acceptedContent, inputRequired, type McpServer } from '@modelcontextprotocol/server';
import * as z from 'zod';

const here = dirname(fileURLToPath(import.meta.url));
const BIN = process.env.STATESEAL_BIN ?? join(here, '..', '..', '..', '..', 'target', 'debug', 'stateseal');

/** Starts a stateseal process on 127.0.0.1; resolves with it and its address. */
export function startStateseal(...extra: string[]): Promise<{ proc: ChildProcess; addr: string }> {
  const dir = mkdtempSync(join(tmpdir(), 'stateseal-ts-'));
  const env = { ...process.env };
  delete env.STATESEAL_LOG;
  const proc = spawn(BIN, ['serve', '--listen', '127.0.0.1:0', '--data-dir', join(dir, 'data'), ...extra], {
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

/** A round-robin front: every tools/call goes to the next backend (or the
 * next port in `route`). `rewrites`, when given, holds one entry per
 * tools/call: null, or [from, to] to replace in that request's body on its
 * way (to send what the SDK client cannot write, such as 2^53+1). */
export async function front(
  backends: number[],
  route: number[] = [],
  rewrites?: Array<[string, string] | null>,
): Promise<HttpServer & { served: number[] }> {
  let next = 0;
  const served: number[] = [];
  const server = createServer((req, res) => {
    const chunks: Buffer[] = [];
    req.on('data', (c: Buffer) => chunks.push(c));
    req.on('end', () => {
      let body = Buffer.concat(chunks).toString();
      let port = backends[0];
      let toolsCall = false;
      try {
        toolsCall = JSON.parse(body || '{}').method === 'tools/call';
      } catch {
        // not JSON: first backend
      }
      if (toolsCall) {
        port = route.shift() ?? backends[next++ % backends.length];
        served.push(port);
        const rw = rewrites?.shift();
        if (rw) {
          assert.ok(body.includes(rw[0]), `nothing to rewrite in ${body}`);
          body = body.split(rw[0]).join(rw[1]);
        }
      }
      const headers = { ...req.headers, host: `127.0.0.1:${port}` };
      delete headers['content-length'];
      const up = httpRequest(
        { host: '127.0.0.1', port, path: req.url, method: req.method, headers: { ...headers, 'content-length': Buffer.byteLength(body) } },
        (r) => {
          res.writeHead(r.statusCode ?? 502, r.headers);
          r.pipe(res);
        },
      );
      up.on('error', () => res.writeHead(502).end());
      up.end(body);
    });
  });
  const out = Object.assign(server, { served });
  await new Promise<void>((resolve) => out.listen(0, '127.0.0.1', resolve));
  return out;
}

/** A port nothing listens on now, chosen below the kernel's ephemeral
 * range (`net.ipv4.ip_local_port_range`), where no `listen(0)` and no
 * outgoing connection of another test is given a port: so no port the
 * kernel hands out takes it before it is used, and no connection to it can
 * connect to itself. Where that range starts too low to leave room, any
 * free port. */
export async function freePort(): Promise<number> {
  let low = 0;
  try {
    low = Number.parseInt(readFileSync('/proc/sys/net/ipv4/ip_local_port_range', 'utf8').trim().split(/\s+/)[0], 10) || 0;
  } catch {
    low = 0;
  }
  const bound = async (port: number): Promise<number | undefined> => {
    const s = createServer();
    const ok = await new Promise<boolean>((resolve) => {
      s.once('error', () => resolve(false));
      s.listen(port, '127.0.0.1', () => resolve(true));
    });
    if (!ok) return undefined;
    const p = (s.address() as AddressInfo).port;
    await new Promise((r) => s.close(r));
    return p;
  };
  if (low > 11_024) {
    for (let i = 0; i < 100; i++) {
      const p = await bound(low - 10_000 + Math.floor(Math.random() * 10_000));
      if (p !== undefined) return p;
    }
  }
  const p = await bound(0);
  if (p === undefined) throw new Error('no free port');
  return p;
}

/** Waits until something listens on `p` (a liveness bound of `ms`). */
export async function listening(p: number, ms: number): Promise<void> {
  const until = Date.now() + ms;
  for (;;) {
    const ok = await new Promise<boolean>((resolve) => {
      const c = createConnection({ host: '127.0.0.1', port: p }, () => {
        c.end();
        resolve(true);
      });
      c.on('error', () => resolve(false));
    });
    if (ok) return;
    if (Date.now() > until) throw new Error(`nothing listens on ${p}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

export const port = (s: HttpServer) => (s.address() as AddressInfo).port;

export async function connect(url: string): Promise<Client> {
  const client = new Client(
    { name: 'e2e', version: '1.0.0' },
    { capabilities: { elicitation: { form: {}, url: {} } }, versionNegotiation: { mode: { pin: '2026-07-28' } } } as never,
  );
  client.setRequestHandler('elicitation/create', async () => ({ action: 'accept', content: { confirm: true } }));
  await client.connect(new StreamableHTTPClientTransport(new URL(url)));
  return client;
}

export type Round = { resultType: string; requestState?: string; inputRequests?: Record<string, unknown>; isError?: boolean; content?: Array<{ text?: string }> };

export async function call(client: Client, name: string, args: Record<string, unknown>, extra: Record<string, unknown> = {}): Promise<Round> {
  return (await client.callTool({ name, arguments: args, ...extra } as never, { allowInputRequired: true } as never)) as unknown as Round;
}

export const yes = (r: Round) =>
  Object.fromEntries(Object.keys(r.inputRequests ?? {}).map((k) => [k, { action: 'accept', content: { confirm: true } }]));
export const text = (r: Round) => JSON.stringify(r.content ?? []);

export const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

/** Polls `cond` every 20 ms; rejects after `ms` (a liveness bound only). */
export async function until(cond: () => boolean, ms: number, what: string): Promise<void> {
  const end = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > end) throw new Error(`timed out waiting for ${what}`);
    await sleep(20);
  }
}

/** The JSON-RPC error a call must fail with. */
export function rpcError(code: number, message: string, reason?: string) {
  return (e: { code?: number; message?: string; data?: { reason?: string } }) => {
    assert.equal(e.code, code, `code of ${JSON.stringify(e.message)}`);
    assert.equal(e.message, message);
    if (reason !== undefined) assert.equal(e.data?.reason, reason);
    return true;
  };
}

/** What a call settled to, for asserting without hanging on a hung handler. */
export function settle<T>(p: Promise<T>): Promise<{ ok: true; value: T } | { ok: false; error: unknown }> {
  return p.then(
    (value) => ({ ok: true as const, value }),
    (error: unknown) => ({ ok: false as const, error }),
  );
}

/** A slow side-effecting tool, `slow_transfer`: asks for confirmation, then
 * its first confirmed run holds until `minMs` passed and `release()` was
 * called; any later confirmed run (a second execution: a bug) returns at
 * once, so that a test fails instead of hanging. */
export class SlowTool {
  /** Confirmed runs begun (the side effect; must stay at most 1). */
  started = 0;
  /** Confirmed runs finished. */
  finished = 0;
  readonly released: Promise<void>;
  release!: () => void;
  constructor(readonly minMs: number) {
    this.released = new Promise((r) => (this.release = r));
  }
}

const slowConfirm = z.object({ confirm: z.boolean() });

/** Registers `slow_transfer` (the same question and state format as
 * `transfer`, and as py_replica.py's `slow_transfer`) on `server`. */
export function addSlowTool(server: McpServer, slow: SlowTool): McpServer {
  server.registerTool('slow_transfer', { inputSchema: z.object({ amount: z.number() }) }, async ({ amount }, ctx) => {
    const state = ctx.mcpReq.requestState<string>();
    const confirmed = acceptedContent(ctx.mcpReq.inputResponses, 'confirm', slowConfirm);
    if (state === undefined || confirmed === undefined) {
      return inputRequired({
        inputRequests: { confirm: inputRequired.elicit({ message: `Transfer ${amount}?`, requestedSchema: slowConfirm }) },
        requestState: JSON.stringify({ step: 'confirm', amount }),
      });
    }
    if (JSON.parse(state).amount !== amount) throw new Error('state does not match');
    if (++slow.started === 1) await Promise.all([sleep(slow.minMs), slow.released]);
    slow.finished++;
    return { content: [{ type: 'text' as const, text: `slow ${amount} done` }] };
  });
  return server;
}

/** A logger that keeps every line, by level. */
export function recordingLogger() {
  const lines: Record<'debug' | 'info' | 'warn' | 'error', string[]> = { debug: [], info: [], warn: [], error: [] };
  return {
    lines,
    debug: (m: string) => void lines.debug.push(m),
    info: (m: string) => void lines.info.push(m),
    warn: (m: string) => void lines.warn.push(m),
    error: (m: string) => void lines.error.push(m),
  };
}

/** A TCP relay to `addr` (`host:port`) that can be cut: while down, every
 * connection through it is dropped at once, and a new one is closed as soon
 * as it is accepted. */
export async function cuttableRelay(addr: string) {
  const i = addr.lastIndexOf(':');
  const [host, p] = [addr.slice(0, i), Number(addr.slice(i + 1))];
  const state = { down: false };
  const open = new Set<Socket>();
  const server = createNetServer((down: Socket) => {
    if (state.down) return void down.destroy();
    const up = createConnection({ host, port: p });
    for (const s of [down, up]) {
      open.add(s);
      s.on('close', () => open.delete(s));
      s.on('error', () => undefined);
    }
    down.pipe(up);
    up.pipe(down);
    up.on('close', () => down.destroy());
    down.on('close', () => up.destroy());
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return {
    addr: `127.0.0.1:${(server.address() as { port: number }).port}`,
    cut() {
      state.down = true;
      for (const s of open) s.destroy();
    },
    restore() {
      state.down = false;
    },
    close() {
      state.down = true;
      for (const s of open) s.destroy();
      server.close();
    },
  };
}
