// Bearer credentials end to end, and the error table's configuration row: a
// wrong secret between the MCP server and stateseal is `-32603 Internal
// error` (the MCP client is not at fault), with an error log naming it.
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { mkdtempSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';

import { serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary } from '../src/index.js';
import { call, connect, front, port, startStateseal, text } from './helpers.js';

test('bearer credentials: the right secret works, a wrong one is an internal error', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'stateseal-bearer-'));
  const tenants = join(dir, 'tenants.json');
  const digest = createHash('sha256').update('s3cret-of-transfer').digest('hex');
  writeFileSync(tenants, JSON.stringify({ tenants: [{ name: 'transfer', bearer_sha256: digest }] }));
  const ss = await startStateseal('--auth', 'bearer', '--tenants', tenants);
  const errors: string[] = [];
  const logger = { info() {}, warn() {}, error: (m: string) => errors.push(m) };
  try {
    for (const [secret, ok] of [
      ['s3cret-of-transfer', true],
      ['wrong-secret', false],
    ] as const) {
      const grpc = new RequestStateClient(ss.addr, { bearer: secret });
      const mcp = await serveHttp(() => transferServer(new StatesealBoundary(grpc, { audience: 'transfer-service', logger })), 0);
      const lb = await front([port(mcp)]);
      const client = await connect(`http://127.0.0.1:${port(lb)}/mcp`);
      try {
        if (ok) {
          const r = (await client.callTool({ name: 'transfer', arguments: { amount: 7 } })) as never;
          assert.match(text(r), /transferred 7/);
          assert.equal(String(grpc), 'RequestStateClient(..)', 'the secret never shows');
        } else {
          await assert.rejects(call(client, 'transfer', { amount: 7 }), (e: { code?: number; message?: string }) => {
            return e.code === -32603 && e.message === 'Internal error';
          });
          assert.ok(errors.some((m) => /UNAUTHENTICATED/.test(m) && !m.includes(secret)), errors.join('\n'));
        }
      } finally {
        await client.close();
        lb.close();
        mcp.close();
        grpc.close();
      }
    }
  } finally {
    ss.proc.kill('SIGTERM');
  }
});
