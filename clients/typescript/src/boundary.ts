// StatesealBoundary: wraps the low-level `tools/call`, `prompts/get` and
// `resources/read` handlers of an `@modelcontextprotocol/server` (≥ 2.4)
// McpServer so that every `requestState` is sealed, bound, filtered and
// single-use by stateseal.
//
// Why not `ServerOptions.requestState.verify`: the hook sees `ctx.mcpReq` but
// no params (not even the tool name), so it cannot check the params binding.
// The low-level handler sees the request's params as received (the tool name
// and the raw arguments, before schema parsing), `ctx.mcpReq.requestState()`
// (the raw wire string: leave the `verify` hook unset) and
// `ctx.mcpReq.inputResponses`; and what it throws reaches the client as a
// JSON-RPC error, where the SDK turns a tool callback's throw into an
// `isError` result.

import { createHash, randomBytes } from 'node:crypto';

import { Status as status } from './transport.js';
import { ProtocolError } from '@modelcontextprotocol/server';

import { asciiJson, type BindableMethod, BindingError, isWellFormed, paramsDigestOf, subjectFor } from './binding.js';
import { type Binding, type Opened, RequestStateClient, StatesealError } from './client.js';

const INVALID_PARAMS = -32602;
const INTERNAL_ERROR = -32603;

/** What the wrapper needs of the SDK's handler context. */
interface Ctx {
  mcpReq: {
    method: string;
    requestState: () => unknown;
    inputResponses?: Record<string, unknown>;
  };
  http?: { authInfo?: { clientId?: string; extra?: Record<string, unknown> } };
}

/** Where the boundary logs (default `console`). It never logs a token,
 * state or answer. `debug` is optional: without it, debug messages go
 * nowhere. */
export type Logger = Pick<Console, 'info' | 'warn' | 'error'> & { debug?: (message: string) => void };

/** How long an Open waits, at most, for the Commit (or Release) of its
 * token that this process still keeps after the handler's answer went out.
 * If it is still kept then, the Open is answered IN_USE (retryable) without
 * reaching stateseal: once the lease has run out, stateseal would let it
 * take the token over, and run the handler a second time. */
const COMMIT_WAIT_MS = 5000;
/** The pauses before an Open that found its token IN_USE is sent again (the
 * same attempt id): another replica's handler may have answered with its
 * Commit on the way. 375 ms in all, after which IN_USE is answered as such
 * (as in the Python package). */
const BUSY_WAITS_MS = [25, 50, 100, 200];
/** The Commits (and Releases) this process keeps after their handler
 * returned, by the SHA-256 of their token: what an Open of that token waits
 * for, whichever boundary (replica) it reached, and how to hurry it (send
 * it now if it still waits for a carrier, and end the pause before its next
 * try). */
const PENDING = new Map<string, { done: Promise<void>; hurry: () => void; what: 'commit' | 'release' }>();
/** The Opens on their way in this process, by the SHA-256 of their token:
 * how many, and whether a handler answered with that token meanwhile (then
 * an Open that gets the token does not run it again). */
const OPENING = new Map<string, { n: number; answered: boolean }>();

/** How long, by default, a returned handler's Commit (or a failed one's
 * Release) is tried again while it fails transiently, in milliseconds. */
export const DEFAULT_COMMIT_WINDOW_MS = 60_000;
/** How many Commits and Releases one boundary keeps at once, by default. */
export const DEFAULT_MAX_PENDING_COMMITS = 10_000;
/** The first pause before a kept Commit or Release is tried again, in
 * milliseconds; each next pause doubles, up to KEPT_RETRY_MAX_MS. */
const KEPT_RETRY_FIRST_MS = 50;
/** The longest pause between two tries of a kept Commit or Release. */
const KEPT_RETRY_MAX_MS = 500;

/** How long, by default, a Commit waits for a durable Open of the same
 * boundary to carry it before it is sent on its own, in milliseconds. */
export const DEFAULT_COMMIT_DELAY_MS = 25;
/** The most waiting Commits one Open carries: the service decides 4 at a
 * time, and the Open's answer waits for them. */
const CARRY_PER_OPEN = 4;
/** The longest `commitDelayMs`: below the 375 ms a replay on another
 * replica waits out IN_USE (BUSY_WAITS_MS), so that it sees the Commit. */
const MAX_COMMIT_DELAY_MS = 250;

interface Waiting {
  reservation: string;
  /** Its try's deadline if it goes on its own (absent: the client's). */
  timeoutMs: number | undefined;
  resolve: () => void;
  reject: (e: unknown) => void;
}

/** The Commits of one boundary waiting for a durable Open to carry them
 * (`OpenRequest.commit`, at most CARRY_PER_OPEN each), oldest first.
 * Whatever no Open has taken `delayMs` after the first of them was queued
 * is sent on its own, one Commit each, so no Commit waits longer than that
 * for a carrier. */
class Carrier {
  #waiting: Waiting[] = [];
  #timer: NodeJS.Timeout | undefined;
  /** drain() calls under way: a Commit queued meanwhile goes at once. */
  draining = 0;

  constructor(
    readonly client: RequestStateClient,
    readonly delayMs: number,
  ) {}

  /** Queues a Commit; resolves or rejects with its outcome, as a Commit
   * would. */
  commit(reservation: string, timeoutMs?: number): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const w = { reservation, timeoutMs, resolve, reject };
      if (this.draining > 0) {
        this.send([w]);
        return;
      }
      this.#waiting.push(w);
      this.#timer ??= setTimeout(() => this.sendAll(), this.delayMs);
    });
  }

  /** The oldest waiting Commits, for an Open to carry. */
  take(): Waiting[] {
    const taken = this.#waiting.splice(0, CARRY_PER_OPEN);
    if (this.#waiting.length === 0) this.#stopTimer();
    return taken;
  }

  /** Ends each carried Commit with its outcome from the Open's answer. One
   * the answer does not name (a server that does not know carried commits)
   * is sent on its own. */
  settle(taken: Waiting[], outcomes: Array<StatesealError | null>): void {
    taken.forEach((w, i) => {
      if (i >= outcomes.length) return;
      const o = outcomes[i];
      if (o === null) w.resolve();
      else w.reject(o);
    });
    this.send(taken.slice(outcomes.length));
  }

  /** Sends every waiting Commit on its own, now. */
  sendAll(): void {
    const taken = this.#waiting;
    this.#waiting = [];
    this.#stopTimer();
    this.send(taken);
  }

  /** Sends each of `taken` as a Commit of its own. */
  send(taken: Waiting[]): void {
    for (const w of taken) this.client.commit(w.reservation, w.timeoutMs).then(w.resolve, w.reject);
  }

  #stopTimer(): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    this.#timer = undefined;
  }
}

