"""The HTTP/1.1 side of the client on etcd: connections to the members of
a cluster, etcd's JSON gateway calls (``POST /v3/…``) with their retry and
authentication rules, streamed answers (watches), and the JSON field
readers. The recipe on top of it (docs/ETCD.md) is ``_etcd``; the Rust
client splits the same way (src/client/etcd/http.rs, recipe.rs).
"""

import base64
import json
import re
import socket
import ssl
import threading
import time
from typing import Any, List, Union

from ._common import log

monotonic = time.monotonic

#: The pause before a repeatable request is tried again, and between
#: rounds over all members when none took a request.
RETRY_PAUSE = 0.05

#: Idle connections kept per member.
IDLE_PER_MEMBER = 8

#: The largest answer body accepted.
BODY_MAX = 1 << 20

#: The largest answer head, chunk-size line or streamed message line.
HEAD_MAX = 16 * 1024


class _Unsent(Exception):
    """No byte of the request reached any member."""


class _Unanswered(Exception):
    """The request may have reached a member, and no complete answer came."""


class Denied(Exception):
    """etcd has authentication on and refused this client: no or wrong user
    and password, or a role without permission for the key. etcd executed
    nothing; the call ends ``PermissionDenied``."""

    def __init__(self, reason):
        super().__init__(reason)
        self.reason = reason


#: Why etcd refused, in the words of the Rust client.
NOT_AUTHENTICATED = (
    "etcd has authentication on and did not take this client's user (etcd_credentials, "
    "or KUNCI_ETCD_USER and KUNCI_ETCD_PASSWORD; docs/ETCD.md)")
NOT_PERMITTED = "the etcd user's roles do not allow this request on that key"


def _request_bytes(path, body, token=None):
    authorization = b""
    # etcd's tokens are printable ASCII; anything else is not sent.
    if token and all(0x21 <= ord(c) <= 0x7e for c in token):
        authorization = b"Authorization: %s\r\n" % token.encode("ascii")
    return b"POST %s HTTP/1.1\r\nHost: etcd\r\nContent-Type: application/json\r\n" \
        b"%sContent-Length: %d\r\n\r\n%s" % (path.encode(), authorization, len(body), body)


def _still_open(sock):
    """Whether an idle connection is usable: nothing to read, not closed."""
    try:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return False
        sock.setblocking(False)
        try:
            # The TCP stream under TLS too: any record, or its end, means
            # the connection is not idle any more.
            socket.socket.recv(sock, 1, socket.MSG_PEEK)
            return False
        except BlockingIOError:
            return True
        finally:
            sock.setblocking(True)
    except OSError:
        return False


def _write(sock, data, deadline):
    """Writes ``data`` by ``deadline``; on failure, the count of bytes the
    socket took (0: certainly not sent)."""
    written = 0
    while written < len(data):
        left = deadline - monotonic()
        if left <= 0:
            return written
        try:
            sock.settimeout(left)
            written += sock.send(data[written:])
        except InterruptedError:
            continue
        except OSError:
            return written
    return None


class _Reader(object):
    """A connection and the bytes read from it but not used yet."""

    def __init__(self, sock):
        self.sock = sock
        self.buf = bytearray()

    def fill(self, deadline):
        """Reads more bytes by ``deadline``: ``socket.timeout`` when it
        passes, ``EOFError`` at the end of the stream."""
        left = deadline - monotonic()
        if left <= 0:
            raise socket.timeout("deadline passed")
        self.sock.settimeout(left)
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("closed by the member")
        self.buf += data

    def line(self, deadline):
        while True:
            end = self.buf.find(b"\r\n")
            if end >= 0:
                line = bytes(self.buf[:end])
                del self.buf[:end + 2]
                return line
            if len(self.buf) > HEAD_MAX:
                raise ValueError("line too long")
            self.fill(deadline)

    def head(self, deadline):
        """``(status, chunked, content_length, keep_alive)``."""
        status_line = self.line(deadline)
        parts = status_line.split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ValueError("malformed status line")
        status = int(parts[1])
        keep_alive = parts[0] == b"HTTP/1.1"
        chunked, length = False, None
        for _ in range(100):
            line = self.line(deadline)
            if not line:
                return status, chunked, length, keep_alive
            name, sep, value = line.partition(b":")
            if not sep:
                raise ValueError("malformed header")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"transfer-encoding":
                chunked = value == b"chunked"
            elif name == b"content-length":
                if not value.isdigit():
                    raise ValueError("content-length")
                length = int(value)
            elif name == b"connection" and value == b"close":
                keep_alive = False
        raise ValueError("too many headers")

    def take(self, count, deadline):
        while len(self.buf) < count:
            self.fill(deadline)
        data = bytes(self.buf[:count])
        del self.buf[:count]
        return data

    def chunk_size(self, deadline):
        digits = self.line(deadline).split(b";")[0].strip()
        try:
            return int(digits, 16)
        except ValueError:
            raise ValueError("chunk size")

    def answer(self, deadline):
        """``(status, body, reusable)``."""
        status, chunked, length, keep_alive = self.head(deadline)
        if chunked:
            body: Union[bytes, bytearray] = bytearray()
            while True:
                size = self.chunk_size(deadline)
                if size == 0:
                    self.line(deadline)  # the empty trailer
                    break
                if size > BODY_MAX - len(body):
                    raise ValueError("answer too long")
                body += self.take(size, deadline)
                if self.line(deadline):
                    raise ValueError("chunk not followed by CRLF")
            body = bytes(body)
        elif length is not None:
            if length > BODY_MAX:
                raise ValueError("answer too long")
            body = self.take(length, deadline)
        else:
            raise ValueError("answer without a length")
        return status, body, keep_alive and not self.buf


