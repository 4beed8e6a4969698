// How a replayed token is answered (`onReplay`), and answers that come
// without a token. The real SDK server and client over Streamable HTTP, the
// real stateseal binary.
import assert from 'node:assert/strict';
import { type ChildProcess } from 'node:child_process';
import { type Server as HttpServer } from 'node:http';
import { after, before, test } from 'node:test';

import { acceptedContent, inputRequired, McpServer } from '@modelcontextprotocol/server';
import * as z from 'zod';

import { serveHttp } from '../examples/transfer-server.js';
import { type BoundaryOptions, install, RequestStateClient, StatesealBoundary } from '../src/index.js';
import {
  addSlowTool,
  call,
  connect,
  port,
  recordingLogger,
  rpcError,
  settle,
  SlowTool,
  startStateseal,
  text,
  until,
  yes,
} from './helpers.js';

let stateseal: { proc: ChildProcess; addr: string };
let grpc: RequestStateClient;
const servers: HttpServer[] = [];

before(async () => {
  stateseal = await startStateseal();
  grpc = new RequestStateClient(stateseal.addr);
});

after(() => {
  for (const s of servers) s.close();
  grpc?.close();
  stateseal?.proc.kill('SIGTERM');
});

const confirmSchema = z.object({ confirm: z.boolean() });

/** What the `careless` tool did. */
const careless = { executed: 0, seenAnswers: [] as unknown[] };
/** The states the `stateless` tool saw with an answer. */
const statelessSaw: unknown[] = [];
/** What the `close_account` tool saw and did. */
const closing = { closed: 0, rounds: [] as Array<{ state: unknown; answers: unknown }> };
const okSchema = z.object({ ok: z.boolean() });

/** An MCP server with `slow_transfer` and `careless`: a tool that acts on a
 * confirmation without looking at its state — what answers without a token
 * must never reach. */
async function serve(slow: SlowTool, options: Partial<BoundaryOptions> = {}) {
  const logger = recordingLogger();
  const boundary = new StatesealBoundary(grpc, { audience: 'replay-service', logger, ...options });
  const http = await serveHttp(() => {
    const server = new McpServer({ name: 'replay-service', version: '1.0.0' });
    install(server, boundary);
    server.registerTool('careless', { inputSchema: z.object({ amount: z.number() }) }, async ({ amount }, ctx) => {
      if (ctx.mcpReq.inputResponses !== undefined) careless.seenAnswers.push(ctx.mcpReq.inputResponses);
      const confirmed = acceptedContent(ctx.mcpReq.inputResponses, 'confirm', confirmSchema);
      if (confirmed?.confirm) {
        careless.executed++;
        return { content: [{ type: 'text' as const, text: `careless ${amount} done` }] };
      }
      return inputRequired({
        inputRequests: { confirm: inputRequired.elicit({ message: `Transfer ${amount}?`, requestedSchema: confirmSchema }) },
        requestState: JSON.stringify({ amount }),
      });
    });
    // Asks without a requestState of its own (the specification allows it).
    server.registerTool('stateless', { inputSchema: z.object({ amount: z.number() }) }, async ({ amount }, ctx) => {
      const confirmed = acceptedContent(ctx.mcpReq.inputResponses, 'confirm', confirmSchema);
      if (confirmed === undefined) {
        return inputRequired({
          inputRequests: { confirm: inputRequired.elicit({ message: `Transfer ${amount}?`, requestedSchema: confirmSchema }) },
        });
      }
      statelessSaw.push(ctx.mcpReq.requestState());
      return { content: [{ type: 'text' as const, text: `stateless ${amount} done` }] };
    });
    // Round 1 asks nothing: "still working, call again", a state only.
    // Round 2 acts on a `confirm` answer if one reaches it — which no round
    // asked for, so none may.
    server.registerTool('close_account', { inputSchema: z.object({ account: z.string() }) }, async ({ account }, ctx) => {
      const state = ctx.mcpReq.requestState<string>();
      if (state === undefined) return inputRequired({ requestState: JSON.stringify({ step: 'working', account }) });
      closing.rounds.push({ state, answers: ctx.mcpReq.inputResponses });
      if (acceptedContent(ctx.mcpReq.inputResponses, 'confirm', okSchema)?.ok) {
        closing.closed++;
        return { content: [{ type: 'text' as const, text: `ACCOUNT ${account} CLOSED` }] };
      }
      return { content: [{ type: 'text' as const, text: `account ${account} still open` }] };
    });
    return addSlowTool(server, slow);
  }, 0);
  servers.push(http);
  const client = await connect(`http://127.0.0.1:${port(http)}/mcp`);
  return { client, logger, boundary };
}

/** Round 1, then round 2 held in the handler; `replay` runs while it is
 * held; then round 2 completes. */
