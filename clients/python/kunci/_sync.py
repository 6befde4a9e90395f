"""The thread-safe blocking client.

There is no I/O thread. A calling thread writes its own request (so the
wire wait and the send instant are taken just before its bytes go to the
socket) and then waits for the answer as a *leader* or a *follower*: one
waiting thread per session (the leader) reads the socket and hands every
answer to the call it correlates with (acquires by owner, the others by
token/nonce in request order); the other threads sleep on a private lock
until their answer, or the leader's role, is handed to them. A single
thread therefore makes a call with a few system calls and no thread switch,
and many threads pipeline their requests on one connection.

The leader also keeps every deadline of its session (rule 5): when the
earliest ``D`` of a call still waiting passes, it reads what has arrived,
and if that call is still unanswered, closes exactly that session.

One maintenance thread per client (started on first need) sends the
releases nobody waits for (a late grant's, a dropped ticket's) and runs
the keep-alive timers.
"""

import _thread
import atexit
import collections
import heapq
import math
import os
import select
import socket
import ssl
import sys
import threading
import time
import weakref
from types import TracebackType
from typing import (
    Any, Callable, ContextManager, Deque, Dict, Iterator, List, Optional, Tuple, Type, Union,
)

from . import _engine as E
from . import _etcd
from . import _protocol as P
from ._common import (
    EXIT_CLIENTS, EXIT_FLUSH, INDETERMINATE, KEPT_FOR_EXIT, MOVED, SENT, UNSENT, AddressBook, Call, Pending,
    TicketBase, answered_call, answers, begin_exit, check_args, check_on_lost, closed_result,
    exiting, holders_call, indeterminate, info_call, list_call, log, observe_call, ping_call, query_call,
    release_call, renew_call, result_of, tls_refusal,
)
from ._common import SHUTDOWN_NOTICE_WAIT, WaitForever, check_campaign_value
from ._common import Holders, KeyInfo, KeyStatus, Leader, leader_of, outcome_of
from ._engine import attempt_result, run_result
from ._errors import Error, Unavailable

monotonic = time.monotonic

# How long past its deadline a follower waits for its leader before it
# gives up on it (the leader always ends a call by its deadline; this only
# guards against a bug).
_CALL_GRACE = 1.0

_READ_CHUNK = 65536

# How long an interrupted acquire waits for the server to end its
# connection, which withdraws the wait (``Client._abandon``).
_WITHDRAW_WAIT = 1.0

# How long the maintenance thread stays with nothing to do before it ends.
_MAINTENANCE_IDLE_EXIT = 5.0

_CLIENTS: "weakref.WeakSet[Client]" = weakref.WeakSet()

# The socket took nothing by the deadline: the server is not reading. Not a
# reason to close the session by itself.
_NO_ROOM = "no room to write by the deadline"

# The reader of a session while ``_shutdown_seen`` looks at it.
_PROBE = object()


class _Session(object):
    """One connection to one address."""

    def __init__(self, index, sock, authenticating, book):
        self.index = index
        # The address book that keeps it (the client's, or its watches').
        self.book = book
        self.sock = sock
        self.fd = sock.fileno()
        # A U went first and its answer has not come yet; then the name it
        # gave. ``denied``: why the server refused the credentials.
        self.authenticating = authenticating
        self.user = None
        self.denied = None
        # An SSL object is not safe to use from two threads at once: its
        # reads and writes (never blocking) take this lock.
        self.tls = isinstance(sock, ssl.SSLSocket)
        self.tls_lock = threading.Lock()
        self.write_lock = threading.Lock()
        self.pending = Pending()
        self.buf = bytearray()
        self.frames = 0
        self.reader = None  # the Call whose thread reads, if any
        self.writers = 0
        self.alive = True
        self.refused = None  # (reason, code) after a first-frame X 7 / X 9
        self.fd_closed = False
        self.poll_until = math.inf
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.read_poll = select.poll()
        self.read_poll.register(self.fd, select.POLLIN)
        self.read_poll.register(self.wake_r, select.POLLIN)
        self.write_poll = select.poll()
        self.write_poll.register(self.fd, select.POLLOUT)

    def wake(self):
        try:
            os.write(self.wake_w, b"\0")
        except OSError:
            pass

    def __del__(self):
        # A client dropped without close() leaves no descriptor behind.
        try:
            self.close_fds()
        except Exception:
            pass

    def close_fds(self):
        if self.fd_closed:
            return
        self.fd_closed = True
        for close in (self.sock.close, lambda: os.close(self.wake_r), lambda: os.close(self.wake_w)):
            try:
                close()
            except OSError:
                pass


