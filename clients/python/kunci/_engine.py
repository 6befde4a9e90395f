"""What a call of either client does, free of I/O: one piece that both
clients drive, as the Rust client's engine is driven by its I/O thread.
The outcome of each answer (``outcome_of``, ``result_of``) and the
decisions of the policies (``WaitForever``, ``Follow``) are in
``_common``; this module puts them in order.

A *course* is a generator. It yields the *effects* it needs (run a call
to its result, pause, see whether a server said it shuts down, hand an
item to the caller) and is sent each effect's outcome, or thrown the
exception it raised; its return value is the call's. The decisions
(which request next, what an outcome means, when to ask again, when a
lock is lost) are all here and in ``_common``; only how an effect is
waited for differs: :func:`drive` blocks on each (the sync client), and
``kunci.aio.Client._drive`` awaits each. A call of one request (an
acquire that may end, a ticket's release) takes no course: the client runs
the call this module makes (:func:`acquisition`, :func:`release_of`) and
hands the result back (:func:`granted`, :func:`released`); each attempt of
a request ends as :func:`run_result` and :func:`attempt_result` say.

:class:`KeepAlive` is the managed renewal of one ticket (spec §8 rule
10): each client drives its rounds and its check at ``valid_until`` on
its own timers. :class:`ClientBase` is what a client is before any I/O.
"""

import ssl
import time
from typing import Any, Dict, Optional, Sequence, Tuple, Union

from . import _protocol as P
from ._common import (
    Call,
    EXIT_CLIENTS, MOVED, RETRY_PAUSE_FIRST, RETRY_PAUSE_MAX, Access, Follow, OwnerIds,
    WaitForever, acquire_call, check_args, check_connect_timeout, check_transport_timeout,
    client_repr, granted_token, jittered, check_campaign_value, proclaim_call,
    holders_call, key_text, log, observe_call, needs_clean_up, outcome_of, own_grants, release_call,
    renew_call, waits_forever,
)
from ._errors import Busy, Error, Indeterminate, InvalidArgument, LockLost, NotHeld, Unavailable

monotonic = time.monotonic

#: How long a connection attempt may take before it counts as failed.
CONNECT_TIMEOUT = 1.0

#: How soon a keep-alive retries a renewal that ended Unavailable or
#: Indeterminate while valid_until is still ahead.
RENEW_RETRY = 0.05


# ------------------------------------------------------------------ effects

class Effect(object):
    """What a course asks of its client; ``arg`` is what it is about."""

    __slots__ = ("arg",)

    def __init__(self, arg):
        self.arg = arg


class Run(Effect):
    """Run the call ``arg`` to its result tuple (the client's ``_run``:
    rules 4 and 5); raises as ``_run`` does."""

    def perform(self, client):
        return client._run(self.arg)


class Pause(Effect):
    """Let ``arg`` seconds pass."""

    def perform(self, client):
        return client._pause(self.arg)


class ShutdownSeen(Effect):
    """Whether a server said it shuts down (``X 8``) since the client's
    count of such notices was ``arg`` (``_shutdown_seen``)."""

    def perform(self, client):
        return client._shutdown_seen(self.arg)


class Item(Effect):
    """Hand ``arg`` to the caller as an iterator's next item; the client
    answers nothing."""


class Steps(object):
    """A course being driven: :meth:`next` resumes it and gives the next
    effect (``None`` once it returned, its return value in ``value``);
    :meth:`answer` or :meth:`fail` says what the last effect came to."""

    __slots__ = ("course", "value", "_resume", "_with")

    def __init__(self, course):
        self.course = course
        self.value = None
        self._resume = course.send
        self._with = None

    def next(self):
        resume, given = self._resume, self._with
        self._with = None
        try:
            return resume(given)
        except StopIteration as end:
            self.value = end.value
            return None

    def answer(self, outcome):
        self._resume, self._with = self.course.send, outcome

    def fail(self, error):
        self._resume, self._with = self.course.throw, error

    def perform(self, effect, client):
        """Performs ``effect`` blocking, for the next resumption."""
        try:
            self.answer(effect.perform(client))
        except BaseException as error:
            self.fail(error)


def drive(course, client):
    """Runs ``course`` to its end, blocking on each effect: the sync
    client's driver. Its return value, or its exception."""
    steps = Steps(course)
    effect = steps.next()
    while effect is not None:
        steps.perform(effect, client)
        effect = steps.next()
    return steps.value


def drive_items(course, client):
    """As :func:`drive`, as an iterator of the course's items."""
    steps = Steps(course)
    effect = steps.next()
    while effect is not None:
        if isinstance(effect, Item):
            yield effect.arg
            steps.answer(None)
        else:
            steps.perform(effect, client)
        effect = steps.next()


