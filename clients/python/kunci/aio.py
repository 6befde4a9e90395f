"""The asyncio client: the same calls as :class:`kunci.Client`, as
coroutines, on asyncio transports, in whichever event loop calls it (a
call from a new loop, once the old one stopped, drops the old loop's
connections and connects again).

Each session is one connection whose protocol object decodes answers as
they arrive and completes the future of the call they correlate with. A
request is handed to the transport in the same step in which it is
registered, so nothing can interleave; everything handed to the
transport counts as possibly sent (only requests that never reached a
transport are certainly not sent).

Cancellation is safe: a cancelled call whose request was possibly sent
stays registered as *abandoned*; if its answer is a grant, that exact
token is released at once, so a grant never goes to nobody. An acquire
that may wait is the only one waiting on its session (the shared one, or
a *private* one when another already waits there), which its
cancellation ends, so that the server drops the wait at once.
"""

import asyncio
import os
import socket
import threading
import time
import weakref
from types import TracebackType
from typing import (
    Any, AsyncContextManager, AsyncIterator, Callable, Dict, Generator, List, Optional, Tuple,
    Type, Union,
)

from . import _engine as E
from . import _etcd
from . import _protocol as P
from ._common import (
    EXIT_FLUSH, KEPT_FOR_EXIT, SENT, UNSENT, Call, Pending, TicketBase, WaitForever, answers,
    check_args, check_campaign_value, check_on_lost, closed_result, exiting, holders_call,
    info_call, list_call, log, observe_call, ping_call, query_call, release_call, renew_call,
    result_of, tls_refusal,
)
from ._common import AddressBook, Holders, KeyInfo, KeyStatus, Leader, leader_of, outcome_of
from ._common import SHUTDOWN_NOTICE_WAIT
from ._engine import attempt_result, run_result
from ._errors import Error, Unavailable

__all__ = ["Client", "Ticket"]

monotonic = time.monotonic

# How many idle sessions of waiting acquires a client keeps for reuse.
_IDLE_PRIVATE_MAX = 8


class _Session(asyncio.Protocol):
    def __init__(self, client, index, auth_frame):
        self.client = client
        self.index = index
        self.transport: Any = None
        self.pending = Pending()
        self.buf = bytearray()
        self.frames = 0
        self.alive = False
        self.refused = None
        self.auth_frame = auth_frame
        # A U went first and its answer has not come yet; then the name it
        # gave. ``denied``: why the server refused the credentials.
        self.authenticating = auth_frame is not None
        self.user = None
        self.denied = None
        # A session of one waiting acquire (``Client._run``), and one the
        # client is closing on purpose (not a failure of its address).
        self.private = False
        self.retiring = False
        # The waiting acquire a shared session carries (at most one); a
        # retiring one's cancelled acquire, and whether it was half-closed.
        self.waiting_acquire = None
        self.withdrawn = None
        self.half_closed = False

    def connection_made(self, transport):
        # With TLS: after the handshake. The U goes first, before any
        # request can be written.
        self.transport = transport
        self.alive = True
        if self.auth_frame is not None:
            transport.write(self.auth_frame)

    def data_received(self, data):
        self.buf += data
        self.client._dispatch(self)

    def connection_lost(self, exc):
        refusal = tls_refusal(exc)
        if refusal is not None and self.alive and self.denied is None:
            # TLS 1.3: the server's refusal of the client's certificate
            # comes after the client's side of the handshake.
            self.denied = refusal
        if refusal is not None:
            reason = refusal
        else:
            reason = "closed by the server" if exc is None else "connection failed: %s" % exc
        self.client._close_session(self, reason)


