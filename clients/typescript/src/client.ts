// A typed client for stateseal.v1.RequestState: messages encoded by
// protobufjs from proto/ (read at run time, as no code is generated), calls
// over this package's own unary gRPC transport (transport.ts). The message
// types are generated from proto/ at build time.

import protobuf from 'protobufjs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

import type { OpenResponse__Output } from './_proto/stateseal/v1/OpenResponse.js';
import type { RenewResponse__Output } from './_proto/stateseal/v1/RenewResponse.js';
import type { SealResponse__Output } from './_proto/stateseal/v1/SealResponse.js';
import { BINDING_VERSION, type BindableMethod } from './binding.js';
import { CallError, Channel, Status, type TlsOptions } from './transport.js';

const PROTO = join(dirname(fileURLToPath(import.meta.url)), '..', '..', 'proto');

type Rpc = 'Seal' | 'Open' | 'Commit' | 'Renew' | 'Release';
type Codec = { request: protobuf.Type; response: protobuf.Type; path: string };

let loaded: Record<Rpc, Codec> | undefined;
function codecs(): Record<Rpc, Codec> {
  if (loaded) return loaded;
  const root = new protobuf.Root().loadSync(join(PROTO, 'stateseal', 'v1', 'stateseal.proto'), { keepCase: true });
  const service = root.lookupService('stateseal.v1.RequestState');
  const out = {} as Record<Rpc, Codec>;
  for (const name of ['Seal', 'Open', 'Commit', 'Renew', 'Release'] as const) {
    const m = service.methods[name];
    m.resolve();
    out[name] = { request: m.resolvedRequestType!, response: m.resolvedResponseType!, path: `/stateseal.v1.RequestState/${name}` };
  }
  loaded = out;
  return out;
}

/** How a response message is turned into an object: the shapes of the
 * generated `__Output` types. */
const AS_OBJECT: protobuf.IConversionOptions = { longs: Number, enums: String, defaults: true, oneofs: true };

/** Reasons of `google.rpc.ErrorInfo` (domain "stateseal") that mean the
 * caller's input is at fault. */
const CLIENT_FAULTS = new Set([
  'MALFORMED',
  'TOO_LARGE',
  'BAD_METHOD',
  'EXPIRED',
  'REPLAYED',
  'UNKNOWN_KEY',
  'REJECTED',
  'IN_USE',
  'LEASE_EXPIRED',
  'BAD_INPUT_REQUESTS',
]);
/** Reasons that are transient: retry later or elsewhere. */
const TRANSIENT = new Set(['LEDGER_UNAVAILABLE', 'CLOCK_UNSYNCED', 'OVERLOADED', 'AUDIT_UNAVAILABLE']);
/** gRPC statuses without a stateseal reason (the transport answered, not
 * stateseal) that what the caller sent causes: a message over the service's
 * size limit (tonic answers OUT_OF_RANGE). */
const TRANSPORT_CLIENT_FAULTS = new Set(['OUT_OF_RANGE']);
/** gRPC statuses without a stateseal reason that are transient: the
 * service is unreachable, late, or out of some resource. */
const TRANSPORT_TRANSIENT = new Set(['UNAVAILABLE', 'DEADLINE_EXCEEDED', 'RESOURCE_EXHAUSTED']);

/** A failed stateseal call. `reason` is the ErrorInfo reason when stateseal
 * answered, else the gRPC status name (e.g. `UNAVAILABLE`). Never carries a
 * token or state. */
export class StatesealError extends Error {
  constructor(
    readonly reason: string,
    readonly code: Status,
    /** True when stateseal itself answered with a reason. */
    readonly fromStateseal: boolean,
  ) {
    super(`stateseal: ${reason}`);
    this.name = 'StatesealError';
  }
  /** The caller's input (token, binding, questions, answers, or a message
   * too large for the service) was refused. */
  get clientFault(): boolean {
    if (this.fromStateseal) return CLIENT_FAULTS.has(this.reason);
    return TRANSPORT_CLIENT_FAULTS.has(Status[this.code]);
  }
  /** Worth retrying later: a transient stateseal condition, or the
   * transport (`UNAVAILABLE`, `DEADLINE_EXCEEDED`, `RESOURCE_EXHAUSTED`). */
  get retryable(): boolean {
    if (this.fromStateseal) return TRANSIENT.has(this.reason);
    return TRANSPORT_TRANSIENT.has(Status[this.code]);
  }
}

// Minimal protobuf reading of google.rpc.Status → Any → ErrorInfo.
function fields(buf: Buffer): Array<[number, Buffer]> {
  const out: Array<[number, Buffer]> = [];
  let i = 0;
  const varint = (): number => {
    let v = 0;
    let shift = 0;
    for (;;) {
      if (i >= buf.length) throw new Error('truncated');
      const b = buf[i++];
      v += (b & 0x7f) * 2 ** shift;
      if (b < 0x80) return v;
      shift += 7;
    }
  };
  while (i < buf.length) {
    const tag = varint();
    const wire = tag & 7;
    if (wire === 2) {
      const len = varint();
      out.push([tag >>> 3, buf.subarray(i, i + len)]);
      i += len;
    } else if (wire === 0) {
      varint();
    } else {
      throw new Error('unexpected wire type');
    }
  }
  return out;
}