async function whileRunning<T>(
  client: Awaited<ReturnType<typeof connect>>,
  slow: SlowTool,
  amount: number,
  replay: (retry: Record<string, unknown>) => Promise<T>,
) {
  const r = await call(client, 'slow_transfer', { amount });
  assert.equal(r.resultType, 'input_required');
  const retry = { inputResponses: yes(r), requestState: r.requestState };
  const running = call(client, 'slow_transfer', { amount }, retry);
  await until(() => slow.started >= 1, 60_000, 'the handler to start');
  const during = await replay(retry);
  assert.equal(slow.finished, 0, 'the replay was answered while the handler ran');
  slow.release();
  assert.match(text(await running), new RegExp(`slow ${amount} done`));
  return { r, retry, during };
}

test("onReplay 'error' (the default): in progress is retryable, used is -32602; one execution", async () => {
  const slow = new SlowTool(0);
  const { client, logger } = await serve(slow);
  const { r, retry, during } = await whileRunning(client, slow, 21, (retry) =>
    settle(call(client, 'slow_transfer', { amount: 21 }, retry)),
  );
  assert.equal(during.ok, false, 'IN_USE answered with a result');
  if (!during.ok) rpcError(-32603, 'Request in progress; retry later', 'in_progress')(during.error as never);
  // The exact retry again, after it completed: what a scanner sends.
  await assert.rejects(
    call(client, 'slow_transfer', { amount: 21 }, retry),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
  );
  // Also without answers: the token alone is refused the same way.
  await assert.rejects(
    call(client, 'slow_transfer', { amount: 21 }, { requestState: r.requestState }),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
  );
  assert.equal(slow.started, 1, 'executed exactly once');
  assert.ok(logger.lines.warn.some((m) => /REPLAYED/.test(m)), logger.lines.warn.join('\n'));
  await client.close();
});

test("onReplay 'reask': a replay (in progress or used) asks afresh; one execution", async () => {
  const slow = new SlowTool(0);
  const { client } = await serve(slow, { onReplay: 'reask' });
  const { r, retry, during } = await whileRunning(client, slow, 22, (retry) =>
    call(client, 'slow_transfer', { amount: 22 }, retry),
  );
  assert.equal(during.resultType, 'input_required', 'IN_USE asks again');
  assert.notEqual(during.requestState, r.requestState);
  const again = await call(client, 'slow_transfer', { amount: 22 }, retry);
  assert.equal(again.resultType, 'input_required', 'REPLAYED asks again');
  assert.notEqual(again.requestState, r.requestState);
  assert.equal(slow.started, 1, 'executed exactly once');
  await client.close();
});

test("onReplay 'reask' with reask: false: a replay is -32602 Invalid or expired requestState", async () => {
  const slow = new SlowTool(0);
  const { client } = await serve(slow, { onReplay: 'reask', reask: false });
  const r = await call(client, 'slow_transfer', { amount: 23 });
  const retry = { inputResponses: yes(r), requestState: r.requestState };
  slow.release();
  assert.match(text(await call(client, 'slow_transfer', { amount: 23 }, retry)), /slow 23 done/);
  await assert.rejects(
    call(client, 'slow_transfer', { amount: 23 }, retry),
    rpcError(-32602, 'Invalid or expired requestState', 'invalid_request_state'),
  );
  assert.equal(slow.started, 1);
  await client.close();
});

test('onReplay accepts only error or reask', () => {
  assert.throws(() => new StatesealBoundary(grpc, { audience: 'x', onReplay: 'retry' as never }), TypeError);
});

