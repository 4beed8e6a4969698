// mTLS end to end: stateseal with --auth mtls, the MCP servers' gRPC client
// presenting a certificate of a throwaway CA (made with the openssl CLI);
// a certificate naming no tenant is `-32603 Internal error`.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';

import { serveHttp, transferServer } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary } from '../src/index.js';
import { call, connect, front, port, startStateseal, text } from './helpers.js';

function openssl(dir: string, ...args: string[]) {
  execFileSync('openssl', args, { cwd: dir, stdio: ['ignore', 'ignore', 'pipe'] });
}

/** A CA, a server certificate for 127.0.0.1, and client certificates whose
 * URI SANs are `uris`. */
function pki(dir: string, uris: string[]) {
  openssl(dir, 'req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-days', '1',
    '-subj', '/CN=test CA', '-keyout', 'ca.key', '-out', 'ca.pem',
    '-addext', 'basicConstraints=critical,CA:TRUE', '-addext', 'keyUsage=critical,keyCertSign,cRLSign');
  const leaf = (name: string, ext: string) => {
    writeFileSync(join(dir, `${name}.ext`), ext);
    openssl(dir, 'req', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-subj', `/CN=${name}`,
      '-keyout', `${name}.key`, '-out', `${name}.csr`);
    openssl(dir, 'x509', '-req', '-in', `${name}.csr`, '-CA', 'ca.pem', '-CAkey', 'ca.key', '-CAcreateserial',
      '-days', '1', '-out', `${name}.pem`, '-extfile', `${name}.ext`);
  };
  leaf('server', 'subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n');
  uris.forEach((u, i) => leaf(`client${i}`, `subjectAltName=URI:${u}\nextendedKeyUsage=clientAuth\n`));
}

test('mTLS: a tenant certificate works across the round trip; one naming no tenant is an internal error', async () => {
  const dir = mkdtempSync(join(tmpdir(), 'stateseal-mtls-'));
  pki(dir, ['spiffe://test/transfer-service', 'spiffe://test/someone-else']);
  const tenants = join(dir, 'tenants.json');
  writeFileSync(tenants, JSON.stringify({ tenants: [{ name: 'transfer', uri: 'spiffe://test/transfer-service' }] }));
  const ss = await startStateseal(
    '--auth', 'mtls',
    '--tls-cert', join(dir, 'server.pem'), '--tls-key', join(dir, 'server.key'),
    '--tls-client-ca', join(dir, 'ca.pem'), '--tenants', tenants,
  );
  const read = (f: string) => readFileSync(join(dir, f));
  const quiet = { info() {}, warn() {}, error() {} };
  try {
    for (const [n, ok] of [[0, true], [1, false]] as const) {
      const tls = { ca: read('ca.pem'), key: read(`client${n}.key`), cert: read(`client${n}.pem`) };
      const rpc = new RequestStateClient(ss.addr, { tls });
      const mcp = await serveHttp(() => transferServer(new StatesealBoundary(rpc, { audience: 'transfer-service', logger: quiet })), 0);
      const lb = await front([port(mcp)]);
      const client = await connect(`http://127.0.0.1:${port(lb)}/mcp`);
      try {
        if (ok) {
          const r = (await client.callTool({ name: 'transfer', arguments: { amount: 9 } })) as never;
          assert.match(text(r), /transferred 9/);
        } else {
          await assert.rejects(call(client, 'transfer', { amount: 9 }), (e: { code?: number; message?: string }) =>
            e.code === -32603 && e.message === 'Internal error');
        }
      } finally {
        await client.close();
        lb.close();
        mcp.close();
        rpc.close();
      }
    }
  } finally {
    ss.proc.kill('SIGTERM');
  }
});
