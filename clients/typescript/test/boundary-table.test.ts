// The boundary's answers to failed stateseal calls against the table both
// packages share, clients/boundary.json: every stateseal reason and every
// gRPC status without one, under every setting of onReplay and reask.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { Status } from '../src/transport.js';

import { StatesealError, callRefusal, openRefusal, renewalLost, resend, retryCommit } from '../src/index.js';
import type { Refusal } from '../src/index.js';

interface Row {
  kind: string;
  code?: number;
  message?: string;
  data?: Record<string, string> | null;
  log: string;
}
interface Case {
  error: { reason: string; code: string; from_stateseal: boolean };
  open: { config: { on_replay: 'error' | 'reask'; reask: boolean }; then: Row }[];
  seal: Row;
  resend_open_or_release: boolean;
  retry_commit: boolean;
  renewal_lost: boolean;
}

// Compiled to dist/test/: the repository's root is four levels up.
const root = new URL('../../../../', import.meta.url);
const table = JSON.parse(readFileSync(new URL('clients/boundary.json', root), 'utf8')) as { cases: Case[] };
const reasons = JSON.parse(readFileSync(new URL('proto/stateseal/v1/reasons.json', root), 'utf8')) as {
  reasons: { reason: string; code: string }[];
};
const codes = Status as unknown as Record<string, Status>;

function asRow(r: Refusal): Row {
  if (r.kind === 'reask') return { kind: r.kind, log: r.log };
  return { kind: r.kind, code: r.code, message: r.message, data: r.data ?? null, log: r.log };
}

test('the table covers every reason and every status', () => {
  const seen = new Set(table.cases.map((c) => `${c.error.reason}/${c.error.from_stateseal}`));
  for (const r of reasons.reasons) assert.ok(seen.has(`${r.reason}/true`), r.reason);
  for (const [name, code] of Object.entries(codes)) {
    if (typeof code !== 'number' || name === 'OK') continue;
    assert.ok(seen.has(`${name}/false`), name);
  }
});

for (const c of table.cases) {
  const where = c.error.from_stateseal ? 'stateseal' : 'transport';
  test(`${c.error.reason} (${where}) is answered as the table says`, () => {
    const code = codes[c.error.code];
    assert.notEqual(code, undefined, c.error.code);
    const e = new StatesealError(c.error.reason, code, c.error.from_stateseal);
    for (const o of c.open) {
      const got = asRow(openRefusal(e, { onReplay: o.config.on_replay, reask: o.config.reask }));
      assert.deepEqual(got, o.then, JSON.stringify(o.config));
    }
    assert.deepEqual(asRow(callRefusal(e, true)), c.seal);
    assert.equal(resend(e), c.resend_open_or_release);
    assert.equal(retryCommit(e), c.retry_commit);
    assert.equal(renewalLost(e), c.renewal_lost);
  });
}