test('answers without a token never reach the handler (absent requestState)', async () => {
  const { client, logger } = await serve(new SlowTool(0));
  const forged = { confirm: { action: 'accept', content: { confirm: true } } };
  const [before, executed] = [careless.seenAnswers.length, careless.executed];
  const r = await call(client, 'careless', { amount: 31 }, { inputResponses: forged });
  assert.equal(r.resultType, 'input_required', 'asked, not executed');
  assert.equal(careless.executed, executed);
  assert.equal(careless.seenAnswers.length, before, 'the handler saw no answers');
  assert.ok(logger.lines.debug.some((m) => /inputResponses without requestState on tools\/call/.test(m)), logger.lines.debug.join('\n'));
  // The genuine round trip still works, and the handler sees the answers.
  const done = await call(client, 'careless', { amount: 31 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /careless 31 done/);
  assert.equal(careless.executed, executed + 1);
  await client.close();
});

test('answers with a null requestState never reach the handler', async () => {
  // Over the wire the SDK itself refuses a non-string requestState (-32602)
  // before any handler.
  const { client } = await serve(new SlowTool(0));
  const forged = { confirm: { action: 'accept', content: { confirm: true } } };
  const [before, executed] = [careless.seenAnswers.length, careless.executed];
  const wire = await settle(call(client, 'careless', { amount: 32 }, { inputResponses: forged, requestState: null }));
  console.log(`null requestState over the wire: ${wire.ok ? wire.value.resultType : (wire.error as Error).message}`);
  if (wire.ok) assert.equal(wire.value.resultType, 'input_required', 'asked, not executed');
  else rpcError(-32602, 'Invalid or expired requestState')(wire.error as never);
  assert.equal(careless.executed, executed);
  assert.equal(careless.seenAnswers.length, before);
  await client.close();

  // Called directly (wrapHandler on a low-level server, whatever sits in
  // front): the handler runs without state and without the answers.
  const logger = recordingLogger();
  const boundary = new StatesealBoundary(grpc, { audience: 'replay-service', logger });
  const seen: Array<{ state: unknown; answers: unknown }> = [];
  const handler = boundary.wrapHandler('tools/call', (async (
    _request: unknown,
    ctx: { mcpReq: { requestState: () => unknown; inputResponses?: unknown } },
  ) => {
    seen.push({ state: ctx.mcpReq.requestState(), answers: ctx.mcpReq.inputResponses });
    return { content: [] };
  }) as never) as unknown as (request: unknown, ctx: unknown) => Promise<unknown>;
  for (const inputResponses of [forged, undefined]) {
    await handler(
      { params: { name: 'careless', arguments: { amount: 32 } } },
      { mcpReq: { method: 'tools/call', requestState: () => null, inputResponses } },
    );
  }
  assert.deepEqual(seen, [
    { state: undefined, answers: undefined },
    { state: undefined, answers: undefined },
  ]);
  assert.equal(logger.lines.debug.length, 1, 'the dropped answers are logged at debug level');
  assert.doesNotMatch(logger.lines.debug[0], /confirm/, 'never the answers themselves');
});

test('a handler that asks without a requestState gets a minted token, and sees no state', async () => {
  const { client } = await serve(new SlowTool(0));
  const r = await call(client, 'stateless', { amount: 33 });
  assert.equal(r.resultType, 'input_required');
  assert.equal(typeof r.requestState, 'string', 'the boundary minted a token');
  // Answers without it are dropped: the handler asks again.
  const unbound = await call(client, 'stateless', { amount: 33 }, { inputResponses: yes(r) });
  assert.equal(unbound.resultType, 'input_required');
  assert.deepEqual(statelessSaw, []);
  const done = await call(client, 'stateless', { amount: 33 }, { inputResponses: yes(r), requestState: r.requestState });
  assert.match(text(done), /stateless 33 done/);
  assert.deepEqual(statelessSaw, [undefined], 'the minted (empty) state reads as none');
  await assert.rejects(
    call(client, 'stateless', { amount: 33 }, { inputResponses: yes(r), requestState: r.requestState }),
    rpcError(-32602, 'requestState already used', 'request_state_used'),
  );
  // The SDK client's own loop completes too.
  const auto = (await client.callTool({ name: 'stateless', arguments: { amount: 34 } })) as never;
  assert.match(text(auto), /stateless 34 done/);
  await client.close();
});

test('a round that asked nothing lets no answer through: a forged one never reaches the handler', async () => {
  // Issue 58, finding 1: a state-only input_required is sealed with a
  // manifest of no questions, so stateseal drops every answer its retry
  // carries (UNASKED).
  const { client, logger } = await serve(new SlowTool(0));
  const r = await call(client, 'close_account', { account: 'A-7' });
  assert.equal(r.resultType, 'input_required');
  assert.deepEqual(Object.keys(r.inputRequests ?? {}), [], 'round 1 asked nothing');
  assert.equal(typeof r.requestState, 'string');
  const forged = { confirm: { action: 'accept', content: { ok: true } } };
  const done = await call(client, 'close_account', { account: 'A-7' }, { inputResponses: forged, requestState: r.requestState });
  assert.match(text(done), /account A-7 still open/);
  assert.equal(closing.closed, 0, 'the handler acted on a forged answer');
  assert.equal(closing.rounds.length, 1);
  assert.equal(closing.rounds[0].state, JSON.stringify({ step: 'working', account: 'A-7' }), 'the state came through');
  const answers = closing.rounds[0].answers;
  assert.ok(answers === undefined || Object.keys(answers as object).length === 0, `the handler received answers: ${JSON.stringify(answers)}`);
  assert.ok(logger.lines.info.some((m) => m === 'stateseal: inputResponses["confirm"] dropped on tools/call: UNASKED'), logger.lines.info.join('\n'));
  assert.deepEqual(logger.lines.error, []);
  await client.close();
});