# ------------------------------------------------------------------ courses

def ask(call):
    """One call: what its op returns (``outcome_of``), or raises."""
    return outcome_of(call, (yield Run(call)))


def acquisition(client, key, wait, lease, limit, take, shared, label):
    """What ``acquire`` runs: its one call, whose result :func:`granted`
    turns into the ticket (a call, not a course: the common case steps
    through nothing); or, when ``wait`` is ``None`` or infinite, the
    course that waits until granted."""
    if waits_forever(wait):
        forever = WaitForever(key, lease, limit, take, shared, label,
                              transport=client._transport)
        return acquire_until_granted(client, forever)
    return acquire_call(key, wait, lease, client._ids.next(), monotonic(), limit, take, shared,
                        label, transport=client._transport)


def granted(client, call, result, clean_up=True):
    """The ticket an acquire's ``result`` hands over, or raises. After an
    acquire that ended ``Indeterminate`` with its request possibly sent,
    ``clean_up`` has the client look for a grant and release it (rule 11);
    a grant past ``D`` is released and the call ends indeterminate
    (rule 7)."""
    if clean_up and needs_clean_up(call, result):
        client._clean_up_after(call)
    token = granted_token(call, result, monotonic(), client._release_background)
    return client._ticket_type(client, key_text(call.key), call.key, token, call.lease,
                               call.sent_at, call.limit, call.take, call.label)


def acquire_until_granted(client, forever):
    """Drives ``forever`` (a :class:`kunci._common.WaitForever`) to a
    ticket: after an attempt's ``Busy``, it looks for the ``X 8`` of a
    server shutting down; after ``Indeterminate``, it releases the
    attempt's own grant first (rule 11)."""
    while True:
        notices = client._book.shutdowns
        call = forever.call(client._ids.next(), monotonic())
        try:
            return granted(client, call, (yield Run(call)), clean_up=False)
        except Error as error:
            shut_down = isinstance(error, Busy) and (yield ShutdownSeen(notices))
            pause = forever.after(error, shut_down)
            if pause is None:
                raise error
            log.debug("%s: %s; asking again", key_text(call.key), error)
            if isinstance(error, Indeterminate):
                yield from release_own_grant(client, call)
        yield Pause(pause)


def release_own_grant(client, call):
    """After ``call`` (an acquire) ended ``Indeterminate``: asks who holds
    its key until the server answers, and releases the grant of the call's
    owner, if any (rule 11), so that the next attempt never queues behind
    its own unseen grant."""
    pause = RETRY_PAUSE_FIRST
    while True:
        try:
            holders = yield from ask(holders_call(call.key, client._ids.next(), monotonic(),
                                                  transport=client._transport))
            released = True
            for token in own_grants(holders, call.owner):
                try:
                    yield from ask(release_call(call.key, token, monotonic(), client._transport))
                except NotHeld:
                    pass
                except Error as error:
                    log.debug("releasing an unseen grant: %s", error)
                    released = False
            if released:
                return
        except InvalidArgument:
            return
        except Error as error:
            if client._closed:
                raise error
            log.debug("asking who holds %r: %s", key_text(call.key), error)
        yield Pause(jittered(pause))
        pause = min(pause * 2, RETRY_PAUSE_MAX)


def campaign(client, forever, on_lost=None):
    """A campaign (spec §13.6): waits as ``acquire(wait=None)`` until
    granted (or its bounded wait runs out: ``Timeout``), then hands the
    ticket over kept alive, ``on_lost`` called once if the lead is lost.
    Resigning a lead already lost returns quietly (as etcd's ``Resign``)."""
    ticket = yield from acquire_until_granted(client, forever)
    ticket._resign_quietly = True
    return (yield from hand_over(ticket, on_lost))


def observe(client, name):
    """Follows the election ``name`` (a :class:`kunci._common.Follow`),
    an item per leader to report, for ever; asks again quietly after a
    failure that asking again may change."""
    follow = Follow(name, client._transport)
    while True:
        call = follow.call(client._ids.next(), monotonic())
        try:
            state = yield from ask(call)
        except Error as error:
            if client._closed:
                # Closed under it: nothing to follow with (as every call of
                # a closed client, not the Indeterminate of the cut ``O``).
                raise Error("the client is closed") from None
            pause = follow.failed(error)
            log.debug("%s: %s; asking again in %.1f s", name, error, pause)
            yield Pause(pause)
            continue
        leader = follow.answered(state)
        if leader is not Follow.NOTHING:
            yield Item(leader)


