// The package's unary gRPC transport against a hostile or failing HTTP/2
// peer on loopback: every way an answer can be wrong or missing ends in one
// fixed gRPC status, never a hang, a crash or a message that was not sent.
import assert from 'node:assert/strict';
import http2 from 'node:http2';
import type { AddressInfo } from 'node:net';
import { after, test } from 'node:test';

import { CallError, Channel, MAX_RESPONSE_BYTES, Status } from '../src/transport.js';
import { freePort } from './helpers.js';

type Handler = (stream: http2.ServerHttp2Stream, headers: http2.IncomingHttpHeaders, session: http2.ServerHttp2Session) => void;

const servers: http2.Http2Server[] = [];
after(() => {
  for (const s of servers) s.close();
});

/** An HTTP/2 server on 127.0.0.1 that reads each request's body, then lets
 * `handler` answer it. */
async function peer(handler: Handler, port = 0): Promise<{ addr: string; sessions: () => number; streams: () => number }> {
  const server = http2.createServer();
  servers.push(server);
  let sessions = 0;
  let streams = 0;
  server.on('session', (s) => {
    sessions++;
    s.on('error', () => {});
  });
  server.on('stream', (stream, headers) => {
    streams++;
    stream.on('error', () => {});
    stream.resume();
    stream.on('end', () => handler(stream as http2.ServerHttp2Stream, headers, stream.session as http2.ServerHttp2Session));
  });
  await new Promise<void>((r) => server.listen(port, '127.0.0.1', r));
  return { addr: `127.0.0.1:${(server.address() as AddressInfo).port}`, sessions: () => sessions, streams: () => streams };
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

test('a unary call sends one framed message with its deadline and headers, and returns the one message', async () => {
  let seen: http2.IncomingHttpHeaders | undefined;
  let body = Buffer.alloc(0);
  const server = http2.createServer();
  servers.push(server);
  server.on('stream', (stream, headers) => {
    seen = headers;
    stream.on('data', (c: Buffer) => (body = Buffer.concat([body, c])));
    stream.on('end', () => ok(frame(Buffer.from('answer')))(stream as http2.ServerHttp2Stream, headers, stream.session as never));
  });
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  const ch = new Channel(`127.0.0.1:${(server.address() as AddressInfo).port}`, { headers: { authorization: 'Bearer x' } });
  const got = await ch.call('/p.S/M', Buffer.from('question'), 3000);
  ch.close();
  assert.equal(got.toString(), 'answer');
  assert.deepEqual(body, frame(Buffer.from('question')));
  assert.equal(seen?.[':path'], '/p.S/M');
  assert.equal(seen?.['content-type'], 'application/grpc');
  assert.equal(seen?.te, 'trailers');
  assert.equal(seen?.authorization, 'Bearer x');
  assert.match(String(seen?.['grpc-timeout']), /^\d{1,8}m$/);
  assert.ok(Number(String(seen?.['grpc-timeout']).slice(0, -1)) <= 3000);
});

test('no answer within the deadline is DEADLINE_EXCEEDED, and the stream is cancelled', async () => {
  let reset = -1;
  const p = await peer((stream) => {
    stream.on('close', () => (reset = stream.rstCode));
  });
  const ch = new Channel(p.addr);
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 200), Status.DEADLINE_EXCEEDED);
  for (let i = 0; i < 100 && reset < 0; i++) await new Promise((r) => setTimeout(r, 20));
  ch.close();
  assert.equal(reset, http2.constants.NGHTTP2_CANCEL);
});

test('a status with details is that status with those details; an unknown code is UNKNOWN', async () => {
  const details = Buffer.from('details bytes');
  let code = '5';
  const p = await peer((stream) => {
    stream.respond(
      { ':status': 200, 'content-type': 'application/grpc', 'grpc-status': code, 'grpc-status-details-bin': details.toString('base64') },
      { endStream: true },
    );
  });
  const ch = new Channel(p.addr);
  const e = await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.NOT_FOUND);
  assert.deepEqual(e.details, details);
  code = '99';
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNKNOWN);
  code = 'x';
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNKNOWN);
  ch.close();
});

