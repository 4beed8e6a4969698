// The package's unary gRPC transport against a hostile or failing HTTP/2
// peer on loopback: every way an answer can be wrong or missing ends in one
// fixed gRPC status within the call's deadline, and a call the server may
// have handled is never sent twice.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync } from 'node:fs';
import http2 from 'node:http2';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createConnection, createServer, type AddressInfo, type Server as TcpServer, type Socket } from 'node:net';
import { after, test } from 'node:test';

import { CallError, Channel, MAX_RESPONSE_BYTES, PING_TIMEOUT_MS, Status } from '../src/transport.js';
import { freePort, until } from './helpers.js';

type Handler = (stream: http2.ServerHttp2Stream, headers: http2.IncomingHttpHeaders, session: http2.ServerHttp2Session) => void;

const LIMIT = { timeout: 30_000 };
const closers: Array<() => void> = [];
after(() => {
  for (const c of closers) c();
});

interface Peer {
  addr: string;
  server: http2.Http2Server;
  sessions: () => number;
  streams: () => number;
  /** Each stream's RST_STREAM code as the server saw it close. */
  resets: number[];
}

/** An HTTP/2 server on 127.0.0.1 that reads each request's body, then lets
 * `handler` answer it. */
async function peer(handler: Handler, port = 0): Promise<Peer> {
  const server = http2.createServer();
  closers.push(() => server.close());
  let sessions = 0;
  let streams = 0;
  const resets: number[] = [];
  server.on('session', (s) => {
    sessions++;
    s.on('error', () => {});
  });
  server.on('stream', (stream, headers) => {
    streams++;
    stream.on('error', () => {});
    stream.on('close', () => resets.push(stream.rstCode));
    stream.resume();
    stream.on('end', () => handler(stream as http2.ServerHttp2Stream, headers, stream.session as http2.ServerHttp2Session));
  });
  await new Promise<void>((r) => server.listen(port, '127.0.0.1', r));
  return {
    addr: `127.0.0.1:${(server.address() as AddressInfo).port}`,
    server,
    sessions: () => sessions,
    streams: () => streams,
    resets,
  };
}

function frame(message: Buffer, flag = 0): Buffer {
  const f = Buffer.alloc(5 + message.length);
  f[0] = flag;
  f.writeUInt32BE(message.length, 1);
  message.copy(f, 5);
  return f;
}

/** Answers with `body` and `grpc-status: 0` in the trailers. */
function ok(body: Buffer): Handler {
  return (stream) => {
    stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { waitForTrailers: true });
    stream.on('wantTrailers', () => stream.sendTrailers({ 'grpc-status': '0' }));
    stream.end(body);
  };
}

async function fails(p: Promise<unknown>, code: Status): Promise<CallError> {
  let caught: unknown;
  await p.then(
    () => assert.fail(`resolved; expected ${Status[code]}`),
    (e) => {
      caught = e;
    },
  );
  assert.ok(caught instanceof CallError, String(caught));
  assert.equal(Status[caught.code], Status[code]);
  return caught;
}

function channel(addr: string, options?: ConstructorParameters<typeof Channel>[1]): Channel {
  const ch = new Channel(addr, options);
  closers.push(() => ch.close());
  return ch;
}

test('a unary call sends one framed message with its deadline and headers, and returns the one message', LIMIT, async () => {
  let seen: http2.IncomingHttpHeaders | undefined;
  let body = Buffer.alloc(0);
  const server = http2.createServer();
  closers.push(() => server.close());
  server.on('stream', (stream, headers) => {
    seen = headers;
    stream.on('data', (c: Buffer) => (body = Buffer.concat([body, c])));
    stream.on('end', () => ok(frame(Buffer.from('answer')))(stream as http2.ServerHttp2Stream, headers, stream.session as never));
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const ch = channel(`127.0.0.1:${(server.address() as AddressInfo).port}`, { headers: { authorization: 'Bearer x' } });
  const got = await ch.call('/p.S/M', Buffer.from('question'), 3000);
  assert.equal(got.toString(), 'answer');
  assert.deepEqual(body, frame(Buffer.from('question')));
  assert.equal(seen?.[':path'], '/p.S/M');
  assert.equal(seen?.['content-type'], 'application/grpc');
  assert.equal(seen?.te, 'trailers');
  assert.equal(seen?.authorization, 'Bearer x');
  assert.match(String(seen?.['grpc-timeout']), /^\d{1,8}m$/);
  assert.ok(Number(String(seen?.['grpc-timeout']).slice(0, -1)) <= 3000);
});

test('no answer within the deadline is DEADLINE_EXCEEDED, and the stream is cancelled', LIMIT, async () => {
  const p = await peer(() => {});
  await fails(channel(p.addr).call('/p.S/M', Buffer.alloc(0), 1000), Status.DEADLINE_EXCEEDED);
  await until(() => p.resets.length === 1, 10_000, 'the stream closed at the server');
  assert.deepEqual(p.resets, [http2.constants.NGHTTP2_CANCEL]);
});

test('a status with details is that status with those details; a code not written as the protocol says is UNKNOWN', LIMIT, async () => {
  const details = Buffer.from('details bytes');
  let code = '5';
  const p = await peer((stream) => {
    stream.respond(
      { ':status': 200, 'content-type': 'application/grpc', 'grpc-status': code, 'grpc-status-details-bin': details.toString('base64') },
      { endStream: true },
    );
  });
  const ch = channel(p.addr);
  const e = await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.NOT_FOUND);
  assert.deepEqual(e.details, details);
  for (code of ['99', 'x', '0x0', '1e1', '+5', '5.0', '']) await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNKNOWN);
});

