// Unary gRPC calls over node:http2: one HTTP/2 session per client, shared
// by every call. It does only what stateseal's client needs (unary calls,
// no compression, a deadline, bearer metadata, TLS or mTLS), which costs
// well under half of what @grpc/grpc-js spends per call (docs/performance.md).

import http2 from 'node:http2';
import type { ClientHttp2Session, ClientHttp2Stream, IncomingHttpHeaders } from 'node:http2';
import net from 'node:net';
import tls from 'node:tls';

/** gRPC status codes. */
export enum Status {
  OK = 0,
  CANCELLED = 1,
  UNKNOWN = 2,
  INVALID_ARGUMENT = 3,
  DEADLINE_EXCEEDED = 4,
  NOT_FOUND = 5,
  ALREADY_EXISTS = 6,
  PERMISSION_DENIED = 7,
  RESOURCE_EXHAUSTED = 8,
  FAILED_PRECONDITION = 9,
  ABORTED = 10,
  OUT_OF_RANGE = 11,
  UNIMPLEMENTED = 12,
  INTERNAL = 13,
  UNAVAILABLE = 14,
  DATA_LOSS = 15,
  UNAUTHENTICATED = 16,
}

/** TLS to stateseal: the CA that signs its certificate, and for mTLS the
 * client's key and certificate (PEM). */
export interface TlsOptions {
  ca?: string | Buffer;
  key?: string | Buffer;
  cert?: string | Buffer;
  /** The name to check the server's certificate against, when it is not
   * the address's host. */
  servername?: string;
}

/** A call that did not return a message: its status and, when the server
 * sent one, its `grpc-status-details-bin` (a google.rpc.Status). */
export class CallError extends Error {
  constructor(
    readonly code: Status,
    readonly details?: Buffer,
  ) {
    super(Status[code] ?? 'UNKNOWN');
  }
}

/** The largest response message accepted (as @grpc/grpc-js's default). */
export const MAX_RESPONSE_BYTES = 4 * 1024 * 1024;
/** How long a session that let a call run out its deadline has to answer a
 * PING before it is dropped (a half-open connection would otherwise keep
 * taking calls until TCP gives up on it). */
export const PING_TIMEOUT_MS = 2000;
/** The longest single timer (setTimeout's limit). */
const MAX_TIMER_MS = 2 ** 31 - 1;

/** Milliseconds on a clock that never steps (deadlines are not wall time). */
function now(): number {
  return performance.now();
}

const { NGHTTP2_CANCEL, NGHTTP2_REFUSED_STREAM, NGHTTP2_ENHANCE_YOUR_CALM, NGHTTP2_INADEQUATE_SECURITY } =
  http2.constants;

/** The gRPC status of an HTTP status that came without one (the gRPC
 * HTTP/2 protocol's table). */
function fromHttp(code: number): Status {
  switch (code) {
    case 400:
      return Status.INTERNAL;
    case 401:
      return Status.UNAUTHENTICATED;
    case 403:
      return Status.PERMISSION_DENIED;
    case 404:
      return Status.UNIMPLEMENTED;
    case 429:
    case 502:
    case 503:
    case 504:
      return Status.UNAVAILABLE;
    default:
      return Status.UNKNOWN;
  }
}

function timeoutHeader(ms: number): string {
  const m = Math.max(1, Math.ceil(ms));
  return m <= 99_999_999 ? `${m}m` : `${Math.min(99_999_999, Math.ceil(m / 1000))}S`;
}

function one(v: string | string[] | undefined): string | undefined {
  return Array.isArray(v) ? v[0] : v;
}

const GRPC_TYPE = /^application\/grpc([+;]|$)/;

/** A status code as the protocol writes it (decimal digits only). */
function statusOf(v: string | undefined): Status {
  if (v === undefined || !/^\d{1,3}$/.test(v)) return Status.UNKNOWN;
  const code = Number(v);
  return code <= Status.UNAUTHENTICATED ? code : Status.UNKNOWN;
}