/** `p`, or a DEADLINE_EXCEEDED failure (as the transport's) once `ms` have
 * passed; the timer never keeps the process alive. */
function within<T>(p: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const expired = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new StatesealError('DEADLINE_EXCEEDED', status.DEADLINE_EXCEEDED, false)), ms);
    timer.unref();
  });
  p.catch(() => undefined); // an outcome after the deadline is not waited for
  return Promise.race([p, expired]).finally(() => clearTimeout(timer));
}

const sleep = (ms: number) =>
  new Promise<void>((resolve) => {
    setTimeout(resolve, ms).unref();
  });

/** The shortest renewal period, in milliseconds. */
const MIN_RENEW_MS = 500;
/** The shortest deadline of a Renew, or of one try of a Commit, in
 * milliseconds. Each gets a third of the lease granted (at least this, and
 * never more than the client's `timeoutMs`): a Renew that hangs is
 * abandoned, and the next one sent at once, while the lease still runs; a
 * Commit try that hangs leaves the lease time to be renewed before the
 * next. With the client's 5 s deadline a hung Renew outlasted a 2 s lease
 * (issue 58, finding 5). */
const MIN_RENEW_DEADLINE_MS = 250;

/** The pause between two tries of a kept Commit or Release, which an Open
 * of its token in this process ends early (`wake`). Its timer never keeps
 * the process alive: `drain()` is what waits. */
class Pause {
  #wake: (() => void) | undefined;

  wait(ms: number): Promise<void> {
    return new Promise<void>((resolve) => {
      const timer = setTimeout(() => this.wake(), ms);
      timer.unref();
      this.#wake = () => {
        clearTimeout(timer);
        this.#wake = undefined;
        resolve();
      };
    });
  }

  wake(): void {
    this.#wake?.();
  }
}

/** Keeps one reservation's lease: renews it every third of the lease
 * stateseal granted (the granted seconds, never local time against the
 * lease's end) from the Open until its Commit gets a definite answer, or
 * until the Release. Each Renew's deadline is that third too (at least
 * MIN_RENEW_DEADLINE_MS, at most the client's), counted from when it was
 * sent, as is the next one: due a third after a Renew that landed was
 * sent, and once the deadline of one that failed has passed. So a Renew
 * that hangs is abandoned and the next goes at once (on a new connection:
 * the transport stops using one that let a call run out its deadline): two
 * Renews are tried within every lease. Renewals and
 * Commit tries go one at a time (`exclusive`), so that no Renew reaches
 * stateseal after the Commit (it would answer LEASE_EXPIRED there, and
 * count a lost lease). The timer never keeps the process alive. */
class LeaseKeeper {
  /** `running`: the handler runs, and a lost renewal is an operator alarm.
   * `finishing`: it returned and its Commit is being tried; the Commit's
   * answer, not a renewal's, says whether the token was taken over.
   * `stopped`: no renewal any more. */
  #phase: 'running' | 'finishing' | 'stopped' = 'running';
  #timer: NodeJS.Timeout | undefined;
  /** The renewal or Commit try in flight (settled when none is). */
  #lane: Promise<unknown> = Promise.resolve();

  constructor(
    readonly client: RequestStateClient,
    readonly reservation: string,
    /** The lease asked for at each renewal, in seconds (0 = the service's
     * default). */
    readonly asked: number,
    /** The lease granted last, in seconds (0: a service older than Renew,
     * which gets no renewals). */
    public granted: number,
    readonly method: string,
    readonly log: Logger,
  ) {
    if (granted > 0) this.#schedule();
  }

  /** Runs `call` (a Commit try) with no renewal in flight; none starts until
   * it has settled. */
  exclusive<T>(call: () => Promise<T>): Promise<T> {
    const p = this.#lane.then(call);
    this.#lane = p.catch(() => undefined);
    return p;
  }

  /** The handler returned: from now on its Commit's answer tells whether
   * the token was taken over. */
  finishing(): void {
    if (this.#phase === 'running') this.#phase = 'finishing';
  }

  /** No renewal is sent after this call. */
  stopNow(): void {
    this.#phase = 'stopped';
    clearTimeout(this.#timer);
  }

  /** No renewal is sent after this call; resolves once none is in flight. */
  async stop(): Promise<void> {
    this.stopNow();
    await this.#lane;
  }

  #interval(): number {
    return Math.max(MIN_RENEW_MS, (this.granted * 1000) / 3);
  }

  /** The deadline of a Renew, and of a Commit try: a third of the lease
   * granted last (at least MIN_RENEW_DEADLINE_MS; the client caps it at its
   * own), never longer than the interval, so Renews never overlap. Absent
   * when stateseal granted no lease length (the client's deadline). */
  deadlineMs(): number | undefined {
    return this.granted > 0 ? Math.max(MIN_RENEW_DEADLINE_MS, (this.granted * 1000) / 3) : undefined;
  }

  #schedule(delayMs = this.#interval()): void {
    this.#timer = setTimeout(() => void this.#renew(), delayMs);
    this.#timer.unref();
  }

