// The stateseal MCP binding profile (README "MCP binding profile",
// docs/token-format.md): the params digest (binding v2) and the subject,
// computed exactly as the service and the Python package compute them.
// Tested against the service's tests/data/binding-vectors.json.

import { createHash } from 'node:crypto';

/** The binding version this module computes. */
export const BINDING_VERSION = 2;

/** Deepest nesting of arrays and objects accepted (as the service). */
const MAX_DEPTH = 128;

/** Thrown for params the service would refuse as MALFORMED. */
export class BindingError extends Error {
  constructor() {
    super('params cannot be bound (not one well-formed JSON object of the required shape)');
    this.name = 'BindingError';
  }
}

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/;

/** True when `s` has no lone surrogate, so that UTF-8 (and the wire) can
 * carry it unchanged. */
export function isWellFormed(s: string): boolean {
  return !LONE_SURROGATE.test(s);
}

const NUMBER = /-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/y;

/** Sign, significant digits (no leading or trailing zeros; empty for zero)
 * and decimal exponent of a JSON number literal or an ECMAScript number
 * string. */
function decimal(text: string): { neg: boolean; digits: string; exp: number } {
  const m = /^(-?)([0-9]*)(?:\.([0-9]*))?(?:[eE]([+-]?[0-9]+))?$/.exec(text);
  if (!m) throw new BindingError();
  const frac = m[3] ?? '';
  let digits = (m[2] + frac).replace(/^0+/, '');
  let exp = Number(m[4] ?? '0') - frac.length;
  const trimmed = digits.replace(/0+$/, '');
  exp += digits.length - trimmed.length;
  digits = trimmed;
  if (digits === '') return { neg: false, digits: '', exp: 0 };
  return { neg: m[1] === '-', digits, exp };
}

/** The exact canonical form of a JSON number literal: RFC 8785 (ECMAScript)
 * form when the literal's value is exactly that of the double ECMAScript
 * prints for it, else `[-]DIGITS E EXPONENT`. Two different values never
 * share a form; no valid JSON number is refused. */
export function canonicalNumber(literal: string): string {
  const exact = decimal(literal);
  const d = Number(literal);
  if (Number.isFinite(d)) {
    const es = Object.is(d, -0) ? '0' : String(d);
    const back = decimal(es);
    if (back.neg === exact.neg && back.digits === exact.digits && back.exp === exact.exp) {
      return es;
    }
  }
  return `${exact.neg ? '-' : ''}${exact.digits}E${exact.exp}`;
}

class Parser {
  i = 0;
  constructor(readonly s: string) {}

  ws(): void {
    while (this.i < this.s.length) {
      const c = this.s.charCodeAt(this.i);
      if (c === 0x20 || c === 0x09 || c === 0x0a || c === 0x0d) this.i++;
      else break;
    }
  }

  /** A string token, decoded. */
  string(): string {
    if (this.s[this.i] !== '"') throw new BindingError();
    let j = this.i + 1;
    while (j < this.s.length) {
      const c = this.s[j];
      if (c === '\\') j += 2;
      else if (c === '"') break;
      else j++;
    }
    if (j >= this.s.length) throw new BindingError();
    let v: string;
    try {
      v = JSON.parse(this.s.slice(this.i, j + 1)) as string;
    } catch {
      throw new BindingError();
    }
    if (LONE_SURROGATE.test(v)) throw new BindingError();
    this.i = j + 1;
    return v;
  }

  /** The canonical text of the value at the cursor. */
  value(depth: number): string {
    this.ws();
    const c = this.s[this.i];
    if (c === '{' || c === '[') {
      if (depth >= MAX_DEPTH) throw new BindingError();
      return c === '{' ? this.object(depth + 1) : this.array(depth + 1);
    }
    if (c === '"') return JSON.stringify(this.string());
    for (const lit of ['true', 'false', 'null']) {
      if (this.s.startsWith(lit, this.i)) {
        this.i += lit.length;
        return lit;
      }
    }
    NUMBER.lastIndex = this.i;
    const m = NUMBER.exec(this.s);
    if (!m) throw new BindingError();
    this.i += m[0].length;
    return canonicalNumber(m[0]);
  }