class Client(E.ClientBase):
    """An asyncio handle to one lock service (see :class:`kunci.Client`
    for ``servers``, ``secret``, ``tls`` and ``etcd_credentials``). Create it anywhere; it works in the event loop
    that calls it, one loop after another (not two running at once). Close
    it with ``await client.close()`` or ``async with``."""

    def _init_client(self):
        self._init_state()

    def _init_state(self):
        self._pid = os.getpid()
        # On an etcd cluster each call runs the blocking recipe of
        # ``_etcd`` on a thread of its own (a waiting acquire blocks its
        # thread for the whole wait, so a pool could starve the release
        # that would let it in).
        self._etcd = _etcd.cluster_for(
            self._addresses, self._connect_timeout, self._access.etcd_tls,
            self._access.etcd_credentials)
        self._loop: Any = None
        self._loop_end = None
        # The clean-ups after an indeterminate acquire not done yet (owner:
        # key), for the flush at exit.
        self._cleanups = {}
        # Background releases not yet answered: a loop that ends may take
        # them along unsent, and the next loop sends them again.
        self._unreleased = set()
        self._reset_loop_state()

    def _reset_loop_state(self):
        """What belongs to one event loop: the sessions (and their
        transports), connects under way, background tasks."""
        self._book = AddressBook(self._addresses)
        self._connecting = [None] * len(self._addresses)
        self._tasks = set()
        # The sessions of waiting acquires, each carrying one call at a
        # time, and those idle, kept for the next waiting acquire.
        self._private = set()
        self._idle = []

    # ----------------------------------------------------------------- API

    async def acquire(self, key: str, wait: Optional[float] = 0, lease: int = 30, *,
                      limit: Optional[int] = None, take: Optional[int] = None,
                      shared: bool = False, label: Union[str, bytes, None] = None) -> "Ticket":
        """Takes the lock on ``key`` as :meth:`kunci.Client.acquire` does
        (``wait`` seconds, 0 by default: one attempt that never queues;
        ``wait=None`` waits until granted); returns a :class:`Ticket`.
        Cancelling it while it waits ends its wait on the server at once."""
        work = E.acquisition(self, key, wait, lease, limit, take, shared, label)
        if isinstance(work, Call):
            return E.granted(self, work, await self._run(work))
        return await self._drive(work)

    def campaign(self, name: str, value: Union[str, bytes], lease: int = 30,
                 wait: Optional[float] = None,
                 on_lost: Optional[Callable[["Ticket"], object]] = None) -> "_Campaign":
        """As :meth:`kunci.Client.campaign` (``wait``, ``on_lost`` too):
        ``t = await client.campaign(...)`` returns the :class:`Ticket`
        once this candidate leads (``t.token`` is the term; ``await
        t.release()`` resigns), and ``async with client.campaign(...) as
        t:`` resigns when the block ends."""
        check_campaign_value(value)
        check_on_lost(on_lost)
        forever = WaitForever(name, lease, label=value, stamp=True, transport=self._transport,
                              wait=wait)
        return _Campaign(self, forever, on_lost)

    async def _campaign(self, forever, on_lost):
        return await self._drive(E.campaign(self, forever, on_lost))

    async def leader(self, name: str) -> Optional[Leader]:
        """As :meth:`kunci.Client.leader`: a :class:`kunci.Leader` or ``None``."""
        call = observe_call(name, 0, 0, self._ids.next(), monotonic(), self._transport)
        return leader_of(outcome_of(call, await self._run(call)))

    def observe(self, name: str) -> AsyncIterator[Optional[Leader]]:
        """As :meth:`kunci.Client.observe`: ``async for leader in
        client.observe(name):`` the current leader (or ``None``) first,
        then one item per change. It raises only ``InvalidArgument`` or
        ``PermissionDenied``."""
        check_args(P.check_key, name)
        return self._follow(E.observe(self, name))

    async def _shutdown_seen(self, notices):
        give_up = monotonic() + SHUTDOWN_NOTICE_WAIT
        while self._book.shutdowns == notices:
            if monotonic() >= give_up:
                return False
            await asyncio.sleep(0.005)
        return True

    def _clean_up_after(self, call):
        """As :meth:`kunci.Client._clean_up_after`, as a task; until the
        server answered its ``H``, the flush at exit does it too."""
        looking = E.clean_up_call(self, call)
        if self._closed:
            KEPT_FOR_EXIT.add(self)
            return
        task = self._loop.create_task(self._drive(E.clean_up(self, call, looking)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def lock(self, key: str, wait: Optional[float] = 0, lease: int = 30,
             on_lost: Optional[Callable[["Ticket"], object]] = None, *,
             limit: Optional[int] = None, take: Optional[int] = None, shared: bool = False,
             label: Union[str, bytes, None] = None) -> AsyncContextManager["Ticket"]:
        """``async with client.lock(...) as t:`` — as
        :meth:`kunci.Client.lock`: acquires on entry, renews every lease/3
        while the block runs, releases on exit; ``on_lost(t)`` runs on the
        event loop (if it returns an awaitable, that runs as a task)."""
        check_on_lost(on_lost)
        return _LockContext(self, (key, wait, lease),
                            dict(limit=limit, take=take, shared=shared, label=label), on_lost)

    async def release(self, key: str, token: int) -> None:
        """Releases grant ``token`` of ``key`` (as
        :meth:`kunci.Client.release`). ``NotHeld`` if that token is not the
        key's active grant."""
        call = release_call(key, token, monotonic(), self._transport)
        outcome_of(call, await self._run(call))

    async def renew(self, key: str, token: int, lease: int = 30) -> float:
        """Resets grant ``token``'s lease to ``lease`` seconds from now;
        returns the new conservative expiry (``time.monotonic()``
        seconds), as :meth:`kunci.Client.renew`."""
        call = renew_call(key, token, lease, monotonic(), self._transport)
        return outcome_of(call, await self._run(call))[0]

    async def query(self, key: str) -> Optional[KeyStatus]:
        """``None`` if ``key`` is free, else a :class:`kunci.KeyStatus`."""
        call = query_call(key, monotonic(), self._transport)
        return outcome_of(call, await self._run(call))

    async def holders(self, key: str) -> Holders:
        """As :meth:`kunci.Client.holders`."""
        call = holders_call(key, self._ids.next(), monotonic(), transport=self._transport)
        return outcome_of(call, await self._run(call))

    async def list_keys(self, prefix: str = "", cursor: int = 0,
                        count: int = 1000) -> Tuple[List[KeyInfo], int]:
        """As :meth:`kunci.Client.list_keys`."""
        call = list_call(prefix, cursor, count, self._ids.next(), monotonic(), self._transport)
        return outcome_of(call, await self._run(call))

    async def keys(self, prefix: str = "") -> AsyncIterator[KeyInfo]:
        """``async for key in client.keys(prefix)``: as
        :meth:`kunci.Client.keys`."""
        check_args(P.check_prefix, prefix)
        cursor = 0
        while True:
            keys, cursor = await self.list_keys(prefix, cursor)
            for key in keys:
                yield key
            if cursor == 0:
                return

    async def info(self) -> Dict[str, Any]:
        """As :meth:`kunci.Client.info`: the server's counters."""
        call = info_call(monotonic(), self._transport)
        return outcome_of(call, await self._run(call))

    async def ping(self) -> float:
        """As :meth:`kunci.Client.ping`: one round trip, in seconds."""
        call = ping_call(self._ids.next(), monotonic(), self._transport)
        return outcome_of(call, await self._run(call))

    async def close(self) -> None:
        """Closes every connection (tickets are not released). The calls
        under way end ``Indeterminate`` (or ``Unavailable`` if nothing was
        sent)."""
        if self._closed:
            return
        old = self._loop
        if (self._pid == os.getpid() and old is not None and old is not asyncio.get_running_loop()
                and not old.is_running()):
            self._leave_loop(old, clean_up=False)
        self._closed = True
        if self._etcd is not None:
            self._etcd.close()
        if self._pid != os.getpid():
            return
        self._forget_loop_end()
        for session in self._book.sessions:
            if session is not None:
                self._close_session(session, "the client was closed")
        for session in list(self._private):
            self._close_session(session, "the client was closed")
        tasks = [task for task in self._tasks if task is not _current_task()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._cleanups or self._unreleased:
            KEPT_FOR_EXIT.add(self)  # only the flush at exit sends them now

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        await self.close()

    # ------------------------------------------------------------- a call

    async def _drive(self, course):
        """Runs ``course`` (of :mod:`kunci._engine`) in this task,
        awaiting each of its effects."""
        steps = E.Steps(course)
        effect = steps.next()
        while effect is not None:
            try:
                steps.answer(await effect.perform(self))
            except BaseException as error:
                steps.fail(error)
            effect = steps.next()
        return steps.value

    async def _follow(self, course):
        """As :meth:`_drive`, as an asynchronous iterator of the course's
        items."""
        steps = E.Steps(course)
        effect = steps.next()
        while effect is not None:
            if isinstance(effect, E.Item):
                yield effect.arg
                steps.answer(None)
            else:
                try:
                    steps.answer(await effect.perform(self))
                except BaseException as error:
                    steps.fail(error)
            effect = steps.next()

    _pause = staticmethod(asyncio.sleep)

    def _bind_loop(self):
        if self._pid != os.getpid():
            for session in list(self._book.sessions) + list(self._private):
                if session is not None and session.transport is not None:
                    _forget_transport(session.transport)
            self._init_state()
        if self._closed:
            raise Error("the client is closed")
        loop = asyncio.get_running_loop()
        old = self._loop
        if old is not loop:
            if old is not None and not old.is_closed() and old.is_running():
                raise Error("this kunci.aio.Client is in use by another event loop that is "
                            "running now (another thread): make one client per thread")
            if old is not None:
                self._leave_loop(old)
            self._loop = loop
            self._watch_loop_end(loop)
        return loop

    def _watch_loop_end(self, loop):
        """Has ``loop`` tell the client when it ends: ``asyncio.run`` (and
        uvloop's) closes every asynchronous generator still open, after it
        cancelled its tasks and before it closes the loop. A generator of
        the client's, started here, lets it finish there what the cancelled
        tasks started (a Ctrl-C during a waiting acquire), while the loop
        still runs: see :meth:`_finish_at_loop_end`. (Started during the
        loop's own shutdown of generators, which is rare, it is not closed
        by the loop, only when the client moves on or is freed.)"""
        self._forget_loop_end()
        quiet: List[bool] = []
        watcher = _loop_end(weakref.ref(self), loop, quiet)
        try:
            watcher.asend(None).send(None)
        except StopIteration:
            pass
        # A watcher left open when its loop is gone would be handed to that
        # loop's finalizer hook (an error on a closed loop): it is closed
        # here, with nothing to do, when the client moves on or is freed.
        self._loop_end = weakref.finalize(self, _close_quietly, watcher, quiet)

    def _forget_loop_end(self):
        if self._loop_end is not None:
            self._loop_end()
            self._loop_end = None

    async def _finish_at_loop_end(self):
        """The loop ends (its tasks are cancelled) and the program may go
        on without one. For at most ``EXIT_FLUSH`` seconds the loop still
        runs for this client: the withdrawal of a cancelled wait (see
        :meth:`_withdraw`) reads on until the server's end, so that a grant
        sent before it is released, and the releases not answered yet
        (their tasks were cancelled) are sent again and answered. Nothing
        is then left queued or granted to nobody."""
        if self._closed or self._pid != os.getpid() or self._etcd is not None:
            return
        until = monotonic() + EXIT_FLUSH
        for key, token in list(self._unreleased):
            self._start_background(key, token)
        while monotonic() < until:
            withdrawing = any(session.alive and session.half_closed
                              for session in list(self._private))
            if not withdrawing and not self._unreleased:
                return
            await asyncio.sleep(0.005)

    def _leave_loop(self, old, clean_up=True):
        """The client moves to another event loop (a second ``asyncio.run``):
        the old loop's connections are dropped (a closed loop can neither
        use nor close them: each socket is shut down, so the server drops
        its waits at once) and the next call connects again. An acquire
        that was possibly sent on them and never answered is cleaned up
        (rule 11) once the client runs in its new loop."""
        closed = old.is_closed()
        sessions = [s for s in self._book.sessions if s is not None] + list(self._private)
        orphans = []
        for session in sessions:
            if not session.alive:
                continue
            session.alive = False
            for call in session.pending.take_all():
                if call.result is None:
                    if call.op == "A" and call.sent_at is not None:
                        orphans.append(call)
                    call.abandoned = True
                    call.result = closed_result(session)
                future = call.future
                if not closed and future is not None and not future.done():
                    future.set_result(None)
            _drop_transport(session.transport)
        self._reset_loop_state()
        self._loop = asyncio.get_running_loop()
        for call in orphans if clean_up else ():
            self._clean_up_after(call)
        # Releases the old loop may have left unsent (sent twice, the
        # second finds the token gone: ``N``, nothing changes).
        for key, token in list(self._unreleased) if clean_up else ():
            self._release_background(key, token)

    async def _run(self, call):
        loop = self._bind_loop()
        if self._etcd is not None:
            return await self._run_on_etcd(call, loop)
        # An acquire that may queue is the only one waiting on its session,
        # so that cancelling it can end that session, and with it the wait,
        # at once (``_withdraw``): the first goes on the shared session, any
        # other at the same time on a private one. A held watch (an ``O``
        # that waits) always goes on a private one: it never counts toward
        # the waits of a connection that carries an acquire (spec §13.3).
        waits = call.op == "A" and call.wait_until is not None
        apart = call.op == "O" and call.wait_s > 0
        while True:
            session = await self._session_for(call, loop, waits, apart)
            if session is None:
                return run_result(call)
            if waits and not session.private:
                session.waiting_acquire = call
            if self._write(session, call, loop) == UNSENT:
                self._done_waiting(session, call)
                await _closing_seen()
                continue
            if call.result is None:
                await self._await(call, session)
            self._done_waiting(session, call)
            result = attempt_result(call, session.index)
            if result is not None:
                return result

    async def _run_on_etcd(self, call, loop):
        """Runs ``call`` on a thread. Cancelled, the call is abandoned: a
        waiting acquire stops waiting (its entry is removed), and a grant
        that comes all the same is released at once."""
        etcd = self._etcd
        future = loop.create_future()

        def release_if_granted(outcome):
            if isinstance(outcome, tuple) and outcome[0] == "A":
                etcd.release_in_background(call.key, outcome[1])

        def deliver(outcome):
            if future.cancelled():
                release_if_granted(outcome)
            else:
                future.set_result(outcome)

        def work():
            try:
                outcome = etcd.run(call)
            except BaseException as error:
                outcome = error
            try:
                loop.call_soon_threadsafe(deliver, outcome)
            except RuntimeError:  # the loop is closed: nobody takes it
                release_if_granted(outcome)

        # No thread starts while the program ends (Python 3.10 and 3.11
        # hang on one, 3.12+ refuse it): nothing was sent.
        if exiting():
            raise Unavailable("the program is ending: no call on etcd starts now")
        try:
            threading.Thread(target=work, name="kunci-etcd-call", daemon=True).start()
        except RuntimeError as error:
            raise Unavailable("cannot start a thread for the call on etcd: %s" % error)
        try:
            outcome = await future
        except asyncio.CancelledError:
            call.abandoned = True
            if future.done() and not future.cancelled():
                # The outcome came, but the task was cancelled before it
                # resumed: a grant in it goes to nobody.
                release_if_granted(future.result())
            raise
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def _session_for(self, call, loop, waits=False, apart=False):
        book = self._book
        while True:
            now = monotonic()
            if book.gives_up(call, now, self._closed):
                return None
            session = book.live_session()
            if session is not None and not apart and (
                    not waits or session.waiting_acquire is None):
                return session
            # Another acquire waits on the shared session, or a watch goes
            # apart: this one gets a private session.
            private = session is not None or apart
            session = self._take_idle() if private else None
            if session is not None:
                return session
            allowed = book.allowed(call)
            if not allowed:
                return None
            connecting = [self._connecting[i] for i in allowed if self._connecting[i] is not None]
            if private:
                connecting = []
            ready = [i for i in book.ready(allowed, call, now)
                     if private or self._connecting[i] is None]
            if ready:
                session = await self._open(ready[0], call, loop, private)
                if session is not None:
                    return session
                continue
            if connecting:
                await asyncio.wait(connecting, timeout=max(0.0, call.deadline - now))
                continue
            next_try = book.next_try(allowed)
            await asyncio.sleep(max(0.0, min(next_try, call.deadline) - now))

    async def _open(self, index, call, loop, private=False):
        """Connects to address ``index``. A shared session is registered
        with the address book (``_session_for`` finds it there); a private
        one is returned."""
        done = loop.create_future()
        if not private:
            self._connecting[index] = done
        address = self._addresses[index]
        session = _Session(self, index, self._access.auth_frame)
        try:
            timeout = min(self._connect_timeout, call.deadline - monotonic())
            if timeout <= 0:
                return
            kind, where = address
            context = self._access.tls_for(index)
            if kind == "unix":
                connect = loop.create_unix_connection(lambda: session, where)
            elif context is not None:
                connect = loop.create_connection(
                    lambda: session, where[0], where[1], ssl=context, server_hostname=where[0],
                    ssl_handshake_timeout=timeout)
            else:
                connect = loop.create_connection(lambda: session, where[0], where[1])
            try:
                await _within(connect, timeout)
            except (OSError, asyncio.TimeoutError, ValueError) as error:
                if session.transport is not None:
                    session.transport.abort()
                self._book.connect_failed(index, call, error or "timed out", monotonic())
                return
            except asyncio.CancelledError:
                # The caller gave up while connecting: a connection that
                # came meanwhile carries nothing yet, and is closed.
                if session.transport is not None:
                    session.transport.abort()
                raise
            if self._closed:
                session.transport.abort()
                raise Error("the client is closed")
            if session.alive and private:
                session.private = True
                self._private.add(session)
                return session
            if session.alive:
                self._book.connected(session)
            else:
                # Refused (X 7 / X 9) or closed before this call wrote a
                # byte on it: try the other addresses first.
                call.tried.add(index)
                if session.refused is not None:
                    call.reason = session.refused[0]
                    if session.refused[1] == P.ERROR_NOT_ALLOWED:
                        call.refusals.add(index)
        finally:
            if not private:
                self._connecting[index] = None
            if not done.done():
                done.set_result(None)
        return None

    def _take_idle(self):
        while self._idle:
            session = self._idle.pop()
            if session.alive and not session.retiring and not session.transport.is_closing():
                return session
        return None

    def _done_waiting(self, session, call):
        """``call`` no longer waits on ``session``: the shared session may
        take another waiting acquire; a private one waits for the next."""
        if session.waiting_acquire is call:
            session.waiting_acquire = None
        if session.private:
            self._put_idle(session)

    def _put_idle(self, session):
        """A waiting acquire is over: its session waits for the next one,
        or is closed when enough wait already."""
        if not session.alive or session.retiring or session.pending.calls():
            return
        if len(self._idle) < _IDLE_PRIVATE_MAX and not self._closed:
            self._idle.append(session)
        else:
            self._withdraw(session, None)

    def _retire(self, session, call):
        """The waiting acquire ``call`` on the shared session was
        cancelled: new calls go to a new shared session, and this one is
        withdrawn as soon as no other call waits for an answer on it (at
        once, unless a short call is still under way)."""
        session.retiring = True
        session.withdrawn = call
        if self._book.sessions[session.index] is session:
            self._book.sessions[session.index] = None
        self._private.add(session)
        self._withdraw_when_quiet(session)

    def _withdraw_when_quiet(self, session):
        # Only abandoned calls left unanswered: the server has read every
        # other request (it drops unread input at the end of stream).
        if session.alive and not session.half_closed and all(
                other.abandoned for other in session.pending.calls()):
            self._withdraw(session, session.withdrawn)

    def _withdraw(self, session, call):
        """Ends the session of a cancelled waiting acquire ``call`` (no
        other call waits on it), so that the server drops its wait at once.
        The client half-closes it and reads on until the server, which drops the
        connection's waits when it sees the end of stream, closes its side:
        a grant sent before that still arrives and is released (``call`` is
        abandoned). A TLS session cannot half-close: it is closed at once,
        and a grant the server may have made meanwhile is looked for and
        released (rule 11)."""
        session.retiring = True
        session.half_closed = True
        transport = session.transport
        if transport.can_write_eof():
            transport.write_eof()
            self._loop.call_later(P.TRANSPORT_DEADLINE, self._close_session, session,
                                  "the server did not end a withdrawn wait")
        else:
            self._close_session(session, "a waiting acquire was cancelled")
            if call is not None and call.op == "A" and call.sent_at is not None:
                self._clean_up_after(call)

    def _write(self, session, call, loop):
        transport = session.transport
        if not session.alive or transport.is_closing():
            return UNSENT
        session.pending.add(call)
        if not call.background:
            call.future = loop.create_future()
            call.timer = loop.call_at(
                loop.time() + (call.deadline - monotonic()), self._deadline_passed, call, session)
        now = monotonic()
        call.sent_at = now
        transport.write(call.encode(now))
        return SENT

    async def _await(self, call, session):
        try:
            await call.future
        except asyncio.CancelledError:
            # The caller gave up. The request is possibly sent: a grant
            # that came (or comes later) is released; a wait on the
            # server's queue ends at once (its private session ends).
            if call.result is None:
                call.abandoned = True
                if call.timer is not None:
                    call.timer.cancel()
                if session.private and session.alive:
                    self._withdraw(session, call)
                elif session.waiting_acquire is call and session.alive:
                    self._retire(session, call)
            else:
                if call.result[0] == "A":
                    self._release_background(call.key, call.result[1])
                self._done_waiting(session, call)
            raise

    def _complete(self, call, result):
        call.result = result
        if call.timer is not None:
            call.timer.cancel()
        future = call.future
        if future is not None and not future.done():
            future.set_result(None)

    def _deadline_passed(self, call, session):
        # Asyncio reads what has arrived before it runs due timers, and one
        # more turn of the loop takes in anything read meanwhile: only then
        # is the session closed (rule 5).
        if call.waiting():
            self._loop.call_soon(self._expire, call, session)

    def _expire(self, call, session):
        if call.waiting() and session.alive:
            self._close_session(session, "no answer by the deadline")

    def _dispatch(self, session):
        try:
            frames = P.decode_frames(session.buf)
        except P.ProtocolError as error:
            self._close_session(session, str(error))
            return
        now = monotonic()
        for call, frame in answers(self._book, session, frames, self._close_session):
            if call.background:
                self._unreleased.discard((call.key, call.token))
            result = result_of(call, frame, now, self._release_background)
            if result is not None and call.result is None:
                self._complete(call, result)
            if session.retiring:
                self._withdraw_when_quiet(session)

    def _close_session(self, session, reason):
        if not session.alive:
            return
        session.alive = False
        session.ended_by = reason
        self._private.discard(session)
        if not session.retiring:
            self._book.session_ended(session, reason, monotonic())
        for call in session.pending.take_all():
            if call.waiting():
                self._complete(call, closed_result(session))
        if session.transport is not None and self._pid == os.getpid():
            session.transport.abort()

    # ------------------------------------------------------- background

    def _release_background(self, key, token):
        """Schedules a release of exactly ``token`` nobody waits for. Once
        the event loop is closed (``asyncio.run`` returned), the flush at
        exit sends it."""
        loop = self._loop
        if self._pid != os.getpid():
            return
        # Until answered; a loop that ends takes it along unsent, and the
        # next loop, or the flush at exit, sends it again (also all that a
        # closed client could not send).
        self._unreleased.add((key, token))
        if self._closed:
            KEPT_FOR_EXIT.add(self)
        if self._closed or loop is None or loop.is_closed():
            return
        try:
            in_loop = asyncio.get_running_loop() is loop
        except RuntimeError:
            in_loop = False
        if in_loop:
            # Not at once: this may run inside a finalizer or in the middle
            # of handling an answer.
            loop.call_soon(self._start_background, key, token)
        else:
            # From another thread, or from a finalizer outside the loop.
            loop.call_soon_threadsafe(self._start_background, key, token)

    def _start_background(self, key, token):
        if self._closed:
            return
        task = self._loop.create_task(self._send_background(key, token))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _send_background(self, key, token):
        if self._etcd is not None:
            self._unreleased.discard((key, token))
            self._etcd.release_in_background(key, token)
            return
        call = E.background_release_call(self, key, token)
        try:
            while not self._closed:
                session = await self._session_for(call, self._loop)
                if session is None:
                    self._unreleased.discard((key, token))
                    log.warning("could not release token %d: %s", token,
                                call.reason if call.result is None else call.result[1])
                    return
                if self._write(session, call, self._loop) == SENT:
                    return
                await _closing_seen()
        except Error:
            if not self._closed:
                self._unreleased.discard((key, token))
            # Else left for the flush at exit.

    def _exit_leftovers(self):
        """The releases not answered yet (a closed event loop could not
        send them), taken for the flush at exit (this process's only)."""
        if self._pid != os.getpid():
            return []
        leftovers, self._unreleased = list(self._unreleased), set()
        return leftovers


def _drop_transport(transport):
    """Closes the transport of a loop the client left. On a loop that is
    closed, nothing runs its callbacks (``abort`` raises): the socket is
    shut down at once (the server ends the session and its waits), and its
    descriptor is closed when the transport is freed, which the client
    makes happen by forgetting it (the closed loop holds it no longer)."""
    if transport is None:
        return
    try:
        transport.abort()
        return
    except RuntimeError:
        pass
    sock = transport.get_extra_info("socket")
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except (AttributeError, OSError):
        pass


async def _within(awaitable, timeout):
    """Awaits ``awaitable`` for at most ``timeout`` seconds (then
    ``asyncio.TimeoutError``), cancelled with its caller. Unlike
    ``asyncio.wait_for`` before Python 3.12, it never swallows the caller's
    cancellation when the awaitable completes at the same moment."""
    task = asyncio.ensure_future(awaitable)
    task.add_done_callback(_retrieve)
    try:
        done, _ = await asyncio.wait((task,), timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        raise asyncio.TimeoutError()
    return task.result()


def _retrieve(task):
    # A connect given up on may still fail: its error is not news.
    if not task.cancelled():
        task.exception()


async def _closing_seen():
    """After a write found the session's transport closing: one turn of the
    loop, in which the transport reports the loss (with its reason: a TLS
    alert says why), so that the session is not found live again."""
    await asyncio.sleep(0)


# Transports inherited from the parent by a forked child. They are kept
# referenced and never used: closing or collecting one would go through the
# parent's event loop, and the parent's connections must stay intact.
_INHERITED: List[Any] = []


def _forget_transport(transport):
    _INHERITED.append(transport)


class Ticket(TicketBase):
    """As :class:`kunci.Ticket`, with ``renew`` and ``release`` as
    coroutines. Any task may renew or release it."""

    async def renew(self, lease: Optional[int] = None) -> float:
        """As :meth:`kunci.Ticket.renew`: resets the lease to ``lease``
        seconds (default: the ticket's) and moves ``valid_until``."""
        return await self._client._drive(E.renewal(self, lease))

    async def release(self) -> None:
        """As :meth:`kunci.Ticket.release`: ``R`` for exactly this token.
        Cancelled before its ``R`` reached a connection, it leaves the
        ticket as it was."""
        await self._client._drive(E.release(self))

    async def proclaim(self, value: Union[str, bytes]) -> None:
        """As :meth:`kunci.Ticket.proclaim`: the grant takes the label
        ``value``; ``LockLost`` if the lock is lost."""
        await self._client._drive(E.proclamation(self, value))

    async def __aenter__(self) -> "Ticket":
        return self

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        await self._client._drive(E.exit_release(self, exc_type))

    def _report_lost(self, on_lost):
        # On the event loop; an awaitable it returns runs as a task.
        try:
            outcome = on_lost(self)
            if asyncio.iscoroutine(outcome) or isinstance(outcome, asyncio.Future):
                task = asyncio.ensure_future(outcome)
                self._client._tasks.add(task)
                task.add_done_callback(self._client._tasks.discard)
        except Exception:
            log.exception("on_lost callback failed")


class _KeepAlive(E.KeepAlive):
    """Drives a :class:`kunci._engine.KeepAlive` in the event loop: a task
    that runs a round a third into each lease, and a timer at
    ``valid_until``."""

    def __init__(self, ticket):
        super().__init__(ticket)
        self.loop = asyncio.get_running_loop()
        self.task = None
        self.timer = None

    def start(self):
        self.task = self.loop.create_task(self._run())
        self._arm_check(self.ticket.valid_until)

    def stop(self):
        super().stop()
        if self.timer is not None:
            self.timer.cancel()
        task = self.task
        if task is not None and task is not _current_task():
            task.cancel()

    def _arm_check(self, at):
        self.timer = self.loop.call_at(self.loop.time() + (at - monotonic()), self._check)

    def _check(self):
        again_at = self.check()
        if again_at is not None:
            self._arm_check(again_at)

    async def _run(self):
        client = self.ticket._client
        while not self.stopped:
            await asyncio.sleep(max(0.0, self.due_at() - monotonic()))
            if not await client._drive(self.round()):
                return


Ticket._keep_alive_type = _KeepAlive
Client._ticket_type = Ticket


async def _loop_end(client_ref, loop, quiet):
    """The watcher of :meth:`Client._watch_loop_end`: closed by the loop
    as it ends, or quietly (``quiet`` set) by the client."""
    try:
        yield
    finally:
        client = client_ref()
        if not quiet and client is not None and client._loop is loop:
            await client._finish_at_loop_end()


def _close_quietly(watcher, quiet):
    quiet.append(True)
    try:
        watcher.aclose().send(None)
    except (StopIteration, RuntimeError):
        pass


def _current_task():
    try:
        return asyncio.current_task()
    except RuntimeError:
        return None


class _Campaign(object):
    """What ``client.campaign(...)`` returns: awaited, the leader's
    :class:`Ticket`; as an ``async with``, the same, resigned at the
    block's end."""

    def __init__(self, client, forever, on_lost):
        self._client = client
        self._forever = forever
        self._on_lost = on_lost
        self._ticket = None

    def __await__(self) -> Generator[Any, None, Ticket]:
        return self._client._campaign(self._forever, self._on_lost).__await__()

    async def __aenter__(self) -> Ticket:
        ticket: Ticket = await self._client._campaign(self._forever, self._on_lost)
        self._ticket = ticket
        return ticket

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        ticket, self._ticket = self._ticket, None
        await self._client._drive(E.exit_release(ticket, exc_type))


class _LockContext(E.LockContextBase):
    """As :class:`kunci._sync._LockContext`: each entry, by a task (or the
    same task again), takes a ticket of its own."""

    async def __aenter__(self) -> Ticket:
        client = self._client
        ticket = await client._drive(E.hand_over(
            await client.acquire(*self._args, **self._permits), self._on_lost))
        entered: Ticket = self._entered(_current_task(), ticket)
        return entered

    async def __aexit__(self, exc_type: Optional[Type[BaseException]],
                        exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        ticket = self._leaving(_current_task())
        await self._client._drive(E.exit_release(ticket, exc_type))
