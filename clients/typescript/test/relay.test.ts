// A timeout after the ledger write followed by a safe retry: a relay between
// the MCP server and stateseal forwards the Open but loses its answer and
// drops the connection. The boundary retries the Open with the same attempt
// id, stateseal answers with the same success, the handler runs once, and
// the token is consumed exactly once.
import assert from 'node:assert/strict';
import { type ChildProcess } from 'node:child_process';
import { type Server as HttpServer } from 'node:http';
import { createConnection, createServer, type Server as TcpServer, type Socket } from 'node:net';
import { after, before, test } from 'node:test';

import { serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary } from '../src/index.js';
import { call, connect, front, port, rpcError, startStateseal, text, yes } from './helpers.js';

let stateseal: { proc: ChildProcess; addr: string };
let relay: TcpServer;
let grpc: RequestStateClient;
let mcp: HttpServer;
let lb: HttpServer & { served: number[] };
/** When set, the answers to the next bytes sent are lost, and the
 * connection is dropped. */
let loseNext = false;
let lost = 0;
const warnings: string[] = [];

before(async () => {
  stateseal = await startStateseal();
  const [host, p] = [stateseal.addr.slice(0, stateseal.addr.lastIndexOf(':')), Number(stateseal.addr.slice(stateseal.addr.lastIndexOf(':') + 1))];
  relay = createServer((down: Socket) => {
    const up = createConnection({ host, port: p });
    let losing = false;
    down.on('data', (d) => {
      if (loseNext && !losing && d.length > 0) {
        // The request goes through; whatever comes back is lost.
        loseNext = false;
        losing = true;
        lost++;
        setTimeout(() => {
          down.destroy();
          up.destroy();
        }, 300);
      }
      up.write(d);
    });
    up.on('data', (d) => {
      if (!losing) down.write(d);
    });
    up.on('error', () => down.destroy());
    down.on('error', () => up.destroy());
    up.on('close', () => down.destroy());
    down.on('close', () => up.destroy());
  });
  await new Promise<void>((r) => relay.listen(0, '127.0.0.1', r));
  const relayAddr = `127.0.0.1:${(relay.address() as { port: number }).port}`;
  grpc = new RequestStateClient(relayAddr, { timeoutMs: 2000 });
  const logger = { info() {}, warn: (m: string) => warnings.push(m), error() {} };
  mcp = await serveHttp(() => transferServer(new StatesealBoundary(grpc, { audience: 'transfer-service', logger })), 0);
  lb = await front([port(mcp)]);
});

after(() => {
  lb?.close();
  mcp?.close();
  grpc?.close();
  relay?.close();
  stateseal?.proc.kill('SIGTERM');
});

test('an Open whose answer is lost after the ledger write is retried safely', async () => {
  const client = await connect(`http://127.0.0.1:${port(lb)}/mcp`);
  const r = await call(client, 'transfer', { amount: 11 });
  assert.equal(r.resultType, 'input_required');
  // The next bytes the MCP server sends to stateseal are the Open.
  loseNext = true;
  const done = await call(client, 'transfer', { amount: 11 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.equal(lost, 1, 'the relay lost one answer');
  assert.ok(warnings.some((w) => /open on tools\/call: (UNAVAILABLE|DEADLINE_EXCEEDED|INTERNAL); retrying/.test(w)), warnings.join('\n'));
  assert.match(text(done), /transferred 11/);
  // Consumed exactly once: a replay is refused.
  await assert.rejects(
    call(client, 'transfer', { amount: 11 }, { inputResponses: yes(r), requestState: r.requestState }),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
  );
  await client.close();
});
