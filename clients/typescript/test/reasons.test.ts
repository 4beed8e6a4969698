// The package's reason tables against the one source,
// proto/stateseal/v1/reasons.json: every reason the service gives is either a
// client fault or transient here, exactly as that file says.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { test } from 'node:test';

import { Status } from '../src/transport.js';

import { StatesealError } from '../src/index.js';

interface Source {
  transport: { client: string[]; transient: string[] };
  reasons: { reason: string; code: string; message: string; side: string }[];
}

// Compiled to dist/test/: the repository's root is four levels up.
const source = JSON.parse(
  readFileSync(new URL('../../../../proto/stateseal/v1/reasons.json', import.meta.url), 'utf8'),
) as Source;

test('reasons match the one source', () => {
  assert.ok(source.reasons.length > 0, 'no reasons in the source');
  const codes = Status as unknown as Record<string, Status>;
  for (const r of source.reasons) {
    const code = codes[r.code];
    assert.notEqual(code, undefined, r.code);
    const e = new StatesealError(r.reason, code, true);
    assert.equal(e.clientFault, r.side === 'client', r.reason);
    assert.equal(e.retryable, r.side === 'transient', r.reason);
  }
  // A reason the source does not list is neither.
  assert.equal(new StatesealError('NOT_A_REASON', Status.UNKNOWN, true).clientFault, false);
  for (const [name, code] of Object.entries(codes)) {
    if (typeof code !== 'number') continue;
    const e = new StatesealError(name, code, false);
    assert.equal(e.clientFault, source.transport.client.includes(name), name);
    assert.equal(e.retryable, source.transport.transient.includes(name), name);
  }
});