  async #renew(): Promise<void> {
    let sent = performance.now();
    const deadlineMs = this.deadlineMs() ?? MIN_RENEW_DEADLINE_MS;
    let next = this.#interval();
    try {
      const lease = await this.exclusive(async () => {
        if (this.#phase === 'stopped') return undefined;
        sent = performance.now();
        return this.client.renew(this.reservation, this.asked, deadlineMs);
      });
      if (lease && lease.leaseSeconds > 0) this.granted = lease.leaseSeconds;
      // Due a third of the lease after this one was sent.
      next = this.#interval();
    } catch (e) {
      // Failed: the next goes once this one's deadline has passed, so at
      // once after a Renew that ran it out.
      next = deadlineMs;
      if (this.#phase === 'stopped') return;
      try {
        if (renewalLost(e)) {
          if (this.#phase === 'running') {
            this.log.error(`stateseal: reservation lost while the handler ran; another attempt may run it (${this.method})`);
          } else {
            // The handler returned: its Commit's answer says what happened.
            this.log.debug?.(`stateseal: renew on ${this.method} after the handler returned: LEASE_EXPIRED; renewing stops`);
          }
          this.#phase = 'stopped';
          return;
        }
        // The transport (or a transient stateseal condition): the lease
        // still runs; the next renewal may get through. Once the handler
        // returned, the kept Commit's warning has already said so.
        const line = `stateseal: renew on ${this.method} failed: ${reasonText(e)}; retrying`;
        if (this.#phase === 'running') this.log.warn(line);
        else this.log.debug?.(line);
      } catch {
        // The logger's own failure: renewing goes on.
      }
    }
    if (this.#phase !== 'stopped') this.#schedule(Math.max(0, sent + next - performance.now()));
  }
}

/** The longest `requestState` (UTF-8 bytes) sent to stateseal. The service
 * accepts a state of up to 64 KiB (`--max-state-bytes 65536`) sealed with a
 * manifest of up to 16 KiB into a token: base64url of header (9) + nonce
 * (24) + manifest (2 + 16384) + state + tag (16). Bounded with 512 bytes of
 * room for the fixed parts: ceil((65536 + 16384 + 512) * 4 / 3) = 109,910,
 * above the 109,295 the service itself admits, so no token it would open is
 * refused here. */
export const DEFAULT_MAX_REQUEST_STATE_BYTES = Math.ceil(((65536 + 16384 + 512) * 4) / 3);
/** The longest `inputResponses` JSON (UTF-8 bytes, as sent) sent to
 * stateseal: the service's `--max-input-bytes` default, 256 KiB. */
export const DEFAULT_MAX_INPUT_RESPONSES_BYTES = 256 * 1024;

/** Transport failures after which an Open (same attempt id) or a Release is
 * sent again: the connection was lost or the call timed out. */
const LOST = new Set<number>([status.UNAVAILABLE, status.DEADLINE_EXCEEDED]);

export interface BoundaryOptions {
  /** This MCP service's identity, the same on every replica (and in every
   * language): it enters the subject. */
  audience: string;
  /** The authenticated end user, or null. Default: the Python SDK's
   * `authenticated_principal` format — compact ASCII JSON of
   * `[clientId, extra.iss, extra.sub]` from `ctx.http.authInfo` — so that
   * Python and TypeScript replicas derive the same subject. */
  principal?: (ctx: Ctx) => string | null;
  /** Targets (tool/prompt names, resource URIs) whose tokens may open more
   * than once. Every other target is single-use. */
  reusable?: Iterable<string>;
  /** Targets consumed before the handler runs (at most once even if the
   * handler crashes; a failure costs the user's retry). The others are
   * reserved, then committed on success or released on failure. */
  atMostOnce?: Iterable<string>;
  /** What a request gets when its token was already used (`REPLAYED`) or
   * is held by an attempt still running (`IN_USE`). `'error'` (the
   * default): `REPLAYED` is `-32602 requestState already used` (data
   * `{reason: 'request_state_used'}`), `IN_USE` is the retryable `-32603
   * Request in progress; retry later` (data `{reason: 'in_progress'}`).
   * `'reask'`: the handler runs again without state and answers, so it asks
   * afresh (with `reask: false`, `-32602 Invalid or expired requestState`
   * instead). */
  onReplay?: 'error' | 'reask';
  /** On EXPIRED (and, with `onReplay: 'reask'`, on REPLAYED and IN_USE):
   * run the handler again without state and answers, so it asks afresh
   * (default true). False: `-32602 Invalid or expired requestState`. */
  reask?: boolean;
  /** When stateseal drops an answer to a question this server asked
   * (KIND_MISMATCH, INVALID_CONTENT): run the handler again without state
   * and answers, so it asks afresh (default true; the token is spent on
   * that fresh round). False: the handler gets the filtered answers with
   * that key missing. Unasked keys and stripped URL content never trigger
   * it: unrecognized information is ignored. */
  reaskOnInvalidAnswers?: boolean;
  /** Token lifetime in seconds (0 = the service default). */
  ttlSeconds?: number;
  /** Lease asked for when a token is reserved and at each renewal, in
   * seconds (0 = the service default, `--default-lease-s`; the service caps
   * it). While the handler runs, the boundary renews the lease every third
   * of what the service granted, each Renew with a deadline of that third
   * (at least 250 ms, at most the client's `timeoutMs`): one that hangs is
   * abandoned and the next sent at once, before the lease runs out. */
  leaseSeconds?: number;
  /** A `requestState` longer than this in UTF-8 bytes is refused with
   * `-32602 Invalid or expired requestState` before stateseal is called,
   * logged at debug only. Default `DEFAULT_MAX_REQUEST_STATE_BYTES`
   * (109,910: the longest token the service's default `--max-state-bytes`
   * admits, with room); keep it at or below what your stateseal accepts. */
  maxRequestStateBytes?: number;
  /** `inputResponses` whose JSON (as sent) is longer than this in UTF-8
   * bytes are refused with `-32602 Invalid params: inputResponses too
   * large` before stateseal is called, logged at debug only. Default
   * `DEFAULT_MAX_INPUT_RESPONSES_BYTES` (256 KiB, the service's
   * `--max-input-bytes` default). */
  maxInputResponsesBytes?: number;
  /** Milliseconds (0 to 250; default `DEFAULT_COMMIT_DELAY_MS`, 25) a
   * Commit waits for the next durable Open of this boundary (an Open of a
   * single-use target) to carry it (`OpenRequest.commit`), before it is
   * sent on its own. 0 sends each Commit on its own at once. The answer
   * never waits for it; what it costs is the window after a handler has
   * answered in which a crash of this process leaves the token reserved
   * rather than used: until its lease ends, after which a retry may run the
   * handler again. The delay widens that window by at most this, so keep it
   * far below the lease. `drain()` sends what is waiting at once. */
  commitDelayMs?: number;
  /** How long, in milliseconds, a returned handler's Commit is tried again
   * while it fails transiently (stateseal unreachable, its ledger or audit
   * log failing), with pauses from 50 ms doubling to 500 ms; the lease is
   * renewed meanwhile, until the Commit gets a definite answer. A failed
   * handler's Release is kept the same way. Default
   * `DEFAULT_COMMIT_WINDOW_MS` (60 s); never less than `leaseSeconds`, and
   * for each reservation at least the lease stateseal granted it. An outage
   * shorter than this never runs a handler that returned a second time
   * (but see the README's "What at most once means"). */
  commitWindowMs?: number;
  /** The most Commits and Releases this boundary keeps trying at once
   * (default `DEFAULT_MAX_PENDING_COMMITS`, 10,000). One more is tried
   * once, not kept: an error log line, counted in `commitsNotKept`. */
  maxPendingCommits?: number;
  logger?: Logger;
}

/** The Python SDK's default principal, computed from `authInfo`. */
export function defaultPrincipal(ctx: Ctx): string | null {
  const auth = ctx.http?.authInfo;
  if (!auth) return null;
  const iss = auth.extra?.iss;
  const sub = auth.extra?.sub;
  return asciiJson([
    auth.clientId ?? null,
    iss === undefined || iss === null ? null : String(iss),
    sub === undefined || sub === null ? null : String(sub),
  ]);
}

function isInputRequired(r: unknown): r is { resultType: 'input_required'; requestState?: unknown; inputRequests?: unknown } {
  return typeof r === 'object' && r !== null && (r as { resultType?: unknown }).resultType === 'input_required';
}

function hasQuestions(q: unknown): boolean {
  return typeof q === 'object' && q !== null && Object.keys(q).length > 0;
}

function isErrorResult(r: unknown): boolean {
  return typeof r === 'object' && r !== null && (r as { isError?: unknown }).isError === true;
}

/** What the boundary answers when a stateseal call fails: run the request
 * again without its state (`kind: 'reask'`), or an MCP error, logged at
 * `log`. `kind` names the branch. clients/boundary.json is the table both
 * packages are tested against. */
export interface Refusal {
  kind: 'replayed' | 'in_use' | 'reask' | 'unavailable' | 'rejected' | 'internal';
  code?: number;
  message?: string;
  data?: Record<string, string>;
  log: 'info' | 'warn' | 'error';
}

/** The answer to a request whose token stateseal refused to open. */
export function openRefusal(e: StatesealError, opts: { onReplay: 'error' | 'reask'; reask: boolean }): Refusal {
  if (e.clientFault && opts.onReplay === 'error') {
    // Scanners send the completed retry twice and count any non-error
    // answer as an accepted replay; a client learns that its earlier retry
    // went through.
    if (e.reason === 'REPLAYED') {
      return { kind: 'replayed', code: INVALID_PARAMS, message: 'requestState already used', data: { reason: 'request_state_used' }, log: 'warn' };
    }
    // Another attempt with this token is running its handler.
    if (e.reason === 'IN_USE') {
      return { kind: 'in_use', code: INTERNAL_ERROR, message: 'Request in progress; retry later', data: { reason: 'in_progress' }, log: 'info' };
    }
  }
  const reaskOn = opts.onReplay === 'error' ? ['EXPIRED'] : ['REPLAYED', 'EXPIRED', 'IN_USE'];
  if (e.clientFault && opts.reask && reaskOn.includes(e.reason)) return { kind: 'reask', log: 'info' };
  return callRefusal(e, false);
}

/** The answer to any other failed stateseal call (`sealing`: the Seal of a
 * handler's result, where a client fault is this server's own). */
export function callRefusal(e: StatesealError, sealing: boolean): Refusal {
  if (e.retryable) return { kind: 'unavailable', code: INTERNAL_ERROR, message: 'Temporarily unavailable; retry', log: 'warn' };
  if (e.clientFault && !sealing) {
    // A message stateseal's transport refused as too large is the end
    // user's doing: not an operator alarm.
    return {
      kind: 'rejected',
      code: INVALID_PARAMS,
      message: 'Invalid or expired requestState',
      data: { reason: 'invalid_request_state' },
      log: e.fromStateseal ? 'warn' : 'info',
    };
  }
  return { kind: 'internal', code: INTERNAL_ERROR, message: 'Internal error', log: 'error' };
}

/** An Open (same attempt id) or a Release is sent again: the connection was
 * lost or the call timed out. */
export function resend(e: unknown): boolean {
  return e instanceof StatesealError && !e.fromStateseal && LOST.has(e.code);
}

/** A Commit (or a Release) is tried again (both are idempotent): any
 * transient failure. */
export function retryCommit(e: unknown): boolean {
  return e instanceof StatesealError && e.retryable;
}

/** Renewing stops: another attempt took the token over. */
export function renewalLost(e: unknown): boolean {
  return e instanceof StatesealError && e.fromStateseal && e.reason === 'LEASE_EXPIRED';
}

export class StatesealBoundary {
  readonly #client: RequestStateClient;
  readonly #audience: string;
  readonly #principal: (ctx: Ctx) => string | null;
  readonly #reusable: Set<string>;
  readonly #atMostOnce: Set<string>;
  readonly #reask: boolean;
  readonly #onReplay: 'error' | 'reask';
  readonly #lease: number;
  readonly #reaskInvalid: boolean;
  readonly #ttl: number;
  readonly #maxState: number;
  readonly #maxAnswers: number;
  readonly #log: Logger;
  /** Commits (and Releases) running after their handler's answer went out:
   * what drain() waits for. */
  readonly #committing = new Set<Promise<void>>();
  readonly #commitDelayMs: number;
  readonly #commitWindowMs: number;
  readonly #maxPending: number;
  /** How many of `#committing` are kept (retried through the window). */
  #kept = 0;
  #notKept = 0;
  /** The Commits waiting for a durable Open to carry them. */
  readonly #carrier: Carrier;

  constructor(client: RequestStateClient, options: BoundaryOptions) {
    this.#client = client;
    this.#audience = options.audience;
    this.#principal = options.principal ?? defaultPrincipal;
    this.#reusable = new Set(options.reusable ?? []);
    this.#atMostOnce = new Set(options.atMostOnce ?? []);
    this.#reask = options.reask ?? true;
    this.#onReplay = options.onReplay ?? 'error';
    if (this.#onReplay !== 'error' && this.#onReplay !== 'reask') {
      throw new TypeError(`onReplay must be 'error' or 'reask'`);
    }
    this.#lease = options.leaseSeconds ?? 0;
    this.#reaskInvalid = options.reaskOnInvalidAnswers ?? true;
    this.#ttl = options.ttlSeconds ?? 0;
    this.#maxState = options.maxRequestStateBytes ?? DEFAULT_MAX_REQUEST_STATE_BYTES;
    this.#maxAnswers = options.maxInputResponsesBytes ?? DEFAULT_MAX_INPUT_RESPONSES_BYTES;
    for (const [name, value] of [
      ['maxRequestStateBytes', this.#maxState],
      ['maxInputResponsesBytes', this.#maxAnswers],
    ] as const) {
      if (!Number.isSafeInteger(value) || value < 1) throw new TypeError(`${name} must be a positive integer`);
    }
    this.#commitDelayMs = options.commitDelayMs ?? DEFAULT_COMMIT_DELAY_MS;
    if (!Number.isFinite(this.#commitDelayMs) || this.#commitDelayMs < 0 || this.#commitDelayMs > MAX_COMMIT_DELAY_MS) {
      throw new TypeError(`commitDelayMs must be between 0 (commit at once) and ${MAX_COMMIT_DELAY_MS}`);
    }
    this.#commitWindowMs = options.commitWindowMs ?? DEFAULT_COMMIT_WINDOW_MS;
    if (!Number.isFinite(this.#commitWindowMs) || this.#commitWindowMs <= 0) {
      throw new TypeError('commitWindowMs must be a positive, finite number of milliseconds');
    }
    if (this.#commitWindowMs < this.#lease * 1000) {
      throw new TypeError(`commitWindowMs (${this.#commitWindowMs}) must not be shorter than leaseSeconds (${this.#lease} s)`);
    }
    this.#maxPending = options.maxPendingCommits ?? DEFAULT_MAX_PENDING_COMMITS;
    if (!Number.isSafeInteger(this.#maxPending) || this.#maxPending < 1) {
      throw new TypeError('maxPendingCommits must be a positive integer');
    }
    this.#carrier = new Carrier(client, this.#commitDelayMs);
    this.#log = options.logger ?? console;
  }

  /** The Commits and Releases this boundary keeps trying now (at most
   * `maxPendingCommits`). */
  get pendingCommits(): number {
    return this.#kept;
  }

  /** How many Commits and Releases found `maxPendingCommits` already kept
   * since this boundary was made: each was tried once and not kept (and
   * logged as an error). */
  get commitsNotKept(): number {
    return this.#notKept;
  }

  /** Wraps a low-level request handler of `tools/call`, `prompts/get` or
   * `resources/read` (what `install` does for an McpServer). The handler
   * sees the plaintext state in `ctx.mcpReq.requestState()` and the
   * filtered answers in `ctx.mcpReq.inputResponses`. */
  wrapHandler<H extends (request: never, ctx: never) => unknown>(method: BindableMethod, handler: H): H {
    const wrapped = async (request: { params?: Record<string, unknown> }, ctx: Ctx) => {
      const params = request.params ?? {};
      const target = String(method === 'resources/read' ? params.uri : params.name);
      const run = (c: Ctx) => (handler as unknown as (r: unknown, c: Ctx) => unknown)(request, c);
      return this.#serve(method, target, params, ctx, run);
    };
    return wrapped as unknown as H;
  }

  async #serve(
    method: BindableMethod,
    target: string,
    params: Record<string, unknown>,
    ctx: Ctx,
    run: (c: Ctx) => unknown,
  ): Promise<unknown> {
    const wire = ctx.mcpReq.requestState();
    if (wire === undefined || wire === null) {
      // No token: answers never count without one. They would be unbound
      // (any principal, any request, any question) and unfiltered.
      let c = ctx;
      if (wire === null || ctx.mcpReq.inputResponses !== undefined) {
        if (ctx.mcpReq.inputResponses !== undefined) {
          this.#log.debug?.(`stateseal: inputResponses without requestState on ${method}: ignored, the handler runs without them`);
        }
        c = withState(ctx, undefined, undefined);
      }
      return this.#sealIfAsked(method, target, params, c, await run(c));
    }
    if (typeof wire !== 'string') this.#reject(method, 'NON_STRING');
    // What an end user sends over the service's limits never reaches
    // stateseal (whose transport would refuse it as a fault of ours).
    this.#checkState(method, wire as string);
    const answers = ctx.mcpReq.inputResponses;
    const answersJson = answers === undefined ? '' : this.#answersJson(method, answers);
    const token = createHash('sha256').update(wire as string).digest('base64');
    const binding = this.#binding(method, params, ctx);
    let opened: Opened;
    try {
      const opening = OPENING.get(token) ?? { n: 0, answered: false };
      opening.n++;
      OPENING.set(token, opening);
      try {
        opened = await this.#open(wire as string, token, binding, !this.#atMostOnce.has(target), answersJson, !this.#reusable.has(target));
      } finally {
        if (--opening.n === 0) OPENING.delete(token);
      }
      if (opening.answered || PENDING.get(token)?.what === 'commit') {
        // A handler of this process answered with this token while this
        // Open was on its way, or its Commit is still kept: the Open was
        // decided after that handler's lease ran out (an outage). The
        // handler ran: it does not run again. What the Open reserved is
        // committed in its stead (the token is used); the caller gets
        // IN_USE, and its retry REPLAYED.
        this.#log.warn(`stateseal: requestState opened on ${method} while this process still keeps the Commit of its handler's answer: not run again`);
        if (opened.reservation) {
          const taken = new LeaseKeeper(this.#client, opened.reservation, this.#lease, opened.leaseSeconds, method, this.#log);
          taken.finishing();
          this.#keep(method, token, (windowMs, pause) => this.#commit(method, taken, windowMs, pause), 'commit', taken.granted);
        }
        throw new StatesealError('IN_USE', status.ABORTED, true);
      }
    } catch (e) {
      if (!(e instanceof StatesealError)) throw e;
      const refusal = openRefusal(e, { onReplay: this.#onReplay, reask: this.#reask });
      if (refusal.kind === 'reask') {
        this.#log.info(`stateseal: requestState ${e.reason} on ${method}: asking again`);
        const fresh = withState(ctx, undefined, undefined);
        return this.#sealIfAsked(method, target, params, fresh, await run(fresh));
      }
      this.#refuse(method, e, refusal);
    }
    let filtered: Record<string, unknown> | undefined;
    let fresh = false;
    if (answers !== undefined) {
      filtered = JSON.parse(opened.inputResponsesJson) as Record<string, unknown>;
      for (const d of opened.dropped) {
        this.#log.info(`stateseal: inputResponses[${JSON.stringify(d.key)}] dropped on ${method}: ${d.reason}`);
      }
      // An asked question got no usable answer: ask afresh rather than hand
      // a handler a state whose answers are missing.
      fresh = this.#reaskInvalid && opened.dropped.some((d) => d.reason === 'KIND_MISMATCH' || d.reason === 'INVALID_CONTENT');
      if (fresh) this.#log.info(`stateseal: invalid answers on ${method}: asking again`);
    }
    // An empty state was minted by a boundary for a handler that asked
    // without one: the handler sees none.
    const state = opened.state.length > 0 ? opened.state.toString('utf8') : undefined;
    const inner = fresh ? withState(ctx, undefined, undefined) : withState(ctx, state, filtered);
    const reservation = opened.reservation;
    // The lease lives as long as the handler, and its Commit: renewed until
    // the Commit gets a definite answer (or until the Release).
    const lease = reservation
      ? new LeaseKeeper(this.#client, reservation, this.#lease, opened.leaseSeconds, method, this.#log)
      : undefined;
    let result: unknown;
    try {
      result = await this.#sealIfAsked(method, target, params, inner, await run(inner));
    } catch (e) {
      if (lease) await this.#release(method, token, lease);
      throw e;
    }
    if (lease && isErrorResult(result)) {
      // The tool reported failure: give the token back for the retry.
      await this.#release(method, token, lease);
      return result;
    }
    if (lease) {
      // The handler ran: its answer goes out now, and the Commit runs
      // beside it, kept until it lands. Until then the renewed lease keeps
      // the token IN_USE, so no other attempt runs the handler meanwhile.
      lease.finishing();
      this.#keep(method, token, (windowMs, pause) => this.#commit(method, lease, windowMs, pause), 'commit', lease.granted);
    }
    return result;
  }

  /** Tracks a Commit or Release (`work`) that runs after its handler's
   * answer: drain() waits for it, and an Open of its token in this process
   * waits for it (PENDING). Kept (tried through the commit window, and at
   * least the lease `grantedSeconds`) while fewer than `maxPendingCommits`
   * are; else tried once, logged and counted. */
  #keep(
    method: string,
    token: string,
    work: (windowMs: number, pause: Pause) => Promise<void>,
    what: 'commit' | 'release',
    grantedSeconds: number,
  ): void {
    const kept = this.#kept < this.#maxPending;
    if (kept) {
      this.#kept++;
    } else {
      this.#notKept++;
      this.#safely(() =>
        this.#log.error(
          `stateseal: ${what} on ${method} not kept: ${this.#maxPending} commits and releases already pending (maxPendingCommits); it is tried once, and the token may open again after its lease`,
        ),
      );
    }
    const pause = new Pause();
    const windowMs = kept ? Math.max(this.#commitWindowMs, grantedSeconds * 1000) : 0;
    const done: Promise<void> = work(windowMs, pause)
      .catch(() => undefined)
      .finally(() => {
        if (kept) this.#kept--;
        this.#committing.delete(done);
        if (PENDING.get(token)?.done === done) PENDING.delete(token);
      });
    this.#committing.add(done);
    const opening = OPENING.get(token);
    if (opening && what === 'commit') opening.answered = true;
    PENDING.set(token, {
      done,
      what,
      hurry: () => {
        this.#carrier.sendAll();
        pause.wake();
      },
    });
  }

  /** Commits a reservation whose handler returned, after its answer went
   * out: tried until it gets a definite answer or `windowMs` has run out
   * (`#untilDefinite`), with its lease renewed meanwhile. The first try
   * rides on this boundary's next durable Open, or goes on its own after
   * `commitDelayMs`; the others go at once. Never rejects: a failure is
   * logged. */
  async #commit(method: string, lease: LeaseKeeper, windowMs: number, pause: Pause): Promise<void> {
    let first = true;
    const error = await this.#untilDefinite('commit', method, windowMs, pause, () =>
      lease.exclusive(async () => {
        const carried = first && this.#commitDelayMs > 0;
        first = false;
        // Each try's deadline: a third of the lease, renewed between tries.
        const deadlineMs = lease.deadlineMs();
        if (carried) {
          // An Open carrying it may take the client's deadline: given up
          // as a try that ran out (Commit is idempotent).
          const outcome = this.#carrier.commit(lease.reservation, deadlineMs);
          await (deadlineMs === undefined ? outcome : within(outcome, this.#commitDelayMs + deadlineMs));
        } else await this.#client.commit(lease.reservation, deadlineMs);
        // Landed: no renewal goes after it (it would be answered
        // LEASE_EXPIRED, and count as a lost lease).
        lease.stopNow();
      }),
    );
    lease.stopNow();
    if (error !== undefined) this.#safely(() => this.#commitFailed(method, error, windowMs));
  }

  /** Gives a failed handler's reservation back so that the user's retry
   * may run it: renewing stops first (no Renew after the Release), then the
   * Release is tried before the answer goes out. One that fails
   * transiently is kept beside the answer as a Commit is; the lease, no
   * longer renewed, frees the token by itself at worst. */
  async #release(method: string, token: string, lease: LeaseKeeper): Promise<void> {
    await lease.stop();
    try {
      await this.#client.release(lease.reservation);
      return;
    } catch (e) {
      if (!retryCommit(e)) {
        // The lease ends by itself; the retry waits for it at worst.
        this.#log.warn(`stateseal: release failed on ${method}: ${reasonText(e)}`);
        return;
      }
      this.#log.warn(`stateseal: release on ${method}: ${reasonText(e)}; kept, retrying beside the answer`);
    }
    this.#keep(
      method,
      token,
      async (windowMs, pause) => {
        const error = await this.#untilDefinite('release', method, windowMs, pause, () => this.#client.release(lease.reservation), 1);
        if (error !== undefined) this.#safely(() => this.#log.warn(`stateseal: release failed on ${method}: ${reasonText(error)}`));
      },
      'release',
      lease.granted,
    );
  }

  /** Tries a Commit or Release (`attempt`, idempotent) until it gets a
   * definite answer — success, or a failure that is not transient
   * (`retryCommit`) — or `windowMs` has run out. Between tries it pauses
   * KEPT_RETRY_FIRST_MS, doubling up to KEPT_RETRY_MAX_MS (`pause`, which an
   * Open of the token in this process cuts short). `failures`: how many
   * tries already failed before this call (they are followed by a pause).
   * Resolves with undefined once it landed, else with the failure it ended
   * on; never rejects. The first transient failure is a warning; landing
   * after failures, an info line. */
  async #untilDefinite(
    what: 'commit' | 'release',
    method: string,
    windowMs: number,
    pause: Pause,
    attempt: () => Promise<void>,
    failures = 0,
  ): Promise<unknown> {
    const end = performance.now() + windowMs;
    let delay = KEPT_RETRY_FIRST_MS;
    let last: unknown;
    for (;;) {
      if (failures > 0) {
        const left = end - performance.now();
        if (left <= 0) return last;
        await pause.wait(Math.min(delay, left));
        delay = Math.min(delay * 2, KEPT_RETRY_MAX_MS);
      }
      try {
        await attempt();
        if (failures > 0) this.#safely(() => this.#log.info(`stateseal: ${what} on ${method} landed after ${failures + 1} tries`));
        return undefined;
      } catch (e) {
        last = e;
        if (!retryCommit(e)) return e;
        if (failures++ === 0 && windowMs > 0) {
          this.#safely(() => this.#log.warn(`stateseal: ${what} on ${method}: ${reasonText(e)}; kept, retrying for up to ${Math.round(windowMs)} ms`));
        }
      }
    }
  }

  /** Runs a logging call; a logger that throws is ignored (nothing else to
   * tell). */
  #safely(log: () => void): void {
    try {
      log();
    } catch {
      // The logger's own failure.
    }
  }

  #commitFailed(method: string, e: unknown, windowMs: number): void {
    // The handler ran; its answer stands.
    if (renewalLost(e)) {
      // Renewals failed for longer than the lease (stateseal unreachable, or
      // this process stalled) and another attempt took the token over: it
      // may run the handler again.
      this.#log.error(
        `stateseal: commit failed on ${method}: LEASE_EXPIRED: the token was taken over by another attempt while the handler ran; this result stands, and that attempt may run the handler again`,
      );
    } else if (retryCommit(e) && windowMs === 0) {
      this.#log.error(`stateseal: commit failed on ${method}: ${reasonText(e)} (not kept); the token may open again after its lease`);
    } else if (retryCommit(e)) {
      // Transient to the end: without the commit the token may open again
      // once its lease ends (reserve mode: handlers there must be
      // idempotent).
      this.#log.error(
        `stateseal: commit failed on ${method}: ${reasonText(e)}, still after ${Math.round(windowMs)} ms of tries; the token may open again after its lease`,
      );
    } else {
      this.#log.error(`stateseal: commit failed on ${method}: ${reasonText(e)}`);
    }
  }

  /** Resolves once every Commit (and Release) still running after its
   * handler's answer went out has ended (true) — landed, answered
   * definitely, or given up at the end of the commit window — or after
   * `timeoutMs` (false). Await it before the process exits (a graceful
   * shutdown): a Commit that never lands leaves its token reserved until
   * the lease ends, after which a retry may run the handler again. */
  async drain(timeoutMs = Infinity): Promise<boolean> {
    const deadline = Date.now() + timeoutMs;
    // The Commits waiting for a carrier go now, each on its own, and so
    // does every Commit queued until drain() returns.
    this.#carrier.draining++;
    try {
      this.#carrier.sendAll();
      while (this.#committing.size > 0) {
        const left = deadline - Date.now();
        if (left <= 0) return false;
        await Promise.race([Promise.all([...this.#committing]), ...(Number.isFinite(left) ? [sleep(left)] : [])]);
      }
      return true;
    } finally {
      this.#carrier.draining--;
    }
  }

  #binding(method: BindableMethod, params: Record<string, unknown>, ctx: Ctx): Binding {
    let principal: string | null;
    try {
      principal = this.#principal(ctx);
    } catch {
      this.#log.error(`stateseal: principal binding raised on ${method}`);
      throw new ProtocolError(INVALID_PARAMS, 'Invalid or expired requestState', { reason: 'invalid_request_state' });
    }
    try {
      return {
        subject: subjectFor(this.#audience, principal),
        method,
        paramsDigest: paramsDigestOf(method, params),
      };
    } catch (e) {
      if (e instanceof BindingError) {
        this.#log.warn(`stateseal: params on ${method} cannot be bound`);
        throw new ProtocolError(INVALID_PARAMS, 'Invalid params');
      }
      throw e;
    }
  }

  /** Refuses, before stateseal, a `requestState` over
   * `maxRequestStateBytes` (UTF-8, as sent) or not sendable as UTF-8: the
   * end user's fault, logged at debug only. */
  #checkState(method: string, wire: string): void {
    // UTF-8 takes at least a byte per UTF-16 unit: the length alone refuses
    // most oversized states without measuring them.
    if (wire.length > this.#maxState || Buffer.byteLength(wire, 'utf8') > this.#maxState) {
      this.#reject(method, 'TOO_LARGE', 'debug', `over ${this.#maxState} bytes, refused before stateseal`);
    }
    // A lone surrogate: no token has one, and UTF-8 cannot carry it.
    if (!isWellFormed(wire)) this.#reject(method, 'MALFORMED', 'debug', 'not UTF-8, refused before stateseal');
  }

  /** `inputResponses` as sent to stateseal; refused, before stateseal, when
   * its UTF-8 is over `maxInputResponsesBytes`. */
  #answersJson(method: string, answers: Record<string, unknown>): string {
    const json = JSON.stringify(answers);
    if (Buffer.byteLength(json, 'utf8') > this.#maxAnswers) {
      this.#log.debug?.(
        `stateseal: inputResponses refused on ${method}: TOO_LARGE (over ${this.#maxAnswers} bytes, refused before stateseal)`,
      );
      throw new ProtocolError(INVALID_PARAMS, 'Invalid params: inputResponses too large', { reason: 'input_responses_too_large' });
    }
    return json;
  }

  async #open(
    wire: string,
    token: string,
    binding: Binding,
    reserve: boolean,
    inputResponsesJson: string,
    carry: boolean,
  ): Promise<Opened> {
    const attemptId = randomBytes(16).toString('hex');
    let resent = 0;
    let busy = 0;
    let waited = false;
    for (;;) {
      // This process keeps a Commit (or Release) of this token: wait for it
      // (once) before asking stateseal. While it is kept, the Open is not
      // sent at all: the lease may have run out during an outage, and
      // stateseal would let this Open take the token over and run the
      // handler again. It is answered as in progress (retryable) instead.
      const kept = PENDING.get(token);
      if (kept) {
        if (!waited) {
          waited = true;
          // That Commit may be waiting for a carrier, or pausing: now.
          kept.hurry();
          await Promise.race([kept.done, sleep(COMMIT_WAIT_MS)]);
        }
        if (PENDING.has(token)) throw new StatesealError('IN_USE', status.ABORTED, true);
      }
      // A durable Open (of a single-use token) carries the Commits waiting
      // here: its durable round is theirs too.
      const carried = carry ? this.#carrier.take() : [];
      try {
        const opened = await this.#client.open({
          requestState: wire,
          binding,
          reserve,
          leaseSeconds: reserve ? this.#lease : 0,
          attemptId,
          inputResponsesJson,
          commit: carried.map((w) => w.reservation),
        });
        this.#carrier.settle(carried, opened.commits);
        return opened;
      } catch (e) {
        // Their outcome is unknown: each is sent on its own (Commit is
        // idempotent).
        this.#carrier.send(carried);
        // Safe: the same attempt id gets the same success if the first try
        // was recorded.
        if (resent < 2 && resend(e)) {
          resent++;
          this.#log.warn(`stateseal: open on ${binding.method}: ${reasonText(e)}; retrying`);
          continue;
        }
        if (e instanceof StatesealError && e.fromStateseal && e.reason === 'IN_USE') {
          // A handler that has answered holds the token until its Commit,
          // which runs beside its answer, lands. If that Commit is this
          // process's, wait for it (above, once); else perhaps another
          // replica's: wait a little, a few times. Then the token's true
          // state (used, or still in progress) is what this Open gets.
          if (PENDING.has(token) && !waited) continue;
          if (busy < BUSY_WAITS_MS.length) {
            await sleep(BUSY_WAITS_MS[busy++]);
            continue;
          }
        }
        throw e;
      }
    }
  }

