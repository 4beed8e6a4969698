// The tools and prompt that the official MCP conformance suite's MRTR server
// scenarios (`input-required-result-*`, spec 2026-07-28) call, served with
// stateseal installed exactly as the README shows. Run:
//   STATESEAL_ADDR=127.0.0.1:50051 PORT=3000 node dist/examples/conformance-server.js
import { fileURLToPath } from 'node:url';

import { inputRequired, McpServer } from '@modelcontextprotocol/server';

import { install, RequestStateClient, StatesealBoundary } from '../src/index.js';
import { serveHttp } from './transfer-server.js';

type Answers = Record<string, unknown> | undefined;
type Ctx = {
  mcpReq: {
    inputResponses?: Record<string, unknown>;
    requestState: <T = unknown>() => T | undefined;
    envelope?: Record<string, unknown>;
    _meta?: Record<string, unknown>;
  };
};

/** The accepted form content of `key`, if any. */
function accepted(answers: Answers, key: string): Record<string, unknown> | undefined {
  const a = answers?.[key] as { action?: unknown; content?: unknown } | undefined;
  if (!a || typeof a !== 'object' || a.action !== 'accept') return undefined;
  return a.content && typeof a.content === 'object' ? (a.content as Record<string, unknown>) : undefined;
}

/** A sampling answer's text, if `key` has one. */
function sampled(answers: Answers, key: string): string | undefined {
  const a = answers?.[key] as { role?: unknown; content?: { type?: unknown; text?: unknown } } | undefined;
  if (!a || typeof a !== 'object' || typeof a.role !== 'string') return undefined;
  return typeof a.content?.text === 'string' ? a.content.text : undefined;
}

/** A roots answer, if `key` has one. */
function roots(answers: Answers, key: string): Array<{ uri: string }> | undefined {
  const a = answers?.[key] as { roots?: unknown } | undefined;
  return a && Array.isArray(a.roots) ? (a.roots as Array<{ uri: string }>) : undefined;
}

const text = (t: string) => ({ content: [{ type: 'text' as const, text: t }] });
const form = (message: string, props: Record<string, 'string' | 'boolean'>) =>
  inputRequired.elicit({
    message,
    requestedSchema: {
      type: 'object',
      properties: Object.fromEntries(Object.entries(props).map(([k, t]) => [k, { type: t }])),
      required: Object.keys(props),
    } as never,
  });
const capitalQuestion = (maxTokens: number, q: string) =>
  inputRequired.createMessage({ messages: [{ role: 'user', content: { type: 'text', text: q } }], maxTokens });

/** The state of a round: plaintext, minted by this server; stateseal seals it. */
const state = (round: string) => JSON.stringify({ round });
function round(ctx: Ctx): string | undefined {
  const s = ctx.mcpReq.requestState<string>();
  return typeof s === 'string' ? (JSON.parse(s) as { round: string }).round : undefined;
}