test('a body that is not exactly one uncompressed message is INTERNAL', LIMIT, async () => {
  const m = Buffer.from('message');
  const bodies = [
    frame(m, 1), // compressed, which was never offered
    frame(m).subarray(0, 8), // shorter than its length
    Buffer.concat([frame(m), frame(m)]), // two messages
    Buffer.concat([frame(m), Buffer.from([0])]), // a byte after the message
    Buffer.from([0, 0, 0]), // a partial prefix
    Buffer.alloc(0), // no message with OK
  ];
  let i = 0;
  const p = await peer((stream, h, s) => ok(bodies[i++])(stream, h, s));
  const ch = channel(p.addr);
  for (let n = 0; n < bodies.length; n++) await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.INTERNAL);
});

test('a message in one-byte writes (its prefix split too), and an empty one, arrive whole', LIMIT, async () => {
  const message = Buffer.from('a message that comes a byte at a time');
  let empty = false;
  const p = await peer((stream) => {
    stream.respond({ ':status': 200, 'content-type': 'application/grpc' }, { waitForTrailers: true });
    stream.on('wantTrailers', () => stream.sendTrailers({ 'grpc-status': '0' }));
    if (empty) {
      stream.end(frame(Buffer.alloc(0)));
      return;
    }
    const bytes = frame(message);
    let i = 0;
    const next = () => {
      if (i === bytes.length) stream.end();
      else stream.write(bytes.subarray(i, ++i), () => setImmediate(next));
    };
    next();
  });
  const ch = channel(p.addr);
  assert.deepEqual(await ch.call('/p.S/M', Buffer.alloc(0), 10_000), message);
  empty = true;
  assert.equal((await ch.call('/p.S/M', Buffer.alloc(0), 10_000)).length, 0);
});

test('a message announced over the size limit is RESOURCE_EXHAUSTED at its prefix, not after its bytes', LIMIT, async () => {
  const prefix = Buffer.alloc(5);
  prefix.writeUInt32BE(MAX_RESPONSE_BYTES + 1, 1);
  // The prefix, then nothing: waiting for the bytes would run out the
  // (long) deadline instead.
  const p = await peer((stream) => {
    stream.respond({ ':status': 200, 'content-type': 'application/grpc' });
    stream.write(prefix);
  });
  const started = Date.now();
  await fails(channel(p.addr).call('/p.S/M', Buffer.alloc(0), 20_000), Status.RESOURCE_EXHAUSTED);
  assert.ok(Date.now() - started < 15_000, 'failed at the prefix');
  await until(() => p.resets.length === 1, 10_000, 'the stream closed at the server');
  assert.deepEqual(p.resets, [http2.constants.NGHTTP2_CANCEL]);
});

test('an answer that is not gRPC maps by its HTTP status', LIMIT, async () => {
  const answers: Array<[number, string, Record<string, string>, Status]> = [
    [503, 'text/plain', {}, Status.UNAVAILABLE],
    [401, 'text/plain', {}, Status.UNAUTHENTICATED],
    [404, 'application/grpc', {}, Status.UNIMPLEMENTED],
    [502, 'application/grpc', { 'grpc-status': '0' }, Status.UNAVAILABLE],
    [200, 'text/html', {}, Status.UNKNOWN],
    [200, 'application/grpc-web', { 'grpc-status': '0' }, Status.UNKNOWN],
    [200, 'application/grpcfoo', {}, Status.UNKNOWN],
    [500, 'text/plain', {}, Status.UNKNOWN],
  ];
  let i = 0;
  const p = await peer((stream) => {
    const [status, type, extra] = answers[i++];
    stream.respond({ ':status': status, 'content-type': type, ...extra });
    stream.end('<html>');
  });
  const ch = channel(p.addr);
  for (const [, , , code] of answers) await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), code);
});