  async #sealIfAsked(
    method: BindableMethod,
    target: string,
    params: Record<string, unknown>,
    ctx: Ctx,
    result: unknown,
  ): Promise<unknown> {
    if (!isInputRequired(result)) return result;
    let state = result.requestState;
    if (state === undefined && hasQuestions(result.inputRequests)) {
      // The handler asked without a state of its own (the specification
      // allows it). Answers never count without a token, so the boundary
      // mints one, empty: the retry's answers come back bound, single use
      // and filtered against these questions like any other. Opening an
      // empty state hands the handler no requestState (as the Python
      // package does).
      state = '';
    }
    if (typeof state !== 'string') return result;
    const binding = this.#binding(method, params, ctx);
    let sealed;
    try {
      sealed = await this.#client.seal({
        binding,
        state: Buffer.from(state, 'utf8'),
        ttlSeconds: this.#ttl,
        singleUse: !this.#reusable.has(target),
        // The questions travel sealed in the token: the retry's answers
        // are filtered against them. A round that asked nothing (a state
        // only: "still working, call again") is sealed with no questions,
        // `{}`, so that no answer sent with its retry reaches the handler.
        inputRequestsJson: result.inputRequests === undefined ? '{}' : JSON.stringify(result.inputRequests),
      });
    } catch (e) {
      if (!(e instanceof StatesealError)) throw e;
      this.#refuse(method, e, callRefusal(e, true));
    }
    return { ...result, requestState: sealed.requestState };
  }

  #refuse(method: string, e: StatesealError, r: Refusal): never {
    let line: string;
    if (r.kind === 'replayed') line = `stateseal: requestState rejected on ${method}: REPLAYED`;
    else if (r.kind === 'in_use') line = `stateseal: requestState IN_USE on ${method}: another attempt is running it`;
    else if (r.kind === 'unavailable') line = `stateseal: unavailable on ${method}: ${e.reason}`;
    else if (r.kind === 'rejected' && !e.fromStateseal) {
      line =
        `stateseal: requestState rejected on ${method}: ${e.reason} (stateseal refused the message as too large; ` +
        'are maxRequestStateBytes and maxInputResponsesBytes above its --max-state-bytes / --max-input-bytes?)';
    } else if (r.kind === 'rejected') line = `stateseal: requestState rejected on ${method}: ${e.reason}`;
    else line = `stateseal: call failed on ${method}: ${e.reason} (check credentials and configuration)`;
    this.#log[r.log](line);
    throw new ProtocolError(r.code ?? INTERNAL_ERROR, r.message ?? 'Internal error', r.data);
  }

  #reject(method: string, reason: string, level: 'debug' | 'info' | 'warn' = 'warn', detail = ''): never {
    const line = `stateseal: requestState rejected on ${method}: ${reason}${detail ? ` (${detail})` : ''}`;
    if (level === 'debug') this.#log.debug?.(line);
    else this.#log[level](line);
    throw new ProtocolError(INVALID_PARAMS, 'Invalid or expired requestState', { reason: 'invalid_request_state' });
  }
}