function reasonOf(details: Buffer | undefined): string | undefined {
  if (!details) return undefined;
  try {
    for (const [n, any] of fields(details)) {
      if (n !== 3) continue;
      const f = fields(any);
      const type = f.find(([k]) => k === 1)?.[1].toString();
      const value = f.find(([k]) => k === 2)?.[1];
      if (type !== 'type.googleapis.com/google.rpc.ErrorInfo' || !value) continue;
      const info = fields(value);
      const reason = info.find(([k]) => k === 1)?.[1].toString();
      const domain = info.find(([k]) => k === 2)?.[1].toString();
      if (domain === 'stateseal' && reason) return reason;
    }
  } catch {
    return undefined;
  }
  return undefined;
}

function toError(err: CallError): StatesealError {
  const reason = reasonOf(err.details);
  if (reason !== undefined) return new StatesealError(reason, err.code, true);
  return new StatesealError(Status[err.code] ?? 'UNKNOWN', err.code, false);
}

export interface ClientOptions {
  /** TLS (`{ ca }`) or mTLS (`{ ca, key, cert }`, PEM); plaintext when
   * absent. */
  tls?: TlsOptions;
  /** Sent as `authorization: Bearer …` (use with TLS off loopback). */
  bearer?: string;
  /** Deadline of each call, in milliseconds (default 5000). */
  timeoutMs?: number;
}

export interface Binding {
  subject: string;
  method: BindableMethod;
  /** The binding-v2 digest (see `paramsDigest`), or the params JSON for the
   * service to digest. */
  paramsDigest?: Buffer;
  paramsJson?: string;
}

export interface Sealed {
  requestState: string;
  expiresAtUnix: number;
  keyId: string;
}

/** A renewed lease (see `RequestStateClient.renew`). */
export interface Lease {
  /** When the renewed lease ends, on stateseal's clock (for display only). */
  leaseExpiresAtUnix: number;
  /** The lease granted from now, in seconds. */
  leaseSeconds: number;
}

export interface Opened {
  state: Buffer;
  expiresAtUnix: number;
  keyId: string;
  consumed: boolean;
  /** OPEN_MODE_RESERVE on a single-use token: for renew(), commit() or
   * release(). */
  reservation: string;
  /** When the lease ends, on stateseal's (ledger's) clock: for display
   * only — never compare it with local time. */
  leaseExpiresAtUnix: number;
  /** OPEN_MODE_RESERVE: the lease granted, in seconds (renew every third of
   * it); 0 when no reservation was made. */
  leaseSeconds: number;
  /** With `inputResponsesJson`: the answers filtered against the token's
   * manifest (as sent when it has none). */
  inputResponsesJson: string;
  dropped: Array<{ key: string; reason: string }>;
  /** One per reservation the call carried (`commit`), in order: null when
   * committed, else the StatesealError a Commit would have rejected with. */
  commits: Array<StatesealError | null>;
}

/** The most reservations one Open may carry to commit (the service's
 * bound). */
export const MAX_CARRIED_COMMITS = 16;

function wireBinding(b: Binding) {
  if (b.paramsDigest) {
    return {
      subject: b.subject,
      method: b.method,
      params_digest: b.paramsDigest,
      binding_version: BINDING_VERSION,
    };
  }
  return { subject: b.subject, method: b.method, params_json: b.paramsJson ?? '' };
}

/** The stateseal client. One channel, shared by every call. */
export class RequestStateClient {
  readonly #channel: Channel;
  readonly #timeoutMs: number;