class _Stream(object):
    """The chunked body of a watch, one newline-delimited message at a
    time. Its buffers outlive a read that timed out."""

    def __init__(self, reader):
        self.reader = reader
        self.chunk_left = 0
        self.need_crlf = False
        self.lines = bytearray()

    def next_message(self, until):
        """The next message, or ``None`` when ``until`` passes first.
        Raises when the stream ended or broke."""
        while True:
            end = self.lines.find(b"\n")
            if end >= 0:
                message = bytes(self.lines[:end + 1])
                del self.lines[:end + 1]
                return message
            if len(self.lines) > BODY_MAX:
                raise ValueError("stream message too long")
            try:
                self._read_body(until)
            except socket.timeout:
                if monotonic() >= until:
                    return None
                raise

    def _read_body(self, until):
        reader = self.reader
        if self.need_crlf:
            # Only whole lines leave the buffer, so a timeout loses nothing.
            if reader.line(until):
                raise ValueError("chunk not followed by CRLF")
            self.need_crlf = False
        if self.chunk_left == 0:
            size = reader.chunk_size(until)
            if size == 0:
                raise EOFError("the watch ended")
            self.chunk_left = size
        if not reader.buf:
            reader.fill(until)
        count = min(self.chunk_left, len(reader.buf))
        self.lines += reader.buf[:count]
        del reader.buf[:count]
        self.chunk_left -= count
        self.need_crlf = self.chunk_left == 0

    def close(self):
        try:
            self.reader.sock.close()
        except OSError:
            pass


