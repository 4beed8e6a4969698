// Client faults stay client faults: what an end user (the MCP client) sends
// never raises an operator alarm (an error log line) nor reads as a
// configuration problem (`-32603 Internal error`).
//
// - A `requestState` or `inputResponses` over the service's limits is
//   refused with -32602 before stateseal is called, logged at debug only.
// - A message stateseal's transport refuses as too large (`OUT_OF_RANGE`,
//   here because the server runs with smaller limits than the package's) is
//   -32602 as well, without an error line.
// The real SDK server and client over Streamable HTTP, the real stateseal.
import assert from 'node:assert/strict';
import { type ChildProcess } from 'node:child_process';
import { type Server as HttpServer } from 'node:http';
import { after, test } from 'node:test';

import { Status } from '../src/transport.js';

import { serveHttp, transferServer } from '../examples/transfer-server.js';
import { type Opened, RequestStateClient, StatesealBoundary, StatesealError } from '../src/index.js';
import { call, connect, port, recordingLogger, rpcError, startStateseal, text, yes } from './helpers.js';

const TWO_MIB = 2 * 1024 * 1024;

/** Counts every Open the boundary sends to stateseal. */
class CountingClient extends RequestStateClient {
  opens = 0;
  override async open(req: Parameters<RequestStateClient['open']>[0]): Promise<Opened> {
    this.opens++;
    return super.open(req);
  }
}

const cleanup: Array<() => void> = [];
after(() => {
  for (const f of cleanup.reverse()) f();
});

/** A stateseal (started with `flags`), one replica of the transfer service
 * in front of it with a recording logger, and a connected SDK client. */
async function deploy(...flags: string[]) {
  const ss: { proc: ChildProcess; addr: string } = await startStateseal(...flags);
  cleanup.push(() => ss.proc.kill('SIGTERM'));
  const grpcClient = new CountingClient(ss.addr);
  cleanup.push(() => grpcClient.close());
  const logger = recordingLogger();
  const boundary = new StatesealBoundary(grpcClient, { audience: 'transfer-service', logger });
  const mcp: HttpServer = await serveHttp(() => transferServer(boundary), 0);
  cleanup.push(() => mcp.close());
  const client = await connect(`http://127.0.0.1:${port(mcp)}/mcp`);
  cleanup.push(() => void client.close());
  return { grpcClient, logger, client };
}

const clear = (lines: Record<string, string[]>) => {
  for (const l of Object.values(lines)) l.length = 0;
};

test('an oversized requestState is refused before stateseal: -32602, debug log only', async () => {
  const { grpcClient, logger, client } = await deploy();
  clear(logger.lines);
  await assert.rejects(
    call(client, 'transfer', { amount: 42 }, {
      requestState: 'A'.repeat(TWO_MIB),
      inputResponses: { confirm: { action: 'accept', content: { confirm: true } } },
    }),
    rpcError(-32602, 'Invalid or expired requestState', 'invalid_request_state'),
  );
  assert.equal(grpcClient.opens, 0, 'stateseal was called');
  assert.deepEqual(logger.lines.error, []);
  assert.deepEqual(logger.lines.warn, []);
  assert.deepEqual(logger.lines.info, []);
  assert.ok(logger.lines.debug.some((m) => /requestState/.test(m) && /TOO_LARGE/.test(m)), logger.lines.debug.join('\n'));
});