  constructor(address: string, options: ClientOptions = {}) {
    const headers: Record<string, string> = {};
    if (options.bearer !== undefined) headers.authorization = `Bearer ${options.bearer}`;
    this.#channel = new Channel(address, { tls: options.tls, headers });
    this.#timeoutMs = options.timeoutMs ?? 5000;
    if (!(Number.isFinite(this.#timeoutMs) && this.#timeoutMs > 0)) {
      throw new RangeError('timeoutMs must be a positive, finite number of milliseconds');
    }
    codecs();
  }

  async #call<Res>(rpc: Rpc, req: object, waitForReady = false, timeoutMs = this.#timeoutMs): Promise<Res> {
    const c = codecs()[rpc];
    const body = c.request.encode(c.request.fromObject(req)).finish();
    let answer: Buffer;
    try {
      answer = await this.#channel.call(c.path, body, timeoutMs, waitForReady);
    } catch (e) {
      throw e instanceof CallError ? toError(e) : e;
    }
    let decoded: protobuf.Message;
    try {
      decoded = c.response.decode(answer);
    } catch {
      throw new StatesealError('INTERNAL', Status.INTERNAL, false);
    }
    return c.response.toObject(decoded, AS_OBJECT) as Res;
  }

  async seal(req: {
    binding: Binding;
    state: Buffer | Uint8Array;
    ttlSeconds?: number;
    singleUse?: boolean;
    /** The input_required result's `inputRequests` (JSON), sealed as the
     * token's manifest. The default, `{}`, asks nothing: Open drops every
     * answer. `''` seals no manifest and Open passes answers through
     * unfiltered: never for a round that asks. */
    inputRequestsJson?: string;
  }): Promise<Sealed> {
    const r = await this.#call<SealResponse__Output>('Seal', {
      binding: wireBinding(req.binding),
      state: req.state,
      ttl_seconds: req.ttlSeconds ?? 0,
      single_use: req.singleUse ?? false,
      input_requests_json: req.inputRequestsJson ?? '{}',
    });
    return { requestState: r.request_state, expiresAtUnix: r.expires_at_unix, keyId: r.key_id };
  }

  async open(req: {
    requestState: string;
    binding: Binding;
    reserve?: boolean;
    leaseSeconds?: number;
    attemptId?: string;
    inputResponsesJson?: string;
    /** Reservations of earlier Opens (at most MAX_CARRIED_COMMITS) to commit
     * in the same call, each as commit() would; their outcomes are in
     * `commits`. When this call rejects, whether they were committed is
     * unknown: commit() them again (it is idempotent). */
    commit?: string[];
  }): Promise<Opened> {
    const commit = req.commit ?? [];
    if (commit.length > MAX_CARRIED_COMMITS) throw new RangeError(`at most ${MAX_CARRIED_COMMITS} reservations per open`);
    if (commit.some((r) => r.includes(','))) throw new RangeError('a reservation never contains a comma');
    const r = await this.#call<OpenResponse__Output>('Open', {
      request_state: req.requestState,
      binding: wireBinding(req.binding),
      mode: req.reserve ? 'OPEN_MODE_RESERVE' : 'OPEN_MODE_CONSUME',
      lease_seconds: req.leaseSeconds ?? 0,
      attempt_id: req.attemptId ?? '',
      input_responses_json: req.inputResponsesJson ?? '',
      commit: commit.join(','),
    });
    return {
      state: r.state,
      expiresAtUnix: r.expires_at_unix,
      keyId: r.key_id,
      consumed: r.consumed,
      reservation: r.reservation,
      leaseExpiresAtUnix: r.lease_expires_at_unix,
      leaseSeconds: r.lease_seconds,
      inputResponsesJson: r.input_responses_json,
      dropped: r.dropped.map((d) => ({ key: d.key, reason: d.reason })),
      commits: r.commits.map((o) => (o.reason ? new StatesealError(o.reason, o.code as Status, true) : null)),
    };
  }

  /** Makes a reservation a durable consumption (idempotent). `timeoutMs`:
   * this call's deadline, never more than the client's `timeoutMs`
   * (absent: the client's); the boundary gives each try a third of the
   * lease, which it renews between tries. */
  async commit(reservation: string, timeoutMs?: number): Promise<void> {
    if (timeoutMs !== undefined && !(timeoutMs > 0)) throw new RangeError('timeoutMs must be a positive number of milliseconds');
    await this.#call('Commit', { reservation }, false, Math.min(timeoutMs ?? this.#timeoutMs, this.#timeoutMs));
  }

  /** Extends a reservation's lease by `leaseSeconds` from now (0 = the
   * server default; capped by the server). Fails with `LEASE_EXPIRED` once
   * another attempt took the token over, or the reservation was released or
   * collected. `timeoutMs`: this call's deadline, never more than the
   * client's `timeoutMs` (absent: the client's); a renewal that outlives
   * its lease is of no use, so keep it well within the lease. */
  async renew(reservation: string, leaseSeconds = 0, timeoutMs?: number): Promise<Lease> {
    if (timeoutMs !== undefined && !(timeoutMs > 0)) throw new RangeError('timeoutMs must be a positive number of milliseconds');
    const r = await this.#call<RenewResponse__Output>(
      'Renew',
      { reservation, lease_seconds: leaseSeconds },
      false,
      Math.min(timeoutMs ?? this.#timeoutMs, this.#timeoutMs),
    );
    return { leaseExpiresAtUnix: r.lease_expires_at_unix, leaseSeconds: r.lease_seconds };
  }

  async release(reservation: string): Promise<void> {
    // Clean-up after a failure, which may have been the connection itself.
    await this.#call('Release', { reservation }, true);
  }

  close(): void {
    this.#channel.close();
  }

  toString(): string {
    return 'RequestStateClient(..)';
  }
}
