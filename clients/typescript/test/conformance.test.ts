// The official MCP conformance suite's MRTR server scenarios
// (`input-required-result-*`, spec 2026-07-28) against
// examples/conformance-server.ts with stateseal installed. The suite needs
// fs.globSync, which Node 20 lacks: scripts/node20/globsync.mjs adds it.
import assert from 'node:assert/strict';
import { type ChildProcess, execFile } from 'node:child_process';
import { mkdtempSync } from 'node:fs';
import { type Server as HttpServer } from 'node:http';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

import { conformanceServer } from '../examples/conformance-server.js';
import { serveHttp } from '../examples/transfer-server.js';
import { RequestStateClient, StatesealBoundary } from '../src/index.js';
import { port, startStateseal } from './helpers.js';

const run = promisify(execFile);
const root = join(dirname(fileURLToPath(import.meta.url)), '..', '..');
const suite = join(root, 'node_modules', '@modelcontextprotocol', 'conformance', 'dist', 'index.js');
const shim = join(root, 'scripts', 'node20', 'globsync.mjs');

const SCENARIOS = [
  'basic-elicitation',
  'basic-sampling',
  'basic-list-roots',
  'request-state',
  'multiple-input-requests',
  'multi-round',
  'missing-input-response',
  'non-tool-request',
  'result-type',
  'unsupported-methods',
  'tampered-state',
  'capability-check',
  'ignore-extra-params',
  'validate-input',
].map((s) => `input-required-result-${s}`);

/** The one warning this boundary earns on purpose. The scenario sends, in a
 * single first call, `inputResponses` to a question never asked and no
 * `requestState`, and hopes for a complete result. The boundary never hands
 * answers without a sealed token to a handler ("no answers without a
 * token"), so the handler asks instead: the suite's SHOULD-level check warns
 * and nothing fails. With a token, extra keys are dropped and the call
 * completes (e2e.test.ts). The Python package expects the same warning. */
const EXPECTED_WARNINGS: Record<string, string[]> = {
  'input-required-result-ignore-extra-params': ['sep-2322-ignore-unexpected-params'],
};

let stateseal: { proc: ChildProcess; addr: string };
let grpc: RequestStateClient;
let http: HttpServer;
const cwd = mkdtempSync(join(tmpdir(), 'stateseal-conformance-'));

before(async () => {
  stateseal = await startStateseal();
  grpc = new RequestStateClient(stateseal.addr);
  const quiet = { info() {}, warn() {}, error() {} };
  const boundary = new StatesealBoundary(grpc, { audience: 'stateseal-conformance', logger: quiet });
  http = await serveHttp(() => conformanceServer(boundary), 0);
});

after(() => {
  http?.close();
  grpc?.close();
  stateseal?.proc.kill('SIGTERM');
});

test('the suite lists exactly these 14 MRTR server scenarios', async () => {
  const { stdout } = await run(process.execPath, ['--import', shim, suite, 'list'], { cwd });
  const listed = [...new Set(stdout.match(/input-required-result-[a-z-]+/g) ?? [])].sort();
  assert.deepEqual(listed, [...SCENARIOS].sort());
});

for (const scenario of SCENARIOS) {
  test(scenario, async () => {
    const url = `http://127.0.0.1:${port(http)}/mcp`;
    const { stdout } = await run(process.execPath, ['--import', shim, suite, 'server', '--url', url, '--scenario', scenario], {
      cwd,
      timeout: 120_000,
    }).catch((e: { stdout?: string; stderr?: string }) => {
      assert.fail(`${scenario}: the suite failed\n${e.stdout ?? ''}${e.stderr ?? ''}`);
    });
    const m = /Passed: (\d+)\/(\d+), (\d+) failed, (\d+) warnings/.exec(stdout);
    assert.ok(m, `${scenario}: no summary\n${stdout}`);
    // A scenario that ran no check proves nothing: "Passed: 0/0" fails.
    assert.ok(Number(m[2]) > 0, `${scenario}: no check ran\n${stdout}`);
    assert.equal(m[1], m[2], stdout);
    assert.equal(m[3], '0', stdout);
    const expected = EXPECTED_WARNINGS[scenario] ?? [];
    assert.equal(m[4], String(expected.length), stdout);
    const warned = [...stdout.matchAll(/\[([a-z0-9-]+)\s*\]\s*(?:\x1b\[[0-9;]*m)?WARNING/g)].map((w) => w[1]);
    assert.deepEqual(warned, expected, stdout);
  });
}