def proclamation(ticket, value):
    """A ticket's ``proclaim(value)`` (spec §13.4a): its grant takes the
    label ``value`` (a campaign: the leader's value, its term kept). ``N``:
    the grant is gone, the loss is declared and ``LockLost`` raised;
    after a known loss nothing is sent (``LockLost``)."""
    label = check_campaign_value(value)
    ticket._check_owned()
    ticket._raise_if_lost()
    call = proclaim_call(ticket._key_bytes, ticket.token, label, monotonic(),
                         ticket._client._transport)
    try:
        yield from ask(call)
    except NotHeld:
        ticket._declare_lost("a proclaim was answered N")
        raise LockLost("lock on %r (token %d) was lost: the proclaim was answered N"
                       % (ticket.key, ticket.token)) from None
    ticket._label = label


def proclaim_again(ticket):
    """After a renewal succeeded past an outage (a restarted server may
    have adopted the grant, which it keeps without its label after a
    crash: spec §7.5): reads the key (one ``O``, wait 0) and, when its
    grant shows another label, proclaims the ticket's again, once. (Only
    then: a server without ``C`` ends the connection that carries one.)
    Failures are left to the next round (``N`` is the renewals' to find)."""
    if not ticket._label:
        return
    client = ticket._client
    try:
        state = yield from ask(observe_call(ticket._key_bytes, 0, 0, client._ids.next(),
                                            monotonic(), client._transport))
        if state.token != ticket.token or state.label == ticket._label.decode("utf-8"):
            return
        yield from ask(proclaim_call(ticket._key_bytes, ticket.token, ticket._label, monotonic(),
                                     client._transport))
    except Error as error:
        log.debug("proclaiming %r again: %s", ticket.key, error)


def renewal(ticket, lease):
    """Renews ``ticket`` (``lease`` seconds; ``None``: its own) and
    returns its new ``valid_until``. ``NotHeld`` declares the loss;
    ``Indeterminate`` keeps the earlier of the two bounds."""
    lease = ticket._renewal_lease(lease)
    started = monotonic()
    call = renew_call(ticket._key_bytes, ticket.token, lease, monotonic(),
                      ticket._client._transport)
    try:
        new_valid_until, sent_at = yield from ask(call)
    except NotHeld:
        ticket._declare_lost("a renewal was answered N")
        raise
    except Indeterminate:
        with ticket._state_lock:
            ticket._renewal_indeterminate(started, lease)
        raise
    with ticket._state_lock:
        ticket._renewed(sent_at, lease, new_valid_until)
    return ticket.valid_until


def release(ticket):
    """A ticket's ``release()`` (a course of its one call). A campaign's
    ticket resigns quietly when the lead is already lost: nothing is sent
    after a known loss, and an ``N`` says the same."""
    if ticket._resign_quietly and ticket.lost and not ticket._foreign():
        return
    call, before = release_of(ticket)
    try:
        result = yield Run(call)
    except BaseException as error:
        release_failed(ticket, call, before, error)
        raise
    try:
        released(ticket, call, before, result)
    except NotHeld:
        if not ticket._resign_quietly:
            raise


def clean_up_call(client, call):
    """The ``H`` that looks for a grant of the acquire ``call`` (ended
    Indeterminate), noted until :func:`cleaned_up` for the flush at exit
    (spec §8 rule 11). Its id is that owner, which no other request uses;
    the grants of that owner it finds are released."""
    client._cleanups[call.owner] = call.key
    return holders_call(call.key, call.owner, monotonic(), call.owner, client._transport)


def clean_up(client, call, looking):
    """Runs the clean-up ``H`` ``looking`` (:func:`clean_up_call`) of the
    acquire ``call``: answered, the clean-up is done; else the flush at
    exit does it."""
    try:
        yield Run(looking)
    except Error as error:
        log.debug("clean-up after an indeterminate acquire: %s", error)
        return
    client._cleanups.pop(call.owner, None)


def background_release_call(client, key, token):
    """The ``R`` of a release nobody waits for (a late grant's, a dropped
    ticket's)."""
    return Call("R", key, monotonic() + client._transport, token=token, background=True,
                transport=client._transport)


def release_of(ticket):
    """The release of ``ticket`` (``R`` for exactly its token): the call
    and what :func:`released` or :func:`release_failed` needs, its
    keep-alive stopped and the ticket marked released while it is under
    way; raises, sending nothing, after a known loss or a release
    (``LockLost``). A call, not a course, as an acquire."""
    before = ticket._begin_release()
    # The key and token were checked when the ticket was made.
    return release_call(ticket._key_bytes, ticket.token, monotonic(),
                        ticket._client._transport), before