class Members(object):
    """The members of one cluster and idle connections to them. Says for
    every failure whether the request was certainly not sent (it may move
    to another member, rule 4) or possibly sent (never sent again, rule
    5)."""

    def __init__(self, endpoints, connect_timeout, tls=None, credentials=None):
        self.endpoints = endpoints
        self.connect_timeout = connect_timeout
        # ``etcds://``: the ``ssl.SSLContext`` of every member; else ``None``.
        self.tls = tls
        self.credentials = credentials
        self._idle: List[List[Any]] = [[] for _ in endpoints]
        self._lock = threading.Lock()
        # The member that answered last: tried first.
        self.preferred = 0
        # The token the credentials got, while etcd takes it; its lock is
        # held while a token is asked for, so only one request asks.
        self._token = None
        self._token_lock = threading.Lock()

    def _token_for(self, deadline):
        """The token to send (``None`` without credentials), getting one
        first if there is none. etcd answers a request without a valid
        token before executing anything, so a failure here leaves the
        request certainly unsent: ``_Unsent``, or ``Denied``."""
        if self.credentials is None:
            return None
        with self._token_lock:
            if self._token is not None:
                return self._token
            user, password = self.credentials
            body = json.dumps({"name": user, "password": password}).encode()
            try:
                _, status, answer = self._post_once(
                    "/v3/auth/authenticate", body, None, deadline)
            except _Unanswered:
                raise _Unsent()
            value = _parse(answer)
            fresh = value.get("token") if isinstance(value, dict) else None
            if status != 200 or not isinstance(fresh, str) or not fresh:
                log.debug("etcd authenticate: status %d: %r", status, answer[:200])
                raise Denied(NOT_AUTHENTICATED)
            self._token = fresh
            return fresh

    def _forget_token(self):
        with self._token_lock:
            self._token = None

    def post(self, path, body, deadline):
        """``(sent_at, status, body)`` of ``body`` posted to ``path``;
        raises ``_Unsent``, ``_Unanswered`` or ``Denied``.

        With credentials, the request carries a token; a token etcd no
        longer takes (it expires when unused) is replaced and the request
        sent again once, since etcd executed nothing."""
        token = self._token_for(deadline)
        answer = self._post_once(path, body, token, deadline)
        if answer[1] == 401 and self.credentials is not None:
            self._forget_token()
            answer = self._post_once(path, body, self._token_for(deadline), deadline)
        status = answer[1]
        if status == 401:
            raise Denied(NOT_AUTHENTICATED)
        if status == 403:
            raise Denied(NOT_PERMITTED)
        if status == 400 and b"user name is empty" in answer[2]:
            raise Denied(NOT_AUTHENTICATED)
        return answer

    def _post_once(self, path, body, token, deadline):
        request = _request_bytes(path, body, token)
        count = len(self.endpoints)
        while True:
            first = self.preferred
            for step in range(count):
                member = (first + step) % count
                sock = self._connection(member, deadline)
                if sock is None:
                    continue
                sent_at = monotonic()
                written = _write(sock, request, deadline)
                if written == 0:
                    sock.close()
                    continue
                if written is not None:
                    sock.close()
                    self._avoid(member)
                    raise _Unanswered()
                reader = _Reader(sock)
                try:
                    status, answer, reusable = reader.answer(deadline)
                except (OSError, EOFError, ValueError) as error:
                    log.debug("etcd %s:%d: no answer: %s", *(self.endpoints[member] + (error,)))
                    sock.close()
                    self._avoid(member)
                    raise _Unanswered()
                self.preferred = member
                if reusable:
                    self._put_idle(member, sock)
                else:
                    sock.close()
                return sent_at, status, answer
            left = deadline - monotonic()
            if left <= 0:
                raise _Unsent()
            time.sleep(min(left, RETRY_PAUSE))

    def _avoid(self, member):
        """After ``member`` left a request unanswered, the next request
        starts with the member after it: a member that accepts and stays
        silent must not keep every call."""
        if self.preferred == member:
            self.preferred = (member + 1) % len(self.endpoints)

    def open_stream(self, path, body, deadline):
        """A streaming answer (a watch) on a fresh connection, after its
        ``200`` head; ``None`` on any failure (a watch changes nothing)."""
        try:
            token = self._token_for(deadline)
        except (_Unsent, Denied):
            return None
        request = _request_bytes(path, body, token)
        count = len(self.endpoints)
        first = self.preferred
        for step in range(count):
            member = (first + step) % count
            sock = self._connect(member, deadline)
            if sock is None:
                continue
            if _write(sock, request, deadline) is not None:
                sock.close()
                continue
            reader = _Reader(sock)
            try:
                status, chunked, _, _ = reader.head(deadline)
            except (OSError, EOFError, ValueError) as error:
                log.debug("etcd watch: %s", error)
                sock.close()
                self._avoid(member)
                continue
            if status == 200 and chunked:
                return _Stream(reader)
            sock.close()
        return None

    def _connection(self, member, deadline):
        while True:
            with self._lock:
                idle = self._idle[member]
                sock = idle.pop() if idle else None
            if sock is None:
                return self._connect(member, deadline)
            if _still_open(sock):
                return sock
            sock.close()

    def _connect(self, member, deadline):
        left = deadline - monotonic()
        if left <= 0:
            return None
        try:
            sock = socket.create_connection(
                self.endpoints[member], min(left, self.connect_timeout))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as error:
            log.debug("etcd %s:%d: %s", *(self.endpoints[member] + (error,)))
            return None
        if self.tls is None:
            return sock
        return self._start_tls(member, sock, deadline)

    def _start_tls(self, member, sock, deadline):
        """The TLS session over ``sock``, its handshake done by
        ``deadline``; ``None`` if it fails. No byte of a request has been
        sent then, so the request moves on to the next member. A failure
        that says what is wrong with a certificate is worth a warning, since
        trying again will not change it."""
        host = self.endpoints[member][0]
        try:
            tls = self.tls.wrap_socket(sock, server_hostname=host,
                                       do_handshake_on_connect=False)
        except (OSError, ValueError) as error:
            log.warning("etcd %s:%d: TLS: %s", *(self.endpoints[member] + (error,)))
            sock.close()
            return None
        try:
            left = deadline - monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed")
            tls.settimeout(left)
            tls.do_handshake()
            return tls
        except ssl.SSLError as error:
            log.warning("etcd %s:%d: TLS: %s", *(self.endpoints[member] + (error,)))
        except OSError as error:
            log.debug("etcd %s:%d: TLS handshake: %s", *(self.endpoints[member] + (error,)))
        tls.close()
        return None

    def close_idle(self):
        """Closes the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, [[] for _ in self.endpoints]
        for socks in idle:
            for sock in socks:
                sock.close()

    def _put_idle(self, member, sock):
        with self._lock:
            idle = self._idle[member]
            if len(idle) < IDLE_PER_MEMBER:
                idle.append(sock)
                return
        sock.close()


# ------------------------------------------------------------------ JSON


def _b64(data):
    return base64.b64encode(data).decode("ascii")


def _parse(body):
    """An answer body as a dict, or ``None``."""
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def _int(value, name):
    """An integer field: etcd writes 64-bit integers as strings and leaves
    out fields that are zero (missing is 0); ``None`` when malformed."""
    if not isinstance(value, dict):
        return None
    field = value.get(name)
    if field is None:
        return 0
    if isinstance(field, bool):
        return None
    if isinstance(field, int):
        return field
    if isinstance(field, str) and re.match(r"-?[0-9]{1,20}\Z", field):
        return int(field)
    return None


def _bytes(value, name):
    field = value.get(name) if isinstance(value, dict) else None
    if field is None:
        return b""
    if not isinstance(field, str):
        return None
    try:
        return base64.b64decode(field, validate=True)
    except ValueError:
        return None


def _array(value, name):
    field = value.get(name) if isinstance(value, dict) else None
    return field if isinstance(field, list) else []


def _field(value, name):
    return value.get(name) if isinstance(value, dict) else None