test('a body that is not exactly one uncompressed message is INTERNAL', async () => {
  const m = Buffer.from('message');
  const bodies = [
    frame(m, 1), // compressed, which was never offered
    frame(m).subarray(0, 8), // shorter than its length
    Buffer.concat([frame(m), frame(m)]), // two messages
    Buffer.from([0, 0, 0]), // a partial prefix
    Buffer.alloc(0), // no message with OK
  ];
  let i = 0;
  const p = await peer((stream, h, s) => ok(bodies[i++])(stream, h, s));
  const ch = new Channel(p.addr);
  for (let n = 0; n < bodies.length; n++) await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.INTERNAL);
  ch.close();
});

test('a response over the size limit is RESOURCE_EXHAUSTED and is not read to its end', async () => {
  const p = await peer((stream, h, s) => ok(frame(Buffer.alloc(MAX_RESPONSE_BYTES + 1)))(stream, h, s));
  const ch = new Channel(p.addr);
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 10_000), Status.RESOURCE_EXHAUSTED);
  ch.close();
});

test('an answer that is not gRPC maps by its HTTP status', async () => {
  const answers: Array<[number, string, Status]> = [
    [503, 'text/plain', Status.UNAVAILABLE],
    [401, 'text/plain', Status.UNAUTHENTICATED],
    [404, 'application/grpc', Status.UNIMPLEMENTED],
    [200, 'text/html', Status.UNKNOWN],
    [500, 'text/plain', Status.UNKNOWN],
  ];
  let i = 0;
  const p = await peer((stream) => {
    const [status, type] = answers[i++];
    stream.respond({ ':status': status, 'content-type': type });
    stream.end('<html>');
  });
  const ch = new Channel(p.addr);
  for (const [, , code] of answers) await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), code);
  ch.close();
});

test('a stream the server refuses unprocessed is sent once more; refused twice it is UNAVAILABLE', async () => {
  let refuse = 1;
  const p = await peer((stream, h, s) => {
    if (refuse-- > 0) stream.close(http2.constants.NGHTTP2_REFUSED_STREAM);
    else ok(frame(Buffer.from('second')))(stream, h, s);
  });
  const ch = new Channel(p.addr);
  assert.equal((await ch.call('/p.S/M', Buffer.alloc(0), 3000)).toString(), 'second');
  assert.equal(p.streams(), 2);
  refuse = 2;
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
  assert.equal(p.streams(), 4, 'sent at most twice');
  ch.close();
});

test('after GOAWAY the next call opens a new session', async () => {
  const p = await peer((stream, h, s) => {
    ok(frame(Buffer.from('m')))(stream, h, s);
    stream.on('close', () => s.goaway());
  });
  const ch = new Channel(p.addr);
  for (let i = 0; i < 3; i++) {
    assert.equal((await ch.call('/p.S/M', Buffer.alloc(0), 3000)).toString(), 'm');
    await new Promise((r) => setTimeout(r, 50));
  }
  ch.close();
  assert.equal(p.sessions(), 3);
});

test('a connection lost before the answer is UNAVAILABLE (handled or not, unknown)', async () => {
  const p = await peer((_stream, _h, s) => s.destroy());
  const ch = new Channel(p.addr);
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
  ch.close();
});

test('nothing listening is UNAVAILABLE at once; waitForReady waits for the server within the deadline', async () => {
  const port = await freePort();
  const ch = new Channel(`127.0.0.1:${port}`);
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 3000), Status.UNAVAILABLE);
  await fails(ch.call('/p.S/M', Buffer.alloc(0), 150, true), Status.DEADLINE_EXCEEDED);
  const later = ch.call('/p.S/M', Buffer.alloc(0), 10_000, true);
  await new Promise((r) => setTimeout(r, 200));
  await peer((stream, h, s) => ok(frame(Buffer.from('ready')))(stream, h, s), port);
  assert.equal((await later).toString(), 'ready');
  ch.close();
});

test('an address with a scheme or path is refused', () => {
  assert.throws(() => new Channel('http://127.0.0.1:1'), TypeError);
  assert.throws(() => new Channel('127.0.0.1:1/x'), TypeError);
});