test('oversized inputResponses are refused before stateseal, and the token is not spent', async () => {
  const { grpcClient, logger, client } = await deploy();
  const r = await call(client, 'transfer', { amount: 42 });
  assert.equal(r.resultType, 'input_required');
  // Under 256 KiB in characters, over it in UTF-8 bytes (as sent).
  const padded = { ...yes(r), note: { action: 'accept', content: { note: '\u00e9'.repeat(131_100) } } };
  assert.ok(JSON.stringify(padded).length < 262_144);
  clear(logger.lines);
  const before = grpcClient.opens;
  await assert.rejects(
    call(client, 'transfer', { amount: 42 }, { inputResponses: padded, requestState: r.requestState }),
    rpcError(-32602, 'Invalid params: inputResponses too large', 'input_responses_too_large'),
  );
  assert.equal(grpcClient.opens, before, 'stateseal was called');
  assert.deepEqual(logger.lines.error, []);
  assert.deepEqual(logger.lines.warn, []);
  assert.deepEqual(logger.lines.info, []);
  assert.ok(logger.lines.debug.some((m) => /inputResponses/.test(m)), logger.lines.debug.join('\n'));
  const done = await call(client, 'transfer', { amount: 42 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /transferred 42/);
});

test('an OUT_OF_RANGE from stateseal (its limits below the package\'s) is -32602, not a configuration error', async () => {
  // Largest message this server decodes: 1024 + ceil((49 + 16386 + 1024)
  // * 4 / 3) + 1024 + 65536 = 90,863 bytes; the package lets 100,000
  // through (its default bound is 109,910), so stateseal refuses.
  const { grpcClient, logger, client } = await deploy(
    '--max-state-bytes', '1024', '--max-params-bytes', '1024', '--max-input-bytes', '1024',
  );
  clear(logger.lines);
  await assert.rejects(
    call(client, 'transfer', { amount: 42 }, { requestState: 'A'.repeat(100_000) }),
    rpcError(-32602, 'Invalid or expired requestState', 'invalid_request_state'),
  );
  assert.equal(grpcClient.opens, 1, 'stateseal was called once (and refused)');
  assert.deepEqual(logger.lines.error, []);
  const all = [...logger.lines.debug, ...logger.lines.info, ...logger.lines.warn];
  assert.ok(all.some((m) => /OUT_OF_RANGE/.test(m)), all.join('\n'));
});

test('a requestState UTF-8 cannot carry (a lone surrogate) is -32602 before stateseal, not an internal error', async () => {
  // JSON.parse takes "\ud800"; protobufjs would send it as bytes that are not
  // UTF-8, and stateseal's transport would answer INTERNAL.
  const ss = await startStateseal();
  cleanup.push(() => ss.proc.kill('SIGTERM'));
  const grpcClient = new CountingClient(ss.addr);
  cleanup.push(() => grpcClient.close());
  const logger = recordingLogger();
  const boundary = new StatesealBoundary(grpcClient, { audience: 'transfer-service', logger });
  const handler = boundary.wrapHandler('tools/call', (async () => ({ content: [] })) as never) as unknown as (
    request: unknown,
    ctx: unknown,
  ) => Promise<unknown>;
  await assert.rejects(
    handler(
      { params: { name: 'transfer', arguments: { amount: 1 } } },
      { mcpReq: { method: 'tools/call', requestState: () => 'AAAA\ud800', inputResponses: undefined } },
    ),
    rpcError(-32602, 'Invalid or expired requestState', 'invalid_request_state'),
  );
  assert.equal(grpcClient.opens, 0, 'stateseal was called');
  assert.deepEqual(logger.lines.error, []);
  assert.deepEqual(logger.lines.warn, []);
});

test('transport statuses an end user can cause are classified as the error table says', () => {
  const transport = (code: Status) => new StatesealError(Status[code], code, false);
  const tooLarge = transport(Status.OUT_OF_RANGE);
  assert.ok(tooLarge.clientFault && !tooLarge.retryable);
  const exhausted = transport(Status.RESOURCE_EXHAUSTED);
  assert.ok(exhausted.retryable && !exhausted.clientFault);
  for (const code of [Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED]) {
    assert.ok(transport(code).retryable && !transport(code).clientFault);
  }
  for (const code of [Status.UNAUTHENTICATED, Status.PERMISSION_DENIED, Status.INTERNAL]) {
    assert.ok(!transport(code).retryable && !transport(code).clientFault);
  }
  // A stateseal reason decides when there is one.
  const overloaded = new StatesealError('OVERLOADED', Status.RESOURCE_EXHAUSTED, true);
  assert.ok(overloaded.retryable && !overloaded.clientFault);
});