export function conformanceServer(boundary: StatesealBoundary): McpServer {
  const server = new McpServer({ name: 'stateseal-conformance', version: '1.0.0' });
  install(server, boundary);
  const tool = (name: string, cb: (ctx: Ctx) => unknown) =>
    server.registerTool(name, { description: name }, ((ctx: Ctx) => cb(ctx)) as never);

  tool('test_input_required_result_elicitation', (ctx) => {
    const c = accepted(ctx.mcpReq.inputResponses, 'user_name');
    if (typeof c?.name !== 'string') return inputRequired({ inputRequests: { user_name: form('What is your name?', { name: 'string' }) } });
    return text(`Hello, ${c.name}!`);
  });
  tool('test_input_required_result_sampling', (ctx) => {
    const t = sampled(ctx.mcpReq.inputResponses, 'capital_question');
    if (t === undefined) return inputRequired({ inputRequests: { capital_question: capitalQuestion(100, 'What is the capital of France?') } });
    return text(`The model said: ${t}`);
  });
  tool('test_input_required_result_list_roots', (ctx) => {
    const r = roots(ctx.mcpReq.inputResponses, 'client_roots');
    if (r === undefined) return inputRequired({ inputRequests: { client_roots: inputRequired.listRoots() } });
    return text(`Roots: ${r.map((x) => x.uri).join(', ')}`);
  });
  tool('test_input_required_result_request_state', (ctx) => {
    const c = accepted(ctx.mcpReq.inputResponses, 'confirm');
    if (round(ctx) !== 'confirm' || typeof c?.ok !== 'boolean') {
      return inputRequired({ inputRequests: { confirm: form('Please confirm', { ok: 'boolean' }) }, requestState: state('confirm') });
    }
    return text(`state-ok: confirmed=${c.ok}`);
  });
  tool('test_input_required_result_multiple_inputs', (ctx) => {
    const a = ctx.mcpReq.inputResponses;
    const name = accepted(a, 'user_name')?.name;
    const greeting = sampled(a, 'greeting');
    const r = roots(a, 'client_roots');
    if (round(ctx) !== 'all' || typeof name !== 'string' || greeting === undefined || r === undefined) {
      return inputRequired({
        inputRequests: {
          user_name: form('What is your name?', { name: 'string' }),
          greeting: capitalQuestion(50, 'Generate a greeting'),
          client_roots: inputRequired.listRoots(),
        },
        requestState: state('all'),
      });
    }
    return text(`${greeting} ${name} (${r.length} roots)`);
  });
  tool('test_input_required_result_multi_round', (ctx) => {
    const a = ctx.mcpReq.inputResponses;
    const r = round(ctx);
    const name = accepted(a, 'step1')?.name;
    if (r === 'step1' && typeof name === 'string') {
      return inputRequired({
        inputRequests: { step2: form('Step 2: What is your favorite color?', { color: 'string' }) },
        requestState: JSON.stringify({ round: 'step2', name }),
      });
    }
    const color = accepted(a, 'step2')?.color;
    if (r === 'step2' && typeof color === 'string') {
      const s = JSON.parse(ctx.mcpReq.requestState<string>()!) as { name: string };
      return text(`${s.name} likes ${color}`);
    }
    return inputRequired({ inputRequests: { step1: form('Step 1: What is your name?', { name: 'string' }) }, requestState: state('step1') });
  });
  tool('test_input_required_result_tampered_state', (ctx) => {
    const c = accepted(ctx.mcpReq.inputResponses, 'confirm');
    if (round(ctx) !== 'confirm' || typeof c?.ok !== 'boolean') {
      return inputRequired({ inputRequests: { confirm: form('Please confirm', { ok: 'boolean' }) }, requestState: state('confirm') });
    }
    return text('state verified');
  });
  tool('test_input_required_result_capabilities', (ctx) => {
    const key = 'io.modelcontextprotocol/clientCapabilities';
    const caps = (ctx.mcpReq.envelope?.[key] ?? ctx.mcpReq._meta?.[key] ?? {}) as Record<string, unknown>;
    const a = ctx.mcpReq.inputResponses;
    if (sampled(a, 'summary') !== undefined || accepted(a, 'confirm') !== undefined) return text('done');
    const inputRequests: Record<string, ReturnType<typeof form>> = {};
    if (caps.sampling) inputRequests.summary = capitalQuestion(50, 'Summarize the request');
    if (caps.elicitation) inputRequests.confirm = form('Proceed?', { ok: 'boolean' });
    if (Object.keys(inputRequests).length === 0) return text('no input capability declared');
    return inputRequired({ inputRequests });
  });

  server.registerPrompt(
    'test_input_required_result_prompt',
    { description: 'A prompt that asks for context first' },
    ((ctx: Ctx) => {
      const c = accepted(ctx.mcpReq.inputResponses, 'user_context');
      if (typeof c?.context !== 'string') {
        return inputRequired({ inputRequests: { user_context: form('What context should the prompt use?', { context: 'string' }) } });
      }
      return { messages: [{ role: 'user' as const, content: { type: 'text' as const, text: `Context: ${c.context}` } }] };
    }) as never,
  );
  return server;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const boundary = new StatesealBoundary(new RequestStateClient(process.env.STATESEAL_ADDR ?? '127.0.0.1:50051'), {
    audience: 'stateseal-conformance',
  });
  const http = await serveHttp(() => conformanceServer(boundary), Number(process.env.PORT ?? 3000));
  console.log(`listening on ${JSON.stringify(http.address())}`);
}