/** Response headers of a gRPC answer: HTTP 200 and a gRPC content type. */
function isGrpc(head: IncomingHttpHeaders | undefined): boolean {
  return head !== undefined && Number(head[':status']) === 200 && GRPC_TYPE.test(one(head['content-type']) ?? '');
}

/** The one message of a unary response, read as it arrives: the 5-byte
 * prefix first (uncompressed, at most MAX_RESPONSE_BYTES), then exactly
 * that many bytes, into a buffer that grows as they come (a prefix alone
 * reserves nothing). */
class Reader {
  #prefix = Buffer.alloc(5);
  #have = 0;
  #length = -1;
  #message = Buffer.alloc(0);
  #filled = 0;

  /** undefined while all is well; else the status to fail with. */
  push(chunk: Buffer): Status | undefined {
    let at = 0;
    while (at < chunk.length) {
      if (this.#have < 5) {
        const n = Math.min(5 - this.#have, chunk.length - at);
        chunk.copy(this.#prefix, this.#have, at, at + n);
        this.#have += n;
        at += n;
        if (this.#have === 5) {
          if (this.#prefix[0] !== 0) return Status.INTERNAL; // compressed: never offered
          this.#length = this.#prefix.readUInt32BE(1);
          if (this.#length > MAX_RESPONSE_BYTES) return Status.RESOURCE_EXHAUSTED;
        }
        continue;
      }
      const n = chunk.length - at;
      if (this.#filled + n > this.#length) return Status.INTERNAL; // bytes after the message
      if (this.#filled + n > this.#message.length) {
        const grown = Buffer.allocUnsafe(Math.min(this.#length, Math.max(this.#filled + n, 2 * this.#message.length, 16 * 1024)));
        this.#message.copy(grown, 0, 0, this.#filled);
        this.#message = grown;
      }
      chunk.copy(this.#message, this.#filled, at);
      this.#filled += n;
      at += n;
    }
    return undefined;
  }

  /** The message, when exactly one arrived whole. */
  done(): Buffer | undefined {
    return this.#length >= 0 && this.#filled === this.#length ? this.#message.subarray(0, this.#length) : undefined;
  }
}

export interface ChannelOptions {
  tls?: TlsOptions;
  /** Sent with every call (e.g. `authorization`). */
  headers?: Record<string, string>;
}

/** One HTTP/2 session to `host:port`, opened on the first call and again on
 * the next call after it closed. */
export class Channel {
  readonly #authority: string;
  readonly #connectOptions: http2.SecureClientSessionOptions;
  readonly #headers: Record<string, string>;
  #session?: ClientHttp2Session;
  /** The connection attempt under way, shared by every call waiting for
   * it; it gives up at the latest deadline among them. */
  #connecting?: Attempt;
  /** The last GOAWAY's last stream id, per session. */
  readonly #goaway = new WeakMap<ClientHttp2Session, number>();
  readonly #pinging = new WeakSet<ClientHttp2Session>();
  #closed = false;

  constructor(address: string, options: ChannelOptions = {}) {
    const colon = address.lastIndexOf(':');
    const host = address.slice(0, colon).replace(/^\[(.*)\]$/, '$1');
    const port = address.slice(colon + 1);
    if (colon <= 0 || !/^\d{1,5}$/.test(port) || Number(port) > 65535 || host === '' || /[/\s@?#]/.test(host)) {
      throw new TypeError('the address is host:port (no scheme, no path)');
    }
    const t = options.tls;
    if (t && (t.key === undefined) !== (t.cert === undefined)) {
      throw new TypeError('tls: give both key and cert (mTLS), or neither');
    }
    this.#authority = `${t ? 'https' : 'http'}://${net.isIPv6(host) ? `[${host}]` : host}:${port}`;
    this.#connectOptions = t
      ? {
          // SNI carries a host name, never an IP address (RFC 6066); the
          // certificate is checked against the host either way.
          createConnection: () =>
            tls.connect({
              host,
              port: Number(port),
              ca: t.ca,
              key: t.key,
              cert: t.cert,
              ALPNProtocols: ['h2'],
              servername: t.servername ?? (net.isIP(host) ? undefined : host),
            }),
        }
      : {};
    this.#headers = {
      'content-type': 'application/grpc',
      te: 'trailers',
      'user-agent': 'stateseal-ts/0.1',
      ...options.headers,
    };
  }

  /** Calls `path` with one encoded message; resolves with the response
   * message. `waitForReady`: while no connection can be made, keep trying
   * until the deadline instead of failing with UNAVAILABLE at once. */
  async call(path: string, request: Uint8Array, timeoutMs: number, waitForReady = false): Promise<Buffer> {
    const deadline = now() + timeoutMs;
    const frame = Buffer.allocUnsafe(5 + request.length);
    frame[0] = 0;
    frame.writeUInt32BE(request.length, 1);
    frame.set(request, 5);
    // A stream the server provably did not handle (refused, or above a
    // GOAWAY's last stream id) is sent once more, on a new session.
    for (let attempt = 0; ; attempt++) {
      const session = this.#usable() ?? (await this.#connect(deadline, waitForReady));
      if (now() >= deadline) throw new CallError(Status.DEADLINE_EXCEEDED);
      try {
        return await this.#send(session, path, frame, deadline);
      } catch (e) {
        if (!(e instanceof Unsent)) throw e;
        // Not on that session again (it refused, is going away, or is out
        // of stream ids).
        // (#usable skips a closed session; its 'close' clears #session.)
        session.close();
        if (attempt > 0) throw new CallError(Status.UNAVAILABLE);
      }
    }
  }

  close(): void {
    this.#closed = true;
    this.#connecting?.abort();
    this.#session?.close();
    this.#session = undefined;
  }

  /** The session for a new call: not closing, not told to go away, and not
   * under suspicion (a PING after a call ran out its deadline). */
  #usable(): ClientHttp2Session | undefined {
    const s = this.#session;
    return s && !s.closed && !s.destroyed && !this.#goaway.has(s) && !this.#pinging.has(s) ? s : undefined;
  }

  /** A connected session, within the deadline: one attempt shared by every
   * caller at a time. */
  async #connect(deadline: number, waitForReady: boolean): Promise<ClientHttp2Session> {
    for (let backoff = 20; ; backoff = Math.min(backoff * 2, 1000)) {
      if (this.#closed) throw new CallError(Status.CANCELLED);
      const left = deadline - now();
      if (left <= 0) throw new CallError(Status.DEADLINE_EXCEEDED);
      let attempt = this.#connecting;
      if (attempt) attempt.until(deadline);
      else {
        const started = this.#open(deadline);
        attempt = this.#connecting = started;
        const over = () => {
          if (this.#connecting === started) this.#connecting = undefined;
        };
        started.session.then(over, over);
      }
      let timer: NodeJS.Timeout | undefined;
      try {
        // A ref'd timer: the process waits for the call's outcome.
        return await Promise.race([
          attempt.session,
          new Promise<never>((_, reject) => {
            timer = setTimeout(() => reject(new CallError(Status.DEADLINE_EXCEEDED)), Math.min(left, MAX_TIMER_MS));
          }),
        ]);
      } catch (e) {
        if (this.#closed) throw new CallError(Status.CANCELLED);
        if (!(e instanceof CallError) || e.code !== Status.UNAVAILABLE || !waitForReady) throw e;
        const wait = deadline - now();
        if (wait <= 0) throw new CallError(Status.DEADLINE_EXCEEDED);
        await new Promise((r) => setTimeout(r, Math.min(backoff, wait)));
      } finally {
        clearTimeout(timer);
      }
    }
  }

  /** Opens a session; gives up (and destroys it) at the latest deadline of
   * the calls waiting for it, at least 1 s from now, so that a stalled
   * handshake never holds the attempt. */
  #open(deadline: number): Attempt {
    const s = http2.connect(this.#authority, this.#connectOptions);
    // A session keeps no process alive: each call's timers do.
    s.unref();
    let giveUpAt = Math.max(deadline, now() + 1000);
    let stall: NodeJS.Timeout;
    const arm = () => {
      clearTimeout(stall);
      stall = setTimeout(() => s.destroy(), Math.min(Math.max(0, giveUpAt - now()), MAX_TIMER_MS));
      stall.unref();
    };
    arm();
    const session = new Promise<ClientHttp2Session>((resolve, reject) => {
      const failed = () => reject(new CallError(Status.UNAVAILABLE));
      s.once('error', failed);
      // Later session errors end its streams, which report them.
      s.on('error', () => {});
      s.on('goaway', (_code: number, last: number) => this.#goaway.set(s, last));
      s.once('connect', () => {
        clearTimeout(stall);
        s.off('error', failed);
        if (this.#closed) {
          s.close();
          reject(new CallError(Status.CANCELLED));
          return;
        }
        // A session this one replaces (gone away, or under suspicion)
        // finishes what it carries, then closes.
        if (this.#session && this.#session !== s) this.#session.close();
        this.#session = s;
        resolve(s);
      });
      s.once('close', () => {
        clearTimeout(stall);
        failed();
        if (this.#session === s) this.#session = undefined;
      });
    });
    return {
      session,
      until: (later: number) => {
        if (later > giveUpAt) {
          giveUpAt = later;
          if (s.destroyed) return;
          arm();
        }
      },
      abort: () => s.destroy(),
    };
  }

  /** After a call ran out its deadline: a session that neither answers a
   * PING nor delivers a byte within PING_TIMEOUT_MS is dropped. New calls
   * go to a fresh session meanwhile. */
  #check(session: ClientHttp2Session): void {
    if (session.destroyed || this.#pinging.has(session)) return;
    this.#pinging.add(session);
    const read = session.socket?.bytesRead ?? 0;
    const timer = setTimeout(() => {
      if ((session.socket?.bytesRead ?? 0) > read) this.#pinging.delete(session);
      else session.destroy();
    }, PING_TIMEOUT_MS);
    timer.unref();
    const sent = session.ping((err) => {
      clearTimeout(timer);
      if (err) session.destroy();
      else this.#pinging.delete(session);
    });
    if (!sent) {
      clearTimeout(timer);
      this.#pinging.delete(session);
    }
  }

  #send(session: ClientHttp2Session, path: string, frame: Buffer, deadline: number): Promise<Buffer> {
    return new Promise((resolve, reject) => {
      let stream: ClientHttp2Stream;
      try {
        stream = session.request({
          ':method': 'POST',
          ':path': path,
          'grpc-timeout': timeoutHeader(deadline - now()),
          ...this.#headers,
        });
      } catch (e) {
        // Only a session that closed between the check and the request
        // means the call never left.
        const code = (e as { code?: string }).code;
        if (code === 'ERR_HTTP2_INVALID_SESSION' || code === 'ERR_HTTP2_GOAWAY_SESSION' || code === 'ERR_HTTP2_OUT_OF_STREAMS') {
          reject(new Unsent());
        } else {
          reject(e);
        }
        return;
      }
      let head: IncomingHttpHeaders | undefined;
      let headEnded = false;
      let trailers: IncomingHttpHeaders | undefined;
      const reader = new Reader();
      let done = false;
      const finish = (e: Error | undefined, m?: Buffer) => {
        if (done) return;
        done = true;
        clearTimeout(timer);
        if (e) reject(e);
        else resolve(m!);
      };
      const abandon = (code: Status) => {
        finish(new CallError(code));
        stream.close(NGHTTP2_CANCEL);
      };
      const timer = setTimeout(() => {
        abandon(Status.DEADLINE_EXCEEDED);
        this.#check(session);
      }, Math.min(Math.max(0, deadline - now()), MAX_TIMER_MS));
      // Data can come before the 'response' event: it waits (bounded) for
      // the headers that say whether it is a gRPC message.
      let early: Buffer[] | undefined = [];
      let earlyBytes = 0;
      const read = (c: Buffer) => {
        const bad = reader.push(c);
        if (bad !== undefined) abandon(bad);
      };
      stream.on('response', (h, flags: number) => {
        head = h;
        headEnded = (flags & http2.constants.NGHTTP2_FLAG_END_STREAM) !== 0;
        const waiting = early ?? [];
        early = undefined;
        // The body of an answer that is not gRPC is not read as messages:
        // its status decides, at 'close'.
        if (isGrpc(h)) for (const c of waiting) if (!done) read(c);
      });
      stream.on('data', (c: Buffer) => {
        if (done) return;
        if (early) {
          earlyBytes += c.length;
          if (earlyBytes > MAX_RESPONSE_BYTES + 5) abandon(Status.RESOURCE_EXHAUSTED);
          else early.push(c);
        } else if (isGrpc(head)) {
          read(c);
        }
      });
      stream.on('trailers', (t) => {
        trailers = t;
      });
      // Reported at 'close', from what arrived.
      stream.on('error', () => {});
      stream.on('close', () => {
        if (done) return;
        const outcome = this.#outcome(session, stream, head, headEnded, trailers, reader);
        if (outcome instanceof Error) finish(outcome);
        else finish(undefined, outcome);
      });
      stream.end(frame);
    });
  }

  /** What a closed stream's call came to: its message, or the error. */
  #outcome(
    session: ClientHttp2Session,
    stream: ClientHttp2Stream,
    head: IncomingHttpHeaders | undefined,
    headEnded: boolean,
    trailers: IncomingHttpHeaders | undefined,
    reader: Reader,
  ): Buffer | Error {
    if (head && !isGrpc(head)) {
      // Not a gRPC answer (a proxy's page, say).
      const http = Number(head[':status']);
      return new CallError(http === 200 ? Status.UNKNOWN : fromHttp(http));
    }
    // The status is in the trailers, or in headers that end the stream
    // (trailers-only).
    const meta = trailers ?? (headEnded ? head : undefined);
    if (meta && meta['grpc-status'] !== undefined) {
      const code = statusOf(one(meta['grpc-status']));
      if (code === Status.OK) return reader.done() ?? new CallError(Status.INTERNAL);
      const bin = one(meta['grpc-status-details-bin']);
      return new CallError(code, bin ? Buffer.from(bin, 'base64') : undefined);
    }
    // No status: the stream was reset, or its connection went.
    const last = this.#goaway.get(session);
    const id = stream.id;
    if (!head && (id === undefined || (last !== undefined && id > last))) return new Unsent();
    if (!head && last === undefined && !session.destroyed && stream.rstCode === NGHTTP2_REFUSED_STREAM) {
      return new Unsent();
    }
    if (session.destroyed || session.closed || last !== undefined) {
      // The connection went before the whole answer (node ends its streams
      // with CANCEL, or the GOAWAY's code): whether the server handled the
      // call is unknown.
      return new CallError(Status.UNAVAILABLE);
    }
    switch (stream.rstCode) {
      case NGHTTP2_CANCEL:
        return new CallError(Status.CANCELLED);
      case NGHTTP2_ENHANCE_YOUR_CALM:
        return new CallError(Status.RESOURCE_EXHAUSTED);
      case NGHTTP2_INADEQUATE_SECURITY:
        return new CallError(Status.PERMISSION_DENIED);
      default:
        // Reset by the server, or ended with no status.
        return new CallError(Status.INTERNAL);
    }
  }
}

/** A connection attempt: its session once connected; `until` moves its
 * give-up time later (a call with a later deadline joined); `abort` ends it. */
interface Attempt {
  session: Promise<ClientHttp2Session>;
  until: (deadline: number) => void;
  abort: () => void;
}

/** The server did not handle the call (a refused stream, or one above a
 * GOAWAY's last stream id): safe to send again. */
class Unsent extends Error {}