function reasonText(e: unknown): string {
  return e instanceof StatesealError ? e.reason : 'error';
}

/** The context the handler sees: the plaintext state and the filtered
 * answers in place of what came over the wire. */
function withState(ctx: Ctx, state: string | undefined, answers: Record<string, unknown> | undefined): Ctx {
  const mcpReq = Object.create(Object.getPrototypeOf(ctx.mcpReq) as object, Object.getOwnPropertyDescriptors(ctx.mcpReq)) as Ctx['mcpReq'];
  Object.defineProperty(mcpReq, 'requestState', { value: () => state, enumerable: true, configurable: true, writable: true });
  Object.defineProperty(mcpReq, 'inputResponses', { value: answers, enumerable: true, configurable: true, writable: true });
  const out = Object.create(Object.getPrototypeOf(ctx) as object, Object.getOwnPropertyDescriptors(ctx)) as Ctx;
  Object.defineProperty(out, 'mcpReq', { value: mcpReq, enumerable: true, configurable: true, writable: true });
  return out;
}

const WRAPPED = new Set<string>(['tools/call', 'prompts/get', 'resources/read']);

/** What `install` needs of an McpServer: its low-level server. */
interface HasLowLevel {
  server: object;
}

/** Puts `boundary` in front of `server`'s tools, prompts and resources.
 * Call it right after `new McpServer(...)`, before registering anything:
 * the McpServer installs its low-level handlers on the first registration,
 * and those are what get wrapped. */
export function install(server: HasLowLevel, boundary: StatesealBoundary): void {
  const flags = server as unknown as Record<string, unknown>;
  if (flags._toolHandlersInitialized || flags._promptHandlersInitialized || flags._resourceHandlersInitialized) {
    throw new Error('stateseal install(): call it before registering tools, prompts or resources');
  }
  const low = server.server as unknown as {
    setRequestHandler: (method: string, handler: (...a: never[]) => unknown) => unknown;
  };
  const original = low.setRequestHandler.bind(low);
  low.setRequestHandler = (method: string, handler: (...a: never[]) => unknown) =>
    original(
      method,
      WRAPPED.has(method) ? boundary.wrapHandler(method as BindableMethod, handler as never) : handler,
    );
}