test('a stream the server refuses unprocessed is sent once more; refused twice it is UNAVAILABLE', LIMIT, async () => {
  let refuse = 1;
  const p = await peer((stream, h, s) => {
    if (refuse-- > 0) stream.close(http2.constants.NGHTTP2_REFUSED_STREAM);
    else ok(frame(Buffer.from('second')))(stream, h, s);
  });
  const ch = channel(p.addr);
  assert.equal((await ch.call('/p.S/M', Buffer.alloc(0), 3000)).toString(), 'second');
  assert.equal(p.streams(), 2);
  refuse = 2;
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
  assert.equal(p.streams(), 4, 'sent at most twice');
});

test('after GOAWAY each next call goes, once, on a new session', LIMIT, async () => {
  const p = await peer((stream, h, s) => {
    ok(frame(Buffer.from('m')))(stream, h, s);
    stream.on('close', () => s.goaway(http2.constants.NGHTTP2_NO_ERROR, stream.id));
  });
  const ch = channel(p.addr);
  for (let i = 0; i < 3; i++) {
    assert.equal((await ch.call('/p.S/M', Buffer.alloc(0), 3000)).toString(), 'm');
    await until(() => p.resets.length === i + 1, 10_000, 'the stream closed');
  }
  assert.equal(p.streams(), 3, 'no call sent twice');
  assert.equal(p.sessions(), 3);
});