def _connect(address, timeout, context, auth_frame):
    """A connected socket, its TLS handshake done and the session's ``U``
    written (both within ``timeout``), non-blocking."""
    kind, where = address
    if kind == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(where)
        except BaseException:
            sock.close()
            raise
    else:
        deadline = monotonic() + timeout
        sock = socket.create_connection(where, timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if context is not None:
            try:
                sock.settimeout(max(0.001, deadline - monotonic()))
                sock = context.wrap_socket(sock, server_hostname=where[0])
            except BaseException:
                sock.close()
                raise
    if auth_frame is not None:
        try:
            sock.sendall(auth_frame)
        except BaseException:
            sock.close()
            raise
    sock.setblocking(False)
    return sock


class _SideSession(object):
    """What :func:`~kunci._common.answered_call` needs of a connection
    opened for a few calls only (:func:`_side_run`)."""

    def __init__(self, authenticating):
        self.authenticating = authenticating
        self.user = None
        self.denied = None
        self.refused = None
        self.frames = 0
        self.pending = Pending()


def _side_run(addresses, access, connect_timeout, calls, deadline, first, compensate):
    """Runs ``calls`` on a connection of their own, opened for them and
    closed after, blocking until ``deadline``: for a call made from a
    signal handler that interrupted a call of the same client, and for the
    flush at exit. It shares no lock and no connection with the client.
    Sets every call's result: one without an answer is indeterminate once
    written, else moved (nothing sent; its reason says why)."""
    count = len(addresses)
    reason = "no server could be reached by the deadline"
    for offset in range(count):
        index = (first + offset) % count
        left = deadline - monotonic()
        if left <= 0:
            break
        try:
            sock = _connect(addresses[index], min(connect_timeout, left), access.tls_for(index),
                            access.auth_frame)
        except (OSError, ValueError) as error:
            reason = "cannot connect to %s: %s" % (P.format_address(addresses[index]), error)
            continue
        try:
            _side_exchange(sock, access.auth_frame is not None, calls, deadline, compensate)
        finally:
            try:
                sock.close()
            except OSError:
                pass
        return
    for call in calls:
        if call.result is None:
            call.result = (MOVED, reason, 0)


def _side_exchange(sock, authenticating, calls, deadline, compensate):
    session = _SideSession(authenticating)
    now = monotonic()
    data = bytearray()
    for call in calls:
        session.pending.add(call)
        call.sent_at = now
        data += call.encode(now)
    buf = bytearray()
    try:
        sock.settimeout(max(0.001, deadline - monotonic()))
        sock.sendall(data)
        while any(call.result is None for call in calls):
            left = deadline - monotonic()
            if left <= 0:
                break
            sock.settimeout(left)
            chunk = sock.recv(_READ_CHUNK)
            if not chunk:
                break
            buf += chunk
            now = monotonic()
            for frame in P.decode_frames(buf):
                call, failure = answered_call(session, frame)
                if call is None:
                    if failure is None:
                        continue  # the answer to the U
                    raise P.ProtocolError(failure)
                result = result_of(call, frame, now, compensate)
                if result is not None and call.result is None:
                    call.result = result
    except (OSError, ValueError, P.ProtocolError) as error:
        log.debug("a connection of its own for %d request(s) failed: %s", len(calls), error)
    for call in calls:
        if call.result is None:
            call.result = closed_result(session)


class Client(E.ClientBase):
    """A handle to one lock service, reachable at one or more addresses.

    ``servers``: a list of ``HOST:PORT`` / ``tls://HOST:PORT`` /
    ``unix:PATH`` strings (several addresses of the same service), or one
    comma-separated string; default ``$KUNCI_SERVER``, else
    ``127.0.0.1:5862``. Nothing is connected until a call needs it. Safe
    to share between threads. See the README for every outcome.

    ``secret`` (str or bytes, at least 32 bytes; one trailing newline is
    dropped): sent as ``U`` first on every connection, for a server with
    ``--auth``; or ``secret_file``, a file holding it; default
    ``$KUNCI_SECRET``, else none. A secret goes only over TLS, to a
    loopback address or over a unix socket, unless
    ``allow_plaintext_secret=True`` (or ``KUNCI_ALLOW_PLAINTEXT_SECRET=1``).
    ``tls``: ``None`` (plaintext; a ``tls://`` address uses the default
    trust: the CA file in ``$KUNCI_TLS_CA``, else the system's), ``True``
    (TLS with the default trust) or an ``ssl.SSLContext`` (a private CA, a
    client certificate), for every TCP address; the server's name is
    checked against its certificate. Invalid either way:
    ``InvalidArgument`` at once, nothing connected.

    ``etcd://HOST:PORT[,HOST:PORT...]`` takes the locks on an etcd cluster
    (docs/ETCD.md); ``etcds://`` reaches its members over TLS with ``tls``
    (the system's trust when ``None``), checking the host in the address.
    ``etcd_credentials``: ``(user, password)`` for etcd's authentication
    (default ``$KUNCI_ETCD_USER`` and ``$KUNCI_ETCD_PASSWORD``). etcd takes
    no ``secret``, and ``etcd://`` no ``tls``.
    """

    def _init_client(self):
        # The clean-ups after an indeterminate acquire not done yet (owner:
        # key), for the flush at exit.
        self._cleanups = {}
        # How deep the calling thread is inside this client's calls: a call
        # made from a signal handler that interrupted one runs aside.
        self._depth = threading.local()
        self._init_state()
        _CLIENTS.add(self)

    def _init_state(self):
        self._pid = os.getpid()
        # On an etcd cluster every call runs the recipe of ``_etcd`` on
        # its calling thread instead of a session.
        self._etcd = _etcd.cluster_for(
            self._addresses, self._connect_timeout, self._access.etcd_tls,
            self._access.etcd_credentials)
        self._mu = threading.Lock()
        self._book = AddressBook(self._addresses)
        # Held watches (an ``O`` that waits) go on connections of their
        # own, so that they never count toward a connection's waits
        # (spec §13.3): a campaign on the same client is never ``Busy``
        # for its observers.
        self._watch_book = AddressBook(self._addresses)
        self._books = (self._book, self._watch_book)
        self._connect_locks = {id(book): [threading.Lock() for _ in self._addresses]
                               for book in self._books}
        # Maintenance thread: background releases and timers. Re-entrant:
        # a ticket's finalizer may start the thread while this thread holds
        # the lock (a collection during `_schedule`).
        self._maint_lock = threading.RLock()
        self._maint_thread = None
        self._maint_wake = None
        # (key, token) to release, appended and taken without a lock (a
        # deque's ends are atomic): by the maintenance thread, or, once the
        # client is closed, by the flush at exit.
        self._background: Deque[Tuple[bytes, int]] = collections.deque()
        self._timers = []
        self._timer_seq = 0

    # ----------------------------------------------------------------- API

    def acquire(self, key: str, wait: Optional[float] = 0, lease: int = 30, *,
                limit: Optional[int] = None, take: Optional[int] = None, shared: bool = False,
                label: Union[str, bytes, None] = None) -> "Ticket":
        """Takes the lock on ``key``, waiting up to ``wait`` seconds (0: one
        attempt; fractions allowed; at most 255), with a lease of ``lease``
        whole seconds (1..=255). Returns a :class:`Ticket`, or raises
        ``Timeout``, ``Busy``, ``Unavailable``, ``Indeterminate``,
        ``LimitMismatch`` or ``InvalidArgument``. Returns by
        ``start + wait + 5 s``.

        Permits (spec §10): by default the lock is exclusive. ``limit=N``
        makes the key a semaphore of N permits (1..=65535) and takes
        ``take`` of them (default 1); ``shared=True`` is a shared lock
        (many shared holders, or one exclusive). ``label``: up to 128
        UTF-8 bytes saying who asks, kept by the server with the grant.

        ``wait=None`` (or ``math.inf``) waits until granted, as ``kunci
        acquire --wait inf``: it queues 255 s at a time (a new place at the
        tail each time), waits through a server restart or outage, and
        after ``Indeterminate`` makes sure it holds nothing before asking
        again (:class:`kunci._common.WaitForever`). It ends only with a
        ``Ticket`` or an outcome that waiting cannot change (``Busy`` at a
        capacity limit, ``PermissionDenied``, ``LimitMismatch``...)."""
        work = E.acquisition(self, key, wait, lease, limit, take, shared, label)
        if isinstance(work, Call):
            return E.granted(self, work, self._run(work))
        return self._drive(work)

    def _shutdown_seen(self, notices):
        """Whether a server said it is shutting down (``X 8``) since the
        count was ``notices``, reading what has arrived on every idle
        session for up to ``SHUTDOWN_NOTICE_WAIT``."""
        give_up = monotonic() + SHUTDOWN_NOTICE_WAIT
        while self._book.shutdowns == notices:
            if monotonic() >= give_up:
                return False
            with self._mu:
                sessions = [s for s in self._book.sessions if s is not None and s.alive]
            for session in sessions:
                self._take_in_unread(session, _PROBE)
            time.sleep(0.005)
        return True

    def _clean_up_after(self, call):
        """After ``call`` (an acquire) ended ``Indeterminate``: on a thread
        of its own, asks who holds the key and releases the grant of the
        call's owner, if the server granted it after all (spec §8 rule
        11), so that the key is free long before the lease would end.
        The ``H``'s id is that owner, which no other request uses. Until
        the server has answered it, the flush at exit does it if the
        program ends (on a closed client, only the flush does it)."""
        looking = E.clean_up_call(self, call)
        if self._closed:
            KEPT_FOR_EXIT.add(self)
            return
        if not _start_thread(self._drive, "kunci-clean-up", E.clean_up(self, call, looking)):
            # The program ends (no thread may start then): done here, on
            # a connection of its own, bounded as the flush at exit.
            self._cleanups.pop(call.owner, None)
            try:
                release_found(self, [], [(call.owner, call.key)], monotonic() + EXIT_FLUSH)
            except Exception as error:  # never in the way of the program's end
                log.debug("clean-up after an indeterminate acquire: %s", error)

    def lock(self, key: str, wait: Optional[float] = 0, lease: int = 30,
             on_lost: Optional[Callable[["Ticket"], object]] = None, *,
             limit: Optional[int] = None, take: Optional[int] = None, shared: bool = False,
             label: Union[str, bytes, None] = None) -> ContextManager["Ticket"]:
        """A context manager that acquires ``key`` on entry (as
        :meth:`acquire`, with the same permit keywords), keeps its lease
        alive while the block runs (renews every lease/3) and releases it
        on exit. A grant that comes with less than two thirds of its lease
        left (after a long wait) is renewed before the block starts; if
        that renewal finds it gone, entering raises ``LockLost``. On loss,
        ``t.lost`` becomes true, ``on_lost(t)`` runs once (on a thread of
        its own) and ``t.check()`` raises ``LockLost``; leaving the block
        after a loss raises nothing. The object may be entered by several
        threads at once: each entry takes a ticket of its own. ``on_lost``
        that is not callable: ``InvalidArgument`` at once."""
        check_on_lost(on_lost)
        return _LockContext(self, (key, wait, lease),
                            dict(limit=limit, take=take, shared=shared, label=label), on_lost)

    def campaign(self, name: str, value: Union[str, bytes], lease: int = 30,
                 wait: Optional[float] = None,
                 on_lost: Optional[Callable[["Ticket"], object]] = None) -> "Ticket":
        """Campaigns in the election ``name`` with ``value`` (1 to 128
        UTF-8 bytes, no newline; spec §13.6): an exclusive acquire of
        ``name`` labelled ``value`` that waits as ``acquire(wait=None)``
        does (``wait=S``: at most S seconds, then ``Timeout``), kept alive
        as :meth:`lock` keeps its lock (``on_lost(t)`` runs once, on a
        thread of its own, if the lead is lost). It returns once this
        candidate leads: a :class:`Ticket` whose ``token`` is the term.
        ``release()`` — or leaving its ``with`` block — resigns; resigning
        a lead already lost returns quietly. A candidate whose process
        dies loses the lead at its lease's end."""
        check_campaign_value(value)
        check_on_lost(on_lost)
        forever = WaitForever(name, lease, label=value, stamp=True, transport=self._transport,
                              wait=wait)
        return self._drive(E.campaign(self, forever, on_lost))

    def leader(self, name: str) -> Optional[Leader]:
        """Who leads the election ``name`` now (one ``O`` with wait 0): a
        :class:`kunci.Leader` (``.value``, ``.term``, ``.held_for``) or
        ``None`` while nobody does. Ends by start + 5 s."""
        call = observe_call(name, 0, 0, self._ids.next(), monotonic(), self._transport)
        return leader_of(outcome_of(call, self._run(call)))

    def observe(self, name: str) -> Iterator[Optional[Leader]]:
        """Follows the election ``name`` (spec §13.6): an iterator of the
        current leader (a :class:`kunci.Leader`, or ``None``) first, then
        one item per change of leader. Through restarts and outages it
        asks again quietly (pauses doubling up to 2 s) and reports a state
        only if it differs from the last one reported; a change shorter
        than one round trip may be missed; terms only increase. It raises
        only ``InvalidArgument`` or ``PermissionDenied``."""
        check_args(P.check_key, name)
        return E.drive_items(E.observe(self, name), self)

    def release(self, key: str, token: int) -> None:
        """Releases grant ``token`` of ``key``. Raises ``NotHeld`` if that
        token is not the key's active grant."""
        call = release_call(key, token, monotonic(), self._transport)
        outcome_of(call, self._run(call))

    def renew(self, key: str, token: int, lease: int = 30) -> float:
        """Resets grant ``token``'s lease to ``lease`` seconds from now.
        Returns the new conservative expiry (``time.monotonic()`` seconds)."""
        call = renew_call(key, token, lease, monotonic(), self._transport)
        return outcome_of(call, self._run(call))[0]

    def query(self, key: str) -> Optional[KeyStatus]:
        """``None`` if ``key`` is free, else a :class:`KeyStatus`."""
        call = query_call(key, monotonic(), self._transport)
        return outcome_of(call, self._run(call))

    def holders(self, key: str) -> Holders:
        """Who holds ``key`` and who waits for it, now (spec §11): a
        :class:`Holders` with ``.grants`` (token order; each with ``.token
        .owner .take .lease_left .held_for .label``, times in seconds) and
        ``.waiters`` (queue order; ``.owner .take .wait_left .label``).
        Ends by start + 5 s; ``Unavailable``/``Indeterminate`` as every
        call."""
        call = holders_call(key, self._ids.next(), monotonic(), transport=self._transport)
        return outcome_of(call, self._run(call))

    def list_keys(self, prefix: str = "", cursor: int = 0,
                  count: int = 1000) -> Tuple[List[KeyInfo], int]:
        """One page of the keys that start with ``prefix``: ``(keys,
        next)``, a list of :class:`KeyInfo` and the cursor to go on with
        (0 at the end). A page may be short, even empty, before the end."""
        call = list_call(prefix, cursor, count, self._ids.next(), monotonic(), self._transport)
        return outcome_of(call, self._run(call))

    def keys(self, prefix: str = "") -> Iterator[KeyInfo]:
        """Every key of the server's table that starts with ``prefix``: an
        iterator of :class:`KeyInfo` (``.key .grants .waiters .limit``)
        that asks for 1000 keys at a time and follows the cursor to the
        end. A key in the table for the whole listing comes at least once;
        one may come twice when the table grew meanwhile."""
        check_args(P.check_prefix, prefix)
        return self._keys(prefix)

    def _keys(self, prefix):
        cursor = 0
        while True:
            keys, cursor = self.list_keys(prefix, cursor)
            yield from keys
            if cursor == 0:
                return

    def info(self) -> Dict[str, Any]:
        """The server's counters (the ``I`` line) as a dict."""
        call = info_call(monotonic(), self._transport)
        return outcome_of(call, self._run(call))

    def ping(self) -> float:
        """The round trip of one ``P``, in seconds."""
        call = ping_call(self._ids.next(), monotonic(), self._transport)
        return outcome_of(call, self._run(call))

    def close(self) -> None:
        """Closes every connection. Calls in progress end ``Indeterminate``
        (or ``Unavailable`` if nothing was sent); tickets are not released
        (their leases end them, or the flush at the program's end, which
        also releases what the calls cut short may have been granted). It
        may be called from a signal handler: it then ends the call the
        signal interrupted too."""
        if getattr(self._depth, "calls", 0):
            # From a signal handler that interrupted a call of this client,
            # which may hold its locks: no new call starts, and the thread
            # waiting on each session is woken (a write to a pipe is safe
            # here), sees the client closed and closes its session.
            self._closed = True
            for book in self._books:
                for session in list(book.sessions):
                    if session is not None:
                        session.wake()
            self._poke_maintenance()
            return
        with self._mu:
            if self._closed:
                return
            self._closed = True
            if self._cleanups or self._background:
                KEPT_FOR_EXIT.add(self)
            if self._etcd is not None:
                self._etcd.close()
            if self._pid != os.getpid():
                return
            for book in self._books:
                for session in book.sessions:
                    if session is not None:
                        self._close_session(session, "the client was closed")
        self._poke_maintenance()  # the thread sees _closed and ends

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.close()

    # ------------------------------------------------------------- a call

    def _drive(self, course):
        """Runs ``course`` (of :mod:`kunci._engine`) on this thread,
        blocking on each of its effects."""
        return E.drive(course, self)

    _pause = staticmethod(time.sleep)

    def _check_process(self):
        if self._pid != os.getpid():
            # A fork happened and the at-fork hook did not run (os.fork is
            # the only way in; this is a guard).
            _after_fork_in_child()
        if self._closed:
            raise Error("the client is closed")

    def _run(self, call):
        """Runs ``call`` to its result: moves it while it is certainly not
        sent (rule 4), never resends it once possibly sent (rule 5)."""
        self._check_process()
        if getattr(self._depth, "calls", 0):
            # This thread is inside a call of this client already: a signal
            # handler interrupted it, maybe holding the client's locks or
            # the role of its connection's reader. Run on a connection of
            # its own (on etcd: connections and locks of its own), so that
            # a release on SIGTERM works at once.
            if self._etcd is not None:
                return self._etcd.run_aside(call)
            return self._run_aside(call)
        self._depth.calls = 1
        if self._etcd is not None:
            try:
                return self._etcd.run(call)
            finally:
                self._depth.calls = 0
        try:
            return self._run_on_sessions(call)
        except Error:
            raise
        except BaseException:
            self._abandon(call)
            raise
        finally:
            self._depth.calls = 0

    def _run_aside(self, call):
        _side_run(self._addresses, self._access, self._connect_timeout, [call], call.deadline,
                  self._book.preferred, self._release_background)
        if call.result[0] == MOVED:
            raise Unavailable(call.result[1])
        return call.result

    def _abandon(self, call):
        """The caller left ``call`` (``KeyboardInterrupt``, an exception
        from a signal handler): nobody takes its outcome. A grant already
        here is released. An acquire possibly queued at the server is
        withdrawn when no other call uses its connection: the client ends
        its side of the connection and reads until the server's end (at
        most ``_WITHDRAW_WAIT``), for the server drops the waiters of a
        connection its peer ended and sends what it granted before; a
        grant in it is released. (Over TLS, or when the server's end does
        not come, the connection is closed and the clean-up of rule 11
        looks for a grant.) When other calls use the connection, the
        thread that reads it releases a late grant."""
        session = call.session
        with self._mu:
            if call.result is None:
                call.abandoned = True
            result = call.result
            if session is not None:
                # Interrupted in the middle of its own bookkeeping.
                if call.writing:
                    call.writing = False
                    session.writers -= 1
                if session.reader is call:
                    session.reader = None
        if result is not None:
            if result[0] == "A":
                self._release_background(call.key, result[1])
            return
        if call.op != "A" or session is None:
            return
        with self._mu:
            if not session.alive or session.pending.acquires.get(call.owner) is not call:
                return  # answered (a grant was released), or the session ended
            if session.writers or session.reader is not None or any(
                    other is not call and other.waiting() for other in session.pending.calls()):
                return
            session.reader = call
        seen_end = False
        try:
            if not session.tls:
                session.sock.shutdown(socket.SHUT_WR)
                until = min(call.deadline, monotonic() + _WITHDRAW_WAIT)
                while session.alive:
                    left = until - monotonic()
                    if left <= 0:
                        break
                    if session.read_poll.poll(math.ceil(left * 1000)):
                        self._read(session)
                seen_end = not session.alive
        except OSError:
            pass
        finally:
            self._release_reader(session, call)
        with self._mu:
            self._close_session(session, "an interrupted acquire withdrew its wait")
        if not seen_end:
            self._clean_up_after(call)

    def _run_on_sessions(self, call):
        while True:
            session = self._session_for(call)
            if session is None:
                return run_result(call)
            if self._write(session, call) == UNSENT:
                continue
            if call.result is None:
                self._await(session, call)
            result = attempt_result(call, session.index)
            if result is not None:
                return result

    def _session_for(self, call):
        """A connected session for ``call``, or ``None`` once its deadline
        has passed (or every address refused it with ``X 9``)."""
        book = self._watch_book if call.op == "O" and call.wait_s > 0 else self._book
        while True:
            now = monotonic()
            with self._mu:
                if book.gives_up(call, now, self._closed):
                    return None
                session = book.live_session()
                if session is not None:
                    return session
                allowed = book.allowed(call)
                if not allowed:
                    return None
                ready = book.ready(allowed, call, now)
                next_try = book.next_try(allowed)
            if not ready:
                time.sleep(max(0.0, min(next_try, call.deadline) - now))
                continue
            for index in ready:
                session = self._open(index, call, book)
                if session is not None:
                    return session

    def _open(self, index, call, book):
        lock = self._connect_locks[id(book)][index]
        if not lock.acquire(True, max(0.0, call.deadline - monotonic())):
            return None
        try:
            with self._mu:
                session = book.sessions[index]
                if session is not None and session.alive:
                    return session
                if book.retry_at[index] > monotonic():
                    return None
            timeout = min(self._connect_timeout, call.deadline - monotonic())
            if timeout <= 0:
                return None
            address = self._addresses[index]
            auth_frame = self._access.auth_frame
            try:
                sock = _connect(address, timeout, self._access.tls_for(index), auth_frame)
            except (OSError, ValueError) as error:
                with self._mu:
                    book.connect_failed(index, call, error, monotonic())
                return None
            try:
                session = _Session(index, sock, auth_frame is not None, book)
            except OSError as error:
                # No descriptor for its wake pipe (EMFILE): nothing was
                # sent, as for a failed connect.
                sock.close()
                with self._mu:
                    book.connect_failed(index, call, error, monotonic())
                return None
            with self._mu:
                if self._closed:
                    session.close_fds()
                    raise Error("the client is closed")
                book.connected(session)
            return session
        finally:
            lock.release()

    def _write(self, session, call):
        """Writes ``call``'s frame on ``session``. ``UNSENT``: the socket
        took none of its bytes, so it may move. ``SENT``: possibly sent;
        its result may already be set (the session died, or refused it)."""
        wake = False
        # Another thread may be stuck writing to a server that does not
        # read: wait for the socket no longer than this call's deadline
        # (then the request is certainly not sent).
        if not session.write_lock.acquire(True, max(0.0, call.deadline - monotonic())):
            return UNSENT
        try:
            self._take_in_unread(session, call)
            with self._mu:
                if not session.alive:
                    return UNSENT
                session.pending.add(call)
                call.session = session
                call.writing = True
                session.writers += 1
                if call.deadline < session.poll_until and session.reader is not None:
                    wake = True
            now = monotonic()
            frame = call.encode(now)
            call.sent_at = now
            sent, failure = self._send(session, frame, call.deadline)
            with self._mu:
                call.writing = False
                session.writers -= 1
                if sent == 0:
                    call.sent_at = None  # certainly not sent
                    session.pending.remove(call)
                    if failure is not None and failure is not _NO_ROOM and session.alive:
                        self._close_session(session, failure)
                    self._maybe_close_fds(session)
                    return UNSENT
                if session.refused is not None:
                    session.pending.remove(call)
                    call.result = (MOVED,) + session.refused
                elif not session.alive:
                    session.pending.remove(call)
                    if call.result is None:
                        call.result = closed_result(session)
                elif sent < len(frame):
                    # Part of a frame is on the wire: the stream can only
                    # be closed.
                    self._close_session(session, failure or "write cut short")
                    if call.result is None:
                        call.result = indeterminate(failure or "its write was cut short")
                self._maybe_close_fds(session)
        finally:
            session.write_lock.release()
        if wake:
            session.wake()
        return SENT

    def _take_in_unread(self, session, call):
        """When no thread reads ``session``, reads what has arrived on it
        before a request is written: a session the server ended while
        nobody was reading (an ``X 8``, an end of stream) is noticed now,
        while the request is still certainly not sent and can move."""
        with self._mu:
            if not session.alive or session.reader is not None:
                return
            session.reader = call
        try:
            if session.read_poll.poll(0):
                self._read(session)
        finally:
            self._release_reader(session, call)

    def _release_reader(self, session, call):
        with self._mu:
            session.reader = None
            session.poll_until = math.inf
            if session.alive:
                # Hand the reading over to a thread still waiting on it.
                for other in session.pending.calls():
                    if other is not call and other.waiting() and other.waiter is not None:
                        self._signal(other)
                        break
            self._maybe_close_fds(session)

    def _send(self, session, frame, deadline):
        view = memoryview(frame)
        sent = 0
        total = len(frame)
        sock = session.sock
        # After a TLS write that wanted room, part of its record may be on
        # the wire: the frame is possibly sent from then on.
        tls_started = False
        while sent < total:
            try:
                if session.tls:
                    with session.tls_lock:
                        sent += sock.send(view[sent:])
                else:
                    sent += sock.send(view[sent:])
            except (BlockingIOError, ssl.SSLWantWriteError, ssl.SSLWantReadError) as error:
                tls_started = tls_started or isinstance(error, ssl.SSLError)
                left = deadline - monotonic()
                if left <= 0:
                    return max(sent, int(tls_started)), _NO_ROOM
                # A TLS write may wait for the peer's bytes, not for room:
                # look again soon.
                wait_ms = math.ceil(left * 1000)
                session.write_poll.poll(min(wait_ms, 10) if tls_started else wait_ms)
            except InterruptedError:
                pass
            except OSError as error:
                return max(sent, int(tls_started)), self._write_failed(session, error)
        return sent, None

    def _write_failed(self, session, error):
        """Why a write failed. On a TLS session that has had no answer yet,
        the server may have refused the client's certificate: its alert
        waits unread, and names the reason (the session is then refused)."""
        refusal = tls_refusal(error)
        if refusal is None and session.tls and session.frames == 0:
            try:
                with session.tls_lock:
                    session.sock.recv(_READ_CHUNK)
            except OSError as read_error:
                refusal = tls_refusal(read_error)
        if refusal is not None:
            with self._mu:
                if session.alive and session.denied is None:
                    session.denied = refusal
            return refusal
        return "write failed: %s" % error

    def _await(self, session, call):
        """Waits for ``call``'s result, reading as the session's leader
        when no other thread does."""
        call.waiter = _thread.allocate_lock()
        call.waiter.acquire()
        # Interrupted (KeyboardInterrupt, ...): ``_abandon`` sees to the
        # outcome nobody takes.
        while True:
            with self._mu:
                if call.result is not None:
                    return
                lead = session.reader is None and session.alive
                if lead:
                    session.reader = call
                elif not session.alive:
                    # Closed with this call still registered: cannot
                    # happen (closing completes it); stay on the safe
                    # side.
                    call.result = INDETERMINATE
                    return
            if lead:
                self._lead(session, call)
                continue
            left = call.deadline + _CALL_GRACE - monotonic()
            if left <= 0:
                with self._mu:
                    if call.result is None:
                        log.error("no answer from the session's reader by the deadline")
                        call.abandoned = True
                        call.result = INDETERMINATE
                continue
            acquired = call.waiter.acquire(True, left)
            if acquired:
                with self._mu:
                    call.signalled = False

    def _signal(self, call):
        if call.waiter is not None and not call.signalled:
            call.signalled = True
            call.waiter.release()

    def _lead(self, session, call):
        try:
            while True:
                with self._mu:
                    if call.result is not None or not session.alive:
                        return
                    if self._closed:
                        # Closed from a signal handler, which could only
                        # wake this thread.
                        self._close_session(session, "the client was closed")
                        return
                    deadline = call.deadline
                    for other in session.pending.calls():
                        if other.deadline < deadline and other.waiting():
                            deadline = other.deadline
                    session.poll_until = deadline
                now = monotonic()
                if deadline <= now:
                    self._expire(session)
                    continue
                try:
                    events = session.read_poll.poll(math.ceil((deadline - now) * 1000))
                except InterruptedError:
                    continue
                readable = False
                for fd, _ in events:
                    if fd == session.wake_r:
                        try:
                            os.read(session.wake_r, 512)
                        except OSError:
                            pass
                    else:
                        readable = True
                if readable:
                    self._read(session)
        finally:
            self._release_reader(session, call)

    def _expire(self, session):
        """The earliest deadline of a waiting call has passed: read what
        has arrived, then close the session if a call is still overdue."""
        self._read(session)
        with self._mu:
            if not session.alive:
                return
            now = monotonic()
            for call in session.pending.calls():
                if call.waiting() and call.deadline <= now:
                    self._close_session(session, "no answer by the deadline")
                    return

    def _read(self, session):
        while True:
            try:
                if session.tls:
                    with session.tls_lock:
                        data = session.sock.recv(_READ_CHUNK)
                else:
                    data = session.sock.recv(_READ_CHUNK)
            except (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError):
                return
            except InterruptedError:
                continue
            except ssl.SSLZeroReturnError:
                data = b""
            except OSError as error:
                refusal = tls_refusal(error)
                with self._mu:
                    if refusal is not None and session.alive:
                        session.denied = refusal
                    self._close_session(session, refusal or "read failed: %s" % error)
                return
            if not data:
                with self._mu:
                    self._close_session(session, "closed by the server")
                return
            session.buf += data
            self._dispatch(session)
            # A TLS socket returns one record at a time: read until it
            # would block, so that nothing stays decrypted but unread.
            if not session.alive or (len(data) < _READ_CHUNK and not session.tls):
                return

    def _dispatch(self, session):
        releases = []
        try:
            frames = P.decode_frames(session.buf)
        except P.ProtocolError as error:
            frames = None
            failure = str(error)
        with self._mu:
            if frames is None:
                self._close_session(session, failure)
                return
            now = monotonic()
            compensate = lambda key, token: releases.append((key, token))
            for call, frame in answers(session.book, session, frames, self._close_session):
                result = result_of(call, frame, now, compensate)
                if result is not None and call.result is None:
                    call.result = result
                    self._signal(call)
        for key, token in releases:
            self._release_background(key, token)

    def _close_session(self, session, reason):
        """Ends ``session`` (with ``_mu`` held): its possibly-sent requests
        are ``Indeterminate`` (or, after a first-frame ``X 7``/``X 9``,
        moved: nothing executed); a request being written is left to its
        writer."""
        if not session.alive:
            return
        session.alive = False
        session.ended_by = reason
        session.book.session_ended(session, reason, monotonic())
        for call in session.pending.take_all():
            if call.writing or not call.waiting():
                continue
            call.result = closed_result(session)
            self._signal(call)
        if self._pid == os.getpid():
            try:
                session.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        session.wake()
        self._maybe_close_fds(session)

    def _maybe_close_fds(self, session):
        # The descriptor is closed only when no thread reads or writes on
        # it, so that its number cannot be reused under a thread's feet.
        if not session.alive and session.reader is None and session.writers == 0:
            session.close_fds()

    # ----------------------------------------------- background & timers

    def _release_background(self, key, token):
        """Schedules a release of exactly ``token`` that nobody waits for.
        Never blocks on the network (it runs from ``__del__`` too). While
        the program ends, the flush at exit sends it (no thread starts)."""
        if self._pid != os.getpid():
            return
        self._background.append((key, token))
        if self._closed:
            KEPT_FOR_EXIT.add(self)  # the flush at exit sends it
            return
        self._wake_maintenance()

    def _wake_maintenance(self):
        """Wakes the maintenance thread, starting it if it is not running
        (never while the program ends)."""
        with self._maint_lock:
            if self._closed or exiting():
                return
            if self._maint_thread is None:
                wake = os.pipe()
                os.set_blocking(wake[0], False)
                os.set_blocking(wake[1], False)
                self._maint_wake = wake
                thread = threading.Thread(target=self._maintain, args=(wake[0],),
                                          name="kunci-maintenance", daemon=True)
                self._maint_thread = thread
                try:
                    thread.start()
                except RuntimeError:  # the interpreter is shutting down
                    self._maint_thread = None
                    self._close_maintenance_pipe()
                    return
        self._poke_maintenance()

    def _poke_maintenance(self):
        # Under the lock: the thread closes the pipe when it ends, and a
        # descriptor number must never be written after it was closed.
        with self._maint_lock:
            if self._maint_wake is not None:
                try:
                    os.write(self._maint_wake[1], b"\0")
                except OSError:
                    pass

    def _close_maintenance_pipe(self):
        """With ``_maint_lock`` held, as the thread ends."""
        wake, self._maint_wake = self._maint_wake, None
        if wake is not None:
            for fd in wake:
                try:
                    os.close(fd)
                except OSError:
                    pass

    def _schedule(self, when, action):
        """Runs ``action()`` on the maintenance thread at ``when``
        (monotonic seconds). ``action`` must not block."""
        with self._maint_lock:
            self._timer_seq += 1
            heapq.heappush(self._timers, (when, self._timer_seq, action))
            # The thread sleeps until the earliest timer: wake it only when
            # this one comes first.
            wake = self._timers[0][1] == self._timer_seq or self._maint_thread is None
        if wake:
            self._wake_maintenance()

    def _maintain(self, wake_r):
        poller = select.poll()
        poller.register(wake_r, select.POLLIN)
        idle_since = None
        while not self._closed and not exiting():
            with self._maint_lock:
                next_at = self._timers[0][0] if self._timers else None
                if next_at is None and not self._background:
                    # Nothing to do for a while: the thread ends (and is
                    # started again on demand), so that a client dropped
                    # without close() does not keep a thread forever.
                    now = monotonic()
                    if idle_since is None:
                        idle_since = now
                    elif now - idle_since >= _MAINTENANCE_IDLE_EXIT:
                        self._maint_thread = None
                        self._close_maintenance_pipe()
                        return
                    next_at = idle_since + _MAINTENANCE_IDLE_EXIT
                else:
                    idle_since = None
            if not self._background and next_at is not None:
                timeout = max(0, math.ceil((next_at - monotonic()) * 1000))
                try:
                    poller.poll(timeout)
                except InterruptedError:
                    pass
                try:
                    os.read(wake_r, 4096)
                except OSError:
                    pass
            while self._background and not self._closed:
                try:
                    key, token = self._background.popleft()
                except IndexError:  # taken by the flush at exit
                    break
                self._send_background(key, token)
            now = monotonic()
            due = []
            with self._maint_lock:
                while self._timers and self._timers[0][0] <= now:
                    due.append(heapq.heappop(self._timers)[2])
            for action in due:
                try:
                    action()
                except Exception:
                    log.exception("kunci keep-alive timer failed")
        with self._maint_lock:
            self._maint_thread = None
            self._close_maintenance_pipe()

    def _send_background(self, key, token):
        if self._etcd is not None:
            self._etcd.release_in_background(key, token)
            return
        call = E.background_release_call(self, key, token)
        try:
            while not self._closed:
                session = self._session_for(call)
                if session is None:
                    log.warning("could not release token %d: %s", token,
                                call.reason if call.result is None else call.result[1])
                    return
                if self._write(session, call) == SENT:
                    return
        except Error:
            pass
        # Closed before it was sent: the flush at exit sends it.
        self._background.append((key, token))
        KEPT_FOR_EXIT.add(self)

    def _exit_leftovers(self):
        """The background releases not sent yet, taken for the flush at
        exit."""
        leftovers = []
        while self._background:
            try:
                leftovers.append(self._background.popleft())
            except IndexError:
                break
        return leftovers

    # ------------------------------------------------------------- fork

    def _reset_after_fork(self):
        # Only this thread exists in the child. The parent's sockets are
        # closed here without a shutdown (which would end the parent's
        # connections too) and never written to.
        for book in self._books:
            for session in book.sessions:
                if session is not None:
                    session.close_fds()
        if self._maint_wake is not None:
            for fd in self._maint_wake:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._init_state()
        self._tickets = {}
        self._cleanups = {}


def _after_fork_in_child():
    for client in list(_CLIENTS):
        client._reset_after_fork()
    # A multiprocessing child ends with os._exit(), which runs no atexit
    # handler, but after its finalizers: the flush runs among them. (Its
    # start clears the finalizers inherited, then runs the after-fork
    # hooks: the finalizer is registered from one.)
    util = sys.modules.get("multiprocessing.util")
    if util is not None:
        try:
            util.register_after_fork(_after_fork_in_child, _finalize_in_multiprocessing)
        except Exception as error:
            log.debug("cannot register the flush at exit with multiprocessing: %s", error)


def _finalize_in_multiprocessing(_):
    sys.modules["multiprocessing.util"].Finalize(None, _flush_at_exit, exitpriority=0)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _flush_at_exit():
    """The program ends (its end, an uncaught exception, ``sys.exit``):
    every ticket of this process that was neither released, detached nor
    lost is released, in one flush that takes at most ``EXIT_FLUSH``
    (0.5 s) in all, on the calling thread (spec §8 rule 9). From then on no
    client starts a thread, and a ticket dropped later sends nothing."""
    begin_exit()
    deadline = monotonic() + EXIT_FLUSH
    for client in list(EXIT_CLIENTS):
        try:
            flush_client(client, deadline)
        except Exception as error:  # never in the way of the program's end
            log.debug("release at exit: %s", error)


def flush_client(client, deadline):
    """Releases ``client``'s tickets (and its background releases not yet
    sent) by ``deadline``, on a connection of its own (sync or asyncio
    client: its event loop may be closed by now)."""
    releases = []
    for ref in list(client._tickets.copy().values()):
        ticket = ref()
        if ticket is not None and ticket._take_for_exit():
            releases.append((ticket._key_bytes, ticket.token))
    releases.extend(client._exit_leftovers())
    cleanups = list(client._cleanups.items()) if client._pid == os.getpid() else []
    release_found(client, releases, cleanups, deadline)


def release_found(client, releases, cleanups, deadline):
    """Releases the ``(key, token)`` pairs ``releases`` and the grants of
    the owners in ``cleanups`` (``(owner, key)`` pairs of acquires that
    ended Indeterminate) by ``deadline``, on connections of their own."""
    if cleanups and client._etcd is None:
        # Acquires that ended Indeterminate or were interrupted: a grant of
        # their owner is found, then released with the rest (rule 11).
        calls = [holders_call(key, owner, monotonic(), owner) for owner, key in cleanups]
        _side_run(client._addresses, client._access, client._connect_timeout, calls, deadline,
                  client._book.preferred, lambda key, token: releases.append((key, token)))
    if not releases:
        return
    if client._etcd is not None:
        for key, token in releases:
            if monotonic() >= deadline:
                break
            client._etcd.release(key, token, deadline)
        return
    calls = [Call("R", key, deadline, token=token) for key, token in releases]
    _side_run(client._addresses, client._access, client._connect_timeout, calls, deadline,
              client._book.preferred, lambda key, token: None)
    log.debug("released %d of %d at exit", sum(call.result == ("R",) for call in calls),
              len(calls))


atexit.register(_flush_at_exit)


class Ticket(TicketBase):
    """A granted lock: ``key``, the fencing ``token``, the ``lease`` (whole
    seconds) and ``valid_until``, a ``time.monotonic()`` instant before
    which the server cannot have taken the lock back (the instant just
    before the request that set the lease was handed to the socket, plus
    the lease, minus the drift margin ``10 ms + lease/500``).

    Any thread may renew or release it. Dropping an unreleased ticket
    schedules a best-effort release, and the program's end releases every
    ticket it still holds (one flush, at most 0.5 s); :meth:`detach` keeps
    the lock instead. A released ticket is no longer valid. In a forked
    child the ticket is the parent's: the child never renews or releases
    it.
    """

    def __init__(self, *args):
        super().__init__(*args)
        # Re-entrant: a signal handler may release the ticket while this
        # thread is inside one of its methods.
        self._state_lock = threading.RLock()

    def renew(self, lease: Optional[int] = None) -> float:
        """Resets the lease to ``lease`` seconds (default: the ticket's
        lease) from now. On success ``valid_until`` moves to this renewal's
        send instant + lease − margin. ``NotHeld``: the lock is lost.
        ``Indeterminate``: ``valid_until`` keeps the earlier of the two
        bounds."""
        return self._client._drive(E.renewal(self, lease))

    def release(self) -> None:
        """Releases the lock (``R`` for exactly this token). ``NotHeld``:
        the lease had already run out. After a known loss or a release it
        sends nothing and raises :class:`LockLost`. A release that sent
        nothing (``Unavailable``, a closed client, ``PermissionDenied``)
        leaves the ticket as it was; after ``Indeterminate`` the ticket is
        no longer valid but may be released again."""
        self._client._drive(E.release(self))

    def proclaim(self, value: Union[str, bytes]) -> None:
        """Changes this grant's label to ``value`` (1 to 128 UTF-8 bytes,
        no newline; spec §13.4a): a campaign's leader changes its value
        and keeps its term, and observers see the change. ``LockLost`` if
        the lock is lost (known, or the server answers ``N``)."""
        self._client._drive(E.proclamation(self, value))

    def __enter__(self) -> "Ticket":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self._client._drive(E.exit_release(self, exc_type))

    def _report_lost(self, on_lost):
        # On a thread of its own: never on the thread that runs every
        # keep-alive's timers, whatever the callback does.
        _start_thread(_call_on_lost, "kunci-on-lost", on_lost, self)


class _KeepAlive(E.KeepAlive):
    """Drives a :class:`kunci._engine.KeepAlive` on the maintenance
    thread's timers: each round on a thread of its own (never on the thread
    that runs every keep-alive's timers), the check at ``valid_until`` on
    that thread."""

    def __init__(self, ticket):
        super().__init__(ticket)
        self.renewing = False

    def start(self):
        client = self.ticket._client
        client._schedule(self.due_at(), self._renew_due)
        client._schedule(self.ticket.valid_until, self._check)

    def _renew_due(self):
        if self.stopped or self.renewing:
            return
        self.renewing = True
        if not _start_thread(self._renew, "kunci-renew"):
            self.renewing = False

    def _renew(self):
        renewed = False
        try:
            renewed = self._renew_until_done()
        finally:
            # Cleared before the next renewal is scheduled, so that a due
            # renewal never finds the previous one still marked running.
            self.renewing = False
        if renewed and not self.stopped:
            self.ticket._client._schedule(self.due_at(), self._renew_due)

    def _renew_until_done(self):
        return self.ticket._client._drive(self.round())

    def _check(self):
        again_at = self.check()
        if again_at is not None:
            self.ticket._client._schedule(again_at, self._check)


Ticket._keep_alive_type = _KeepAlive
Client._ticket_type = Ticket


class _LockContext(E.LockContextBase):
    """What ``client.lock(...)`` returns: each entry, by a thread, takes
    a ticket of its own (:class:`kunci._engine.LockContextBase`)."""

    def __enter__(self) -> Ticket:
        client = self._client
        ticket = client._drive(E.hand_over(client.acquire(*self._args, **self._permits),
                                           self._on_lost))
        return self._entered(threading.get_ident(), ticket)

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        ticket = self._leaving(threading.get_ident())
        self._client._drive(E.exit_release(ticket, exc_type))


def _call_on_lost(on_lost, ticket):
    try:
        on_lost(ticket)
    except Exception:
        log.exception("on_lost callback failed")


def _start_thread(target, name, *args):
    """Starts a daemon thread; whether it started. None starts while the
    program ends (a thread started during shutdown hangs Python 3.10 and
    3.11, and is refused by 3.12+)."""
    if exiting():
        return False
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
    except RuntimeError as error:
        log.debug("cannot start %s: %s", name, error)
        return False
    return True
