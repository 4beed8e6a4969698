// Unary gRPC calls over node:http2: one HTTP/2 session per client, shared
// by every call. It does only what stateseal's client needs (unary calls,
// no compression, a deadline, bearer metadata, TLS or mTLS), which costs
// well under half of what @grpc/grpc-js spends per call (docs/performance.md).

import http2 from 'node:http2';
import type { ClientHttp2Session, ClientHttp2Stream, IncomingHttpHeaders } from 'node:http2';

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

/** The single message of a unary response body, or undefined when the body
 * is not exactly one uncompressed message. */
function message(body: Buffer): Buffer | undefined {
  if (body.length < 5 || body[0] !== 0) return undefined;
  const len = body.readUInt32BE(1);
  return body.length === 5 + len ? body.subarray(5) : undefined;
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
  #connecting?: Promise<ClientHttp2Session>;
  #closed = false;

  constructor(address: string, options: ChannelOptions = {}) {
    if (address.includes('://') || address.includes('/')) {
      throw new TypeError('the address is host:port (no scheme, no path)');
    }
    this.#authority = `${options.tls ? 'https' : 'http'}://${address}`;
    const tls = options.tls;
    this.#connectOptions = tls
      ? { ca: tls.ca, key: tls.key, cert: tls.cert, ...(tls.servername ? { servername: tls.servername } : {}) }
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
    const deadline = Date.now() + timeoutMs;
    const frame = Buffer.allocUnsafe(5 + request.length);
    frame[0] = 0;
    frame.writeUInt32BE(request.length, 1);
    frame.set(request, 5);
    // A stream the server refused unprocessed (REFUSED_STREAM, or a session
    // that was going away) is sent once more on a new session.
    for (let attempt = 0; ; attempt++) {
      const session = this.#usable() ?? (await this.#connect(deadline, waitForReady));
      try {
        return await this.#send(session, path, frame, deadline);
      } catch (e) {
        if (!(e instanceof Unsent) || attempt > 0) throw e instanceof Unsent ? new CallError(Status.UNAVAILABLE) : e;
      }
    }
  }

  close(): void {
    this.#closed = true;
    this.#session?.close();
    this.#session = undefined;
  }

  #usable(): ClientHttp2Session | undefined {
    const s = this.#session;
    return s && !s.closed && !s.destroyed ? s : undefined;
  }

  async #connect(deadline: number, waitForReady: boolean): Promise<ClientHttp2Session> {
    for (let backoff = 20; ; backoff = Math.min(backoff * 2, 1000)) {
      if (this.#closed) throw new CallError(Status.CANCELLED);
      this.#connecting ??= this.#open().finally(() => {
        this.#connecting = undefined;
      });
      try {
        return await this.#connecting;
      } catch {
        const left = deadline - Date.now();
        if (!waitForReady) throw new CallError(Status.UNAVAILABLE);
        if (left <= 0) throw new CallError(Status.DEADLINE_EXCEEDED);
        await new Promise((r) => setTimeout(r, Math.min(backoff, left)));
      }
    }
  }

  #open(): Promise<ClientHttp2Session> {
    return new Promise((resolve, reject) => {
      const s = http2.connect(this.#authority, this.#connectOptions);
      // A session keeps no process alive: each call's deadline timer does.
      s.unref();
      const failed = () => reject(new CallError(Status.UNAVAILABLE));
      s.once('error', failed);
      // Later session errors end its streams, which report them.
      s.on('error', () => {});
      s.once('connect', () => {
        s.off('error', failed);
        if (this.#closed) {
          s.close();
          reject(new CallError(Status.CANCELLED));
          return;
        }
        this.#session = s;
        resolve(s);
      });
      s.once('close', () => {
        failed();
        if (this.#session === s) this.#session = undefined;
      });
    });
  }

  #send(session: ClientHttp2Session, path: string, frame: Buffer, deadline: number): Promise<Buffer> {
    return new Promise((resolve, reject) => {
      let stream: ClientHttp2Stream;
      try {
        stream = session.request({
          ':method': 'POST',
          ':path': path,
          'grpc-timeout': timeoutHeader(deadline - Date.now()),
          ...this.#headers,
        });
      } catch {
        // The session closed between the check and the request.
        reject(new Unsent());
        return;
      }
      let head: IncomingHttpHeaders | undefined;
      let trailers: IncomingHttpHeaders | undefined;
      const chunks: Buffer[] = [];
      let size = 0;
      let done = false;
      const finish = (e: Error | undefined, m?: Buffer) => {
        if (done) return;
        done = true;
        clearTimeout(timer);
        if (e) reject(e);
        else resolve(m!);
      };
      const timer = setTimeout(() => {
        finish(new CallError(Status.DEADLINE_EXCEEDED));
        stream.close(NGHTTP2_CANCEL);
      }, Math.max(0, deadline - Date.now()));
      stream.on('response', (h) => {
        head = h;
      });
      stream.on('data', (c: Buffer) => {
        size += c.length;
        if (size > MAX_RESPONSE_BYTES + 5) {
          finish(new CallError(Status.RESOURCE_EXHAUSTED));
          stream.close(NGHTTP2_CANCEL);
        } else {
          chunks.push(c);
        }
      });
      stream.on('trailers', (t) => {
        trailers = t;
      });
      // Reported at 'close', from what arrived.
      stream.on('error', () => {});
      stream.on('close', () => {
        if (done) return;
        const type = one(head?.['content-type']);
        if (head && !type?.startsWith('application/grpc')) {
          // Not a gRPC answer (a proxy's page, say).
          const http = Number(head[':status']);
          finish(new CallError(http === 200 ? Status.UNKNOWN : fromHttp(http)));
          return;
        }
        // The status is in the trailers, or in the headers of a
        // trailers-only response.
        const meta = trailers ?? (head && head['grpc-status'] !== undefined ? head : undefined);
        if (meta) {
          const code = Number(one(meta['grpc-status']));
          if (code === Status.OK) {
            const m = message(Buffer.concat(chunks));
            finish(m ? undefined : new CallError(Status.INTERNAL), m);
            return;
          }
          const bin = one(meta['grpc-status-details-bin']);
          const known = Number.isInteger(code) && code > 0 && code <= Status.UNAUTHENTICATED;
          finish(new CallError(known ? code : Status.UNKNOWN, bin ? Buffer.from(bin, 'base64') : undefined));
          return;
        }
        if (head) {
          const http = Number(head[':status']);
          finish(new CallError(http === 200 ? Status.INTERNAL : fromHttp(http)));
          return;
        }
        if (stream.rstCode === NGHTTP2_REFUSED_STREAM) {
          finish(new Unsent());
          return;
        }
        if (session.destroyed || session.closed) {
          // The connection went before any answer (node ends its streams
          // with CANCEL): whether the server handled the call is unknown.
          finish(new CallError(Status.UNAVAILABLE));
          return;
        }
        switch (stream.rstCode) {
          case NGHTTP2_CANCEL:
            finish(new CallError(Status.CANCELLED));
            return;
          case NGHTTP2_ENHANCE_YOUR_CALM:
            finish(new CallError(Status.RESOURCE_EXHAUSTED));
            return;
          case NGHTTP2_INADEQUATE_SECURITY:
            finish(new CallError(Status.PERMISSION_DENIED));
            return;
          default:
            // Reset by the server, or ended with no status.
            finish(new CallError(Status.INTERNAL));
        }
      });
      stream.end(frame);
    });
  }
}

/** The server refused the stream before handling it: safe to send again. */
class Unsent extends Error {}