def released(ticket, call, before, result):
    """After the release ``call`` of ``ticket`` got ``result``: raises
    as ``release`` does. ``N``: the grant is gone (its lease ran out), and
    the ticket stays released. An outcome that executed nothing puts the
    ticket back as it was; ``Indeterminate`` leaves it to be released
    again (:meth:`TicketBase._release_ended`)."""
    try:
        outcome_of(call, result)
    except NotHeld:
        raise
    except BaseException as error:
        release_failed(ticket, call, before, error)
        raise


def release_failed(ticket, call, before, error):
    """The release ``call`` of ``ticket`` raised ``error`` instead of an
    answer: ``Indeterminate`` (or an interruption once its ``R`` may have
    been written) may have released it; any other outcome (``Unavailable``,
    a closed client, a refusal, an interruption before the write) certainly
    did not."""
    if isinstance(error, NotHeld):
        return
    if isinstance(error, Indeterminate):
        sent = True
    elif isinstance(error, Error):
        sent = False
    else:
        sent = call.sent_at is not None
    ticket._release_ended(before, sent)


def exit_release(ticket, exc_type):
    """Leaving a ``with`` block: release, unless the lock was lost (then
    nothing is sent and nothing raised) or the ticket is a parent's. A
    failed release raises only if the block itself did not; one that sent
    nothing, or may not have, leaves the ticket to the drop and the flush
    at exit, which release it."""
    before = ticket._release_at_block_end()
    if before is None:
        return
    # The key and token were checked when the ticket was made.
    call = release_call(ticket._key_bytes, ticket.token, monotonic(), ticket._client._transport)
    try:
        result = yield Run(call)
    except BaseException as error:
        release_failed(ticket, call, before, error)
        if isinstance(error, Error) and exc_type is not None:
            return
        raise
    try:
        released(ticket, call, before, result)
    except NotHeld:
        pass  # the lease had run out: nothing is held
    except Error:
        if exc_type is None:
            raise


def hand_over(ticket, on_lost):
    """Hands ``ticket`` over managed: renewed first if it came with less
    than two thirds of its lease left, then kept alive (the ticket's
    ``_keep_alive_type``, started) every lease/3."""
    if ticket._needs_renewal_before_handover():
        try:
            yield from renewal(ticket, None)
        except Error as error:
            ticket._handover_renewal_failed(error)
    ticket._on_lost = on_lost
    keepalive = ticket._keep_alive_type(ticket)
    ticket._keepalive = keepalive
    keepalive.start()
    return ticket


# --------------------------------------------------------------- keep-alive

class KeepAlive(object):
    """The managed renewal of one ticket (spec §8 rule 10), free of I/O.
    A client starts a :meth:`round` a third into each lease
    (:meth:`due_at`) and calls :meth:`check` at ``valid_until``; setting
    ``stopped`` ends both."""

    def __init__(self, ticket):
        self.ticket = ticket
        self.stopped = False
        self._connections = self._connections_now()

    def _connections_now(self):
        """Which connections the client has had: its address book and how
        many of its sessions ended (``None`` on etcd, which adopts
        nothing)."""
        book = getattr(self.ticket._client, "_book", None)
        return None if book is None else (id(book), book.ended)

    def _reconnected(self):
        """Whether a connection of the client ended since the last time."""
        now = self._connections_now()
        changed = now != self._connections
        self._connections = now
        return changed

    def stop(self):
        """No round starts, and no check declares a loss, from now on."""
        self.stopped = True

    def due_at(self):
        """When the next round starts: a third into the current lease."""
        return self.ticket._renew_due_at()

    def round(self):
        """One renewal (a course), retried while its outcome is unknown or
        it reached no server and ``valid_until`` is ahead; whether it
        succeeded (then the next round is due at :meth:`due_at`). A
        renewal that succeeds after such a failure, or after a connection
        of the client ended, may have adopted the grant on a restarted
        server: the ticket's label is proclaimed again at once, if it is
        gone."""
        outage = False
        while not self.stopped:
            try:
                yield from renewal(self.ticket, None)
            except Error as error:
                retry_in = self.retry_in(error, monotonic())
                if retry_in is None:
                    return False
                outage = True
                yield Pause(retry_in)
                continue
            if (self._reconnected() or outage) and not self.stopped:
                yield from proclaim_again(self.ticket)
            return True
        return False

    def retry_in(self, error, now):
        """After a renewal raised ``error``: the seconds to wait before
        trying again, or ``None`` to stop renewing (the loss is declared
        where it is one)."""
        ticket = self.ticket
        if ticket._client._closed:
            # Not a loss: the client was closed under the lock, which the
            # flush at the program's end releases (or its lease ends).
            return None
        if isinstance(error, (Unavailable, Indeterminate)):
            if self.stopped:
                return None
            left = ticket.valid_until - now
            if left <= 0:
                ticket._declare_lost("no successful renewal before valid_until (%s)" % error)
                return None
            return min(RENEW_RETRY, left)
        if isinstance(error, (NotHeld, LockLost)):
            # renew() declared the loss, or it was known already.
            return None
        # Any other outcome is definitive and a loss: PermissionDenied (the
        # secret's scopes do not cover the key, or the server refuses the
        # client's credentials since it restarted) is not retried.
        ticket._declare_lost("renewal failed: %s" % error)
        return None

    def check(self):
        """At ``valid_until``: declares the loss if it has passed. The
        instant to check again, or ``None`` (stopped, or lost)."""
        if self.stopped or self.ticket._declare_lost_if_expired():
            return None
        return self.ticket.valid_until


