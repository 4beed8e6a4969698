// Shared by the end-to-end tests: the real stateseal binary, a round-robin
// front, and the real SDK client.
import { type ChildProcess, spawn } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { createServer, request as httpRequest, type Server as HttpServer } from 'node:http';
import { type AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

import { Client, StreamableHTTPClientTransport } from '@modelcontextprotocol/client';

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

/** A round-robin front: every tools/call goes to the next backend. */
export async function front(backends: number[], route: number[] = []): Promise<HttpServer & { served: number[] }> {
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
          port = route.shift() ?? backends[next++ % backends.length];
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
  const out = Object.assign(server, { served });
  await new Promise<void>((resolve) => out.listen(0, '127.0.0.1', resolve));
  return out;
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
