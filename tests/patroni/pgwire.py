"""A minimal PostgreSQL wire-protocol client, standard library only, for the
probes in this directory: trust authentication, simple queries, and the
extended protocol exactly as tokio-postgres 0.7 drives it (a named statement
"s0" parsed and described in one Sync, bound and executed in a later one).
It keeps what a driver usually hides: the BackendKeyData process id and the
ParameterStatus messages of the startup.
"""

import socket
import struct


class PgError(Exception):
    def __init__(self, fields):
        self.fields = fields
        self.code = fields.get("C")
        super().__init__(f'{fields.get("S", "ERROR")}: {fields.get("M")} (SQLSTATE {self.code})')


def _msg(kind, payload=b""):
    return kind + struct.pack("!I", len(payload) + 4) + payload


def _cstr(s):
    return s.encode() + b"\0"


class Conn:
    def __init__(self, host, port, user="postgres", database="test", timeout=10.0, **params):
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.sock.settimeout(timeout)
        self.host, self.port = host, port
        self.params = {}
        self.backend_pid = None
        self.secret = None
        body = struct.pack("!I", 196608) + _cstr("user") + _cstr(user) + _cstr("database") + _cstr(database)
        for k, v in params.items():
            body += _cstr(k) + _cstr(v)
        body += b"\0"
        self.sock.sendall(struct.pack("!I", len(body) + 4) + body)
        self.buf = b""
        while True:
            kind, data = self._read()
            if kind == b"R":
                if struct.unpack("!I", data[:4])[0] != 0:
                    raise PgError({"M": "only trust authentication is supported here"})
            elif kind == b"S":
                k, v, _ = data.split(b"\0", 2)
                self.params[k.decode()] = v.decode()
            elif kind == b"K":
                self.backend_pid, self.secret = struct.unpack("!iI", data)
            elif kind == b"E":
                raise PgError(self._fields(data))
            elif kind == b"Z":
                return

    def _recv_exact(self, n):
        while len(self.buf) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("server closed the connection")
            self.buf += chunk
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def _read(self):
        head = self._recv_exact(5)
        kind, ln = head[:1], struct.unpack("!I", head[1:])[0]
        return kind, self._recv_exact(ln - 4)

    @staticmethod
    def _fields(data):
        out = {}
        for part in data.split(b"\0"):
            if part:
                out[part[:1].decode()] = part[1:].decode(errors="replace")
        return out

    def _until_ready(self):
        """Rows, the command tag, the first error (raised after ReadyForQuery)."""
        rows, tag, err = [], None, None
        while True:
            kind, data = self._read()
            if kind == b"D":
                n = struct.unpack("!H", data[:2])[0]
                pos, row = 2, []
                for _ in range(n):
                    ln = struct.unpack("!i", data[pos:pos + 4])[0]
                    pos += 4
                    if ln < 0:
                        row.append(None)
                    else:
                        row.append(data[pos:pos + ln].decode())
                        pos += ln
                rows.append(row)
            elif kind == b"C":
                tag = data.rstrip(b"\0").decode()
            elif kind == b"E":
                err = err or PgError(self._fields(data))
            elif kind == b"S":
                k, v, _ = data.split(b"\0", 2)
                self.params[k.decode()] = v.decode()
            elif kind == b"Z":
                self.status = data.decode()
                if err:
                    raise err
                return rows, tag

    def query(self, sql):
        self.sock.sendall(_msg(b"Q", _cstr(sql)))
        return self._until_ready()

    # The extended protocol, as tokio-postgres uses it.
    def prepare(self, name, sql):
        """Client::prepare: Parse(name) + Describe(statement) + Sync."""
        self.sock.sendall(_msg(b"P", _cstr(name) + _cstr(sql) + struct.pack("!H", 0))
                          + _msg(b"D", b"S" + _cstr(name)) + _msg(b"S"))
        return self._until_ready()

    def execute(self, name, params=()):
        """Client::query with a Statement: Bind(unnamed portal, name) + Execute + Sync."""
        body = _cstr("") + _cstr(name) + struct.pack("!H", 0) + struct.pack("!H", len(params))
        for p in params:
            if p is None:
                body += struct.pack("!i", -1)
            else:
                b = str(p).encode()
                body += struct.pack("!i", len(b)) + b
        body += struct.pack("!H", 0)
        self.sock.sendall(_msg(b"B", body) + _msg(b"E", _cstr("") + struct.pack("!I", 0)) + _msg(b"S"))
        return self._until_ready()

    def unnamed(self, sql, params=()):
        """Client::query_typed: Parse("") + Bind + Describe(portal) + Execute + Sync, one round trip."""
        body = _cstr("") + _cstr(sql) + struct.pack("!H", 0)
        bind = _cstr("") + _cstr("") + struct.pack("!H", 0) + struct.pack("!H", len(params))
        for p in params:
            b = str(p).encode()
            bind += struct.pack("!i", len(b)) + b
        bind += struct.pack("!H", 0)
        self.sock.sendall(_msg(b"P", body) + _msg(b"B", bind) + _msg(b"D", b"P\0")
                          + _msg(b"E", b"\0" + struct.pack("!I", 0)) + _msg(b"S"))
        return self._until_ready()

    def close(self):
        try:
            self.sock.sendall(_msg(b"X"))
        except OSError:
            pass
        self.sock.close()


def connect_read_write(hosts, user="postgres", database="test", timeout=3.0, **params):
    """libpq's target_session_attrs=read-write: the first host whose session is not read-only."""
    last = None
    for host, port in hosts:
        try:
            c = Conn(host, port, user, database, timeout=timeout, **params)
        except (OSError, PgError, ConnectionError) as e:
            last = e
            continue
        try:
            rows, _ = c.query("SHOW transaction_read_only")
            if rows and rows[0][0] == "off":
                return c
            last = PgError({"M": f"{host}:{port} is read-only"})
        except (OSError, PgError, ConnectionError) as e:
            last = e
        c.close()
    raise ConnectionError(f"no read-write host: {last}")
