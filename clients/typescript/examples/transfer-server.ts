// A complete MCP server (official TypeScript SDK ≥ 2.4, Streamable HTTP,
// stateless) whose requestState goes through stateseal. Run:
//   STATESEAL_ADDR=127.0.0.1:50051 PORT=3000 node dist/examples/transfer-server.js
import { createServer, type Server as HttpServer } from 'node:http';
import { fileURLToPath } from 'node:url';

import { acceptedContent, createMcpHandler, inputRequired, McpServer } from '@modelcontextprotocol/server';
import * as z from 'zod';

import { install, RequestStateClient, StatesealBoundary } from '../src/index.js';

/** Tools whose next confirmed run fails once (for the tests). */
export const FAIL_ONCE = new Set<string>();
/** inputResponses as the handlers saw them (for the tests). */
export const SEEN_ANSWERS: unknown[] = [];

const confirmSchema = z.object({ confirm: z.boolean() });

export function transferServer(boundary: StatesealBoundary): McpServer {
  const server = new McpServer({ name: 'transfer-service', version: '1.0.0' });
  install(server, boundary);
  const ask = (amount: number) =>
    inputRequired({
      inputRequests: {
        confirm: inputRequired.elicit({ message: `Transfer ${amount}?`, requestedSchema: confirmSchema }),
      },
      requestState: JSON.stringify({ step: 'confirm', amount }),
    });
  for (const name of ['transfer', 'pay']) {
    server.registerTool(
      name,
      { inputSchema: z.object({ amount: z.number() }) },
      async ({ amount }, ctx) => {
        if (ctx.mcpReq.inputResponses !== undefined) SEEN_ANSWERS.push(ctx.mcpReq.inputResponses);
        const state = ctx.mcpReq.requestState<string>();
        const confirmed = acceptedContent(ctx.mcpReq.inputResponses, 'confirm', confirmSchema);
        if (state === undefined || confirmed === undefined) return ask(amount);
        // The state is the plaintext this server minted (stateseal opened it).
        if (JSON.parse(state).amount !== amount) throw new Error('state does not match');
        if (FAIL_ONCE.delete(name)) throw new Error(`${name} backend hiccup`);
        const verb = name === 'pay' ? 'paid' : 'transferred';
        return { content: [{ type: 'text' as const, text: confirmed.confirm ? `${verb} ${amount}` : 'cancelled' }] };
      },
    );
  }
  // URL mode: the user signs in on a page outside the client; `accept` is
  // consent, never data.
  server.registerTool('login', { description: 'Sign in to the bank' }, async (ctx) => {
    if (ctx.mcpReq.inputResponses !== undefined) SEEN_ANSWERS.push(ctx.mcpReq.inputResponses);
    const answer = ctx.mcpReq.inputResponses?.signin as { action?: string } | undefined;
    if (ctx.mcpReq.requestState() === undefined || answer?.action !== 'accept') {
      return inputRequired({
        inputRequests: { signin: inputRequired.elicitUrl({ message: 'Sign in', url: 'https://bank.example/signin' }) },
        requestState: JSON.stringify({ step: 'signin' }),
      });
    }
    return { content: [{ type: 'text' as const, text: 'signed in' }] };
  });
  return server;
}

/** Serves `factory` over Streamable HTTP on 127.0.0.1:`port` (0 = any). */
export async function serveHttp(factory: () => McpServer, port: number): Promise<HttpServer> {
  const handler = createMcpHandler(factory);
  const http = createServer(async (req, res) => {
    try {
      const chunks: Buffer[] = [];
      for await (const c of req) chunks.push(c as Buffer);
      const body = Buffer.concat(chunks);
      const headers = new Headers();
      for (const [k, v] of Object.entries(req.headers)) {
        if (typeof v === 'string') headers.set(k, v);
        else if (Array.isArray(v)) for (const x of v) headers.append(k, x);
      }
      const request = new Request(`http://127.0.0.1${req.url ?? '/'}`, {
        method: req.method,
        headers,
        body: req.method === 'GET' || req.method === 'HEAD' ? undefined : body,
      });
      const response = await handler.fetch(request);
      res.writeHead(response.status, Object.fromEntries(response.headers.entries()));
      res.end(Buffer.from(await response.arrayBuffer()));
    } catch {
      res.writeHead(500).end();
    }
  });
  await new Promise<void>((resolve) => http.listen(port, '127.0.0.1', resolve));
  return http;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const boundary = new StatesealBoundary(new RequestStateClient(process.env.STATESEAL_ADDR ?? '127.0.0.1:50051'), {
    audience: 'transfer-service',
  });
  const http = await serveHttp(() => transferServer(boundary), Number(process.env.PORT ?? 3000));
  console.log(`listening on ${JSON.stringify(http.address())}`);
}