test('a GOAWAY whose code is REFUSED_STREAM but whose last stream is this one: handled, so not sent again', LIMIT, async () => {
  const p = await peer((stream, _h, s) => {
    s.goaway(http2.constants.NGHTTP2_REFUSED_STREAM, stream.id);
    setImmediate(() => s.destroy());
  });
  await fails(channel(p.addr).call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
  assert.equal(p.streams(), 1);
});

test('a connection lost before the answer, or after its headers, is UNAVAILABLE (handled or not, unknown)', LIMIT, async () => {
  const before = await peer((_stream, _h, s) => s.destroy());
  await fails(channel(before.addr).call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
  const during = await peer((stream, _h, s) => {
    stream.respond({ ':status': 200, 'content-type': 'application/grpc' });
    stream.write(frame(Buffer.from('part')).subarray(0, 6), () => setImmediate(() => s.destroy()));
  });
  await fails(channel(during.addr).call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
});

test('nothing listening is UNAVAILABLE at once; waitForReady waits for the server within the deadline', LIMIT, async () => {
  const port = await freePort();
  const ch = channel(`127.0.0.1:${port}`);
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 150, true), Status.DEADLINE_EXCEEDED);
  const later = ch.call('/p.S/M', Buffer.alloc(0), 15_000, true);
  await new Promise((r) => setTimeout(r, 200));
  await peer((stream, h, s) => ok(frame(Buffer.from('ready')))(stream, h, s), port);
  assert.equal((await later).toString(), 'ready');
});

/** A TCP server that accepts and never writes a byte. */
async function silent(): Promise<{ addr: string; sockets: Socket[] }> {
  const sockets: Socket[] = [];
  const server = createServer((s) => {
    sockets.push(s);
    s.on('error', () => {});
    s.resume(); // read (and drop) what comes, so that its end is seen
  });
  closers.push(() => {
    for (const s of sockets) s.destroy();
    server.close();
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return { addr: `127.0.0.1:${(server.address() as AddressInfo).port}`, sockets };
}

test('a TLS handshake that never completes ends each call at its deadline, waitForReady too, and the attempt is dropped', LIMIT, async () => {
  const { addr, sockets } = await silent();
  const ch = channel(addr, { tls: {} });
  for (const ready of [false, true]) {
    const started = Date.now();
    await fails(ch.call('/p.S/M', Buffer.alloc(0), 500, ready), Status.DEADLINE_EXCEEDED);
    assert.ok(Date.now() - started < 10_000);
  }
  assert.equal(sockets.length, 1, 'one attempt, shared');
  // The stalled attempt is given up (its socket closed), and the next call
  // connects afresh.
  await until(() => sockets[0].readableEnded, 10_000, 'the stalled attempt dropped');
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 500), Status.DEADLINE_EXCEEDED);
  assert.equal(sockets.length, 2);
});

test('a call that joins a slow connection attempt extends it to its own deadline', LIMIT, async () => {
  // A TLS HTTP/2 server for 127.0.0.1 (a self-signed certificate made by
  // the openssl CLI), behind a relay that holds each connection's bytes
  // for 1.5 s: the handshake completes after the first call's deadline.
  const dir = mkdtempSync(join(tmpdir(), 'stateseal-transport-'));
  execFileSync('openssl', ['req', '-x509', '-newkey', 'ec', '-pkeyopt', 'ec_paramgen_curve:P-256', '-nodes', '-days', '1',
    '-subj', '/CN=127.0.0.1', '-addext', 'subjectAltName=IP:127.0.0.1', '-keyout', 'key.pem', '-out', 'cert.pem'],
    { cwd: dir, stdio: ['ignore', 'ignore', 'pipe'] });
  const cert = readFileSync(join(dir, 'cert.pem'));
  const server = http2.createSecureServer({ key: readFileSync(join(dir, 'key.pem')), cert });
  closers.push(() => server.close());
  server.on('stream', (stream, headers) => {
    stream.on('error', () => {});
    stream.resume();
    stream.on('end', () => ok(frame(Buffer.from('late')))(stream as http2.ServerHttp2Stream, headers, stream.session as never));
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const port = (server.address() as AddressInfo).port;
  const relay: TcpServer = createServer((down) => {
    const up = createConnection({ host: '127.0.0.1', port });
    const held: Buffer[] = [];
    let open = false;
    down.on('data', (d: Buffer) => (open ? up.write(d) : held.push(d)));
    setTimeout(() => {
      open = true;
      for (const d of held) up.write(d);
    }, 1500);
    up.on('data', (d) => down.write(d));
    for (const s of [up, down]) s.on('error', () => {});
    up.on('close', () => down.destroy());
    down.on('close', () => up.destroy());
  });
  closers.push(() => relay.close());
  await new Promise<void>((r) => relay.listen(0, '127.0.0.1', r));
  const ch = channel(`127.0.0.1:${(relay.address() as AddressInfo).port}`, { tls: { ca: cert } });
  const first = ch.call('/p.S/M', Buffer.alloc(0), 1000);
  await new Promise((r) => setTimeout(r, 300));
  const second = ch.call('/p.S/M', Buffer.alloc(0), 15_000);
  await fails(first, Status.DEADLINE_EXCEEDED);
  assert.equal((await second).toString(), 'late');
});

test('a session that stops answering is dropped after a call runs out its deadline; the next call connects afresh', LIMIT, async () => {
  const p = await peer((stream, h, s) => ok(frame(Buffer.from('m')))(stream, h, s));
  const port = Number(p.addr.split(':')[1]);
  // A relay whose connections, once `cut`, forward nothing either way
  // (a half-open path); connections made after stay whole.
  const ends: boolean[] = [];
  const relay: TcpServer = createServer((down) => {
    const born = cutAt;
    const at = ends.push(false) - 1;
    down.on('close', () => (ends[at] = true));
    const up = createConnection({ host: '127.0.0.1', port });
    const open = () => cutAt === born;
    down.on('data', (d) => open() && up.write(d));
    up.on('data', (d) => open() && down.write(d));
    for (const s of [up, down]) s.on('error', () => {});
    up.on('close', () => down.destroy());
    down.on('close', () => up.destroy());
  });
  let cutAt = 0;
  closers.push(() => relay.close());
  await new Promise<void>((r) => relay.listen(0, '127.0.0.1', r));
  const ch = channel(`127.0.0.1:${(relay.address() as AddressInfo).port}`);
  assert.equal((await ch.call('/p.S/M', Buffer.alloc(0), 5000)).toString(), 'm');
  cutAt++;
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 300), Status.DEADLINE_EXCEEDED);
  // Unanswered for PING_TIMEOUT_MS, the session is dropped.
  await until(() => ends[0], PING_TIMEOUT_MS + 10_000, 'the silent session dropped');
  assert.equal((await ch.call('/p.S/M', Buffer.alloc(0), 5000)).toString(), 'm');
  assert.equal(p.sessions(), 2);
});

test('an address with a scheme or path, or TLS with a key and no certificate, is refused', () => {
  for (const bad of ['http://127.0.0.1:1', '127.0.0.1:1/x', '127.0.0.1', '127.0.0.1:99999', ':1', 'a b:1']) {
    assert.throws(() => new Channel(bad), TypeError, bad);
  }
  assert.throws(() => new Channel('127.0.0.1:1', { tls: { key: 'k' } }), TypeError);
  assert.throws(() => new Channel('127.0.0.1:1', { tls: { cert: 'c' } }), TypeError);
  new Channel('[::1]:1').close();
});
