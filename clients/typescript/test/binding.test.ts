// Binding v2 computed in TypeScript against the service's vectors file.
import assert from 'node:assert/strict';
import { readFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

import { BindingError, type BindableMethod, canonicalNumber, paramsDigest, subjectFor } from '../src/index.js';

const here = dirname(fileURLToPath(import.meta.url));
const vectors = JSON.parse(
  readFileSync(join(here, '..', '..', '..', '..', 'tests', 'data', 'binding-vectors.json'), 'utf8'),
) as {
  vectors: Array<{ method: BindableMethod; params: string; digest_hex: string; note: string }>;
  refused: Array<{ method: BindableMethod; params: string; why: string }>;
};

test('every vector of tests/data/binding-vectors.json', () => {
  assert.ok(vectors.vectors.length > 20);
  for (const v of vectors.vectors) {
    assert.equal(paramsDigest(v.method, v.params).toString('hex'), v.digest_hex, v.note);
  }
});

test('every refused vector is refused', () => {
  assert.ok(vectors.refused.length > 0);
  for (const v of vectors.refused) {
    assert.throws(() => paramsDigest(v.method, v.params), BindingError, v.why);
  }
});

test('exact numbers', () => {
  assert.equal(canonicalNumber('9007199254740993'), '9007199254740993E0');
  assert.equal(canonicalNumber('9007199254740992'), '9007199254740992');
  assert.equal(canonicalNumber('1.00000000000000001'), '100000000000000001E-17');
  assert.equal(canonicalNumber('1e400'), '1E400');
  assert.equal(canonicalNumber('-0'), '0');
  assert.equal(canonicalNumber('1e21'), '1e+21');
  assert.equal(canonicalNumber('42.0'), '42');
});

test('subject matches the Python package', () => {
  // hashlib.sha256(json.dumps([audience, principal], separators=(",", ":"),
  //   ensure_ascii=False).encode()).hexdigest(), as clients/python computes it.
  const cases: Array<[string, string | null, string]> = [
    ['transfer-service', null, 'b38d9b19dbcdf908b7b429ef9990b3ec09537f9b4cbb3b6c9b49862cd943c347'],
    ['transfer-service', '["c",null,"ü"]', '10e5d7a890f146ff0ba8f1e469b5b1764095bdfe24853648c8983994d651e02b'],
    ['dienst-ü', '["c","i","s"]', '90f8c4fccfea5bcaea6e89c7ba9d05c672ff3ffe232d5a77e3c0b8c4aa37c1ad'],
  ];
  for (const [audience, principal, hex] of cases) {
    assert.equal(subjectFor(audience, principal), `mcp:${hex}`);
  }
});