class LockContextBase(object):
    """What ``client.lock(...)`` returns, but how it waits. Each entry
    takes a ticket of its own, kept by its entrant (a thread, a task), so
    one object may be entered by several at once (as a semaphore), and
    again by the same: each exit releases its entrant's latest entry."""

    def __init__(self, client, args, permits, on_lost):
        self._client = client
        self._args = args
        self._permits = permits
        self._on_lost = on_lost
        self._entries = {}  # entrant -> its tickets, the latest entry's last

    def _entered(self, entrant, ticket):
        self._entries.setdefault(entrant, []).append(ticket)
        return ticket

    def _leaving(self, entrant):
        """The ticket the exit of ``entrant`` releases: its latest entry's;
        if it made none and one entrant did (entered on one thread or
        task and left on another, as a driver that runs each step as a
        task does), that one's."""
        stack = self._entries.get(entrant)
        if stack is None and len(self._entries) == 1:
            entrant, stack = next(iter(list(self._entries.items())))
        if stack is None:
            # Several others hold entries (or none does): which one this
            # exit means cannot be told, and guessing would release
            # another entrant's lock.
            raise RuntimeError("this lock() was not entered by the thread or task leaving it")
        ticket = stack.pop()
        if not stack:
            del self._entries[entrant]
        return ticket


# ------------------------------------------------------------------ client

class ClientBase(object):
    """What a client of either flavour holds before any I/O: its
    addresses, credentials, connect timeout, owner ids and tickets. A
    flavour supplies ``_init_client`` (its own state), ``_run``,
    ``_pause``, ``_shutdown_seen``, ``_clean_up_after``,
    ``_release_background`` and ``_ticket_type``."""

    # The flavour's ticket class.
    _ticket_type: Any

    def _init_client(self):
        """The flavour's own state."""
        raise NotImplementedError

    def __init__(self, servers: Union[str, Sequence[str], None] = None,
                 connect_timeout: float = CONNECT_TIMEOUT, *, secret: Union[str, bytes, None] = None,
                 tls: Union[None, bool, ssl.SSLContext] = None,
                 etcd_credentials: Optional[Tuple[str, str]] = None,
                 secret_file: Optional[str] = None, allow_plaintext_secret: bool = False,
                 transport_timeout: Optional[float] = None) -> None:
        self._addresses = check_args(P.resolve_servers, servers)
        # Rule 2's ``D − Dw``: how long past its wait each call gives the
        # transport before it ends Indeterminate (default 5 s).
        self._transport = check_transport_timeout(
            P.TRANSPORT_DEADLINE if transport_timeout is None else transport_timeout)
        self._access = Access(self._addresses, secret, tls, etcd_credentials, secret_file,
                              allow_plaintext_secret)
        self._connect_timeout = check_connect_timeout(connect_timeout)
        self._ids = OwnerIds()
        self._closed = False
        # This client's tickets (weakly), to release them at exit.
        self._tickets: Dict[int, Any] = {}
        self._init_client()
        EXIT_CLIENTS.add(self)

    def __repr__(self) -> str:
        return client_repr(self)


def run_result(call):
    """The end of ``call`` when no session could be had for it by its
    deadline: the result it has (a refusal of the client's credentials),
    else ``Unavailable`` (nothing sent)."""
    if call.result is not None:
        return call.result
    raise Unavailable(call.reason or "no server could be reached by the deadline")


def attempt_result(call, index):
    """After an attempt of ``call`` on address ``index`` got its result:
    that result, or ``None`` when it was refused there before anything
    executed (``MOVED``): the call moves on to another address (rule 4)."""
    result = call.result
    if result[0] != MOVED:
        return result
    call.move_on(index)
    return None