  members(depth: number): Map<string, string> {
    const out = new Map<string, string>();
    this.i++; // '{'
    this.ws();
    if (this.s[this.i] === '}') {
      this.i++;
      return out;
    }
    for (;;) {
      this.ws();
      const key = this.string();
      this.ws();
      if (this.s[this.i] !== ':') throw new BindingError();
      this.i++;
      if (out.has(key)) throw new BindingError();
      out.set(key, this.value(depth));
      this.ws();
      const c = this.s[this.i++];
      if (c === '}') return out;
      if (c !== ',') throw new BindingError();
    }
  }

  object(depth: number): string {
    const m = this.members(depth);
    // RFC 8785: keys ordered by UTF-16 code units (the default sort).
    const keys = [...m.keys()].sort();
    return `{${keys.map((k) => `${JSON.stringify(k)}:${m.get(k)}`).join(',')}}`;
  }

  array(depth: number): string {
    this.i++; // '['
    this.ws();
    const items: string[] = [];
    if (this.s[this.i] === ']') {
      this.i++;
      return '[]';
    }
    for (;;) {
      items.push(this.value(depth));
      this.ws();
      const c = this.s[this.i++];
      if (c === ']') return `[${items.join(',')}]`;
      if (c !== ',') throw new BindingError();
    }
  }

  end(): void {
    this.ws();
    if (this.i !== this.s.length) throw new BindingError();
  }
}

/** RFC 8785 with exact numbers, of one JSON text. */
export function canonicalize(json: string): string {
  const p = new Parser(json);
  const out = p.value(0);
  p.end();
  return out;
}

/** The MCP methods that may return `input_required`. */
export type BindableMethod = 'tools/call' | 'prompts/get' | 'resources/read';

/** The binding-v2 params digest (32 bytes) of the params JSON text. */
export function paramsDigest(method: BindableMethod, paramsJson: string): Buffer {
  const p = new Parser(paramsJson);
  p.ws();
  if (p.s[p.i] !== '{') throw new BindingError();
  const members = p.members(1);
  p.end();
  let bound: string;
  if (method === 'resources/read') {
    const uri = members.get('uri');
    if (uri === undefined || !uri.startsWith('"')) throw new BindingError();
    bound = `{"uri":${uri}}`;
  } else if (method === 'tools/call' || method === 'prompts/get') {
    const name = members.get('name');
    if (name === undefined || !name.startsWith('"')) throw new BindingError();
    let args = members.get('arguments');
    if (args === undefined || args === 'null') args = '{}';
    if (!args.startsWith('{')) throw new BindingError();
    bound = `{"arguments":${args},"name":${name}}`;
  } else {
    throw new BindingError();
  }
  return createHash('sha256').update(bound, 'utf8').digest();
}

/** The digest of params as a handler sees them (already parsed). */
export function paramsDigestOf(method: BindableMethod, params: Record<string, unknown>): Buffer {
  let text: string;
  try {
    text = JSON.stringify(params);
  } catch {
    throw new BindingError();
  }
  return paramsDigest(method, text);
}

/** JSON as Python's `json.dumps(value, separators=(",", ":"))` writes it
 * (ASCII only: every non-ASCII UTF-16 unit as `\uXXXX`). */
export function asciiJson(value: unknown): string {
  return JSON.stringify(value).replace(
    /[\u0080-\uffff]/g,
    (c) => `\\u${c.charCodeAt(0).toString(16).padStart(4, '0')}`,
  );
}

/** The binding subject: `"mcp:" + hex(SHA-256(JSON [audience, principal]))`,
 * identical to the Python package's. */
export function subjectFor(audience: string, principal: string | null): string {
  if (LONE_SURROGATE.test(audience) || (principal !== null && LONE_SURROGATE.test(principal))) {
    throw new BindingError();
  }
  const ident = JSON.stringify([audience, principal]);
  return `mcp:${createHash('sha256').update(ident, 'utf8').digest('hex')}`;
}
