"""What the sync and asyncio clients share, free of I/O: the call record
and the result kinds, the calls of the API and what they return,
correlation of answers, what the client knows of each address, ticket
bookkeeping. The courses of the calls that take more than one request or
a pause, and the keep-alive's, are in ``_engine``; only blocking versus
awaiting stays in the clients."""

import collections
import contextlib
import ipaddress
import itertools
import logging
import math
import os
import random
import ssl
import sys
import time
import weakref
from typing import Any, ClassVar, Deque, Dict, List, NamedTuple, Optional, Set

from . import _protocol as P
from ._errors import (
    Busy, Error, Indeterminate, InvalidArgument, LimitMismatch, LockLost, NotHeld,
    PermissionDenied, Timeout, Unavailable,
)

log = logging.getLogger("kunci")
# A library's records go where the program's logging config sends them;
# without one they are dropped, never printed by Python's last resort.
log.addHandler(logging.NullHandler())

#: Seconds the release flush at the program's end may take in all (spec §8
#: rule 9), connections included.
EXIT_FLUSH = 0.5

# Every client of this process (both flavours), for the flush at exit.
EXIT_CLIENTS: "weakref.WeakSet[Any]" = weakref.WeakSet()

# Closed clients that still have releases or clean-ups for the flush at
# exit (only it sends them): kept alive until then, as the program may
# drop them first.
KEPT_FOR_EXIT: Set[Any] = set()

_exit_started: List[bool] = []


def exiting():
    """Whether the program is ending: the flush at exit has begun, or the
    interpreter is finalizing. No thread may be started then (Python 3.10
    and 3.11 hang on a thread started during shutdown)."""
    return bool(_exit_started) or sys.is_finalizing()


def begin_exit():
    _exit_started.append(True)


def allow_plaintext_secret_from_env(environ=None):
    """Whether ``$KUNCI_ALLOW_PLAINTEXT_SECRET`` is ``1``."""
    environ = os.environ if environ is None else environ
    return environ.get("KUNCI_ALLOW_PLAINTEXT_SECRET", "").strip() == "1"


def is_loopback_host(host):
    """Whether ``host`` names this machine without a network: an IP literal
    in 127.0.0.0/8 or ``::1`` (also IPv4-mapped), or ``localhost``. A host
    name is never looked up (nothing is resolved before connecting)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    if mapped is not None:
        address = mapped
    return address.is_loopback


def plaintext_secret_refusal(address, context):
    """Why a secret may not go to ``address`` (a parsed address) with TLS
    ``context`` (``None``: plaintext), or ``None`` when it may: over TLS,
    to a loopback address or over a unix socket (spec §12.5)."""
    kind, where = address
    if kind == "unix" or context is not None or is_loopback_host(where[0]):
        return None
    return ("a secret goes only over TLS, to a loopback address or over a unix socket, "
            "and %s is none of them: use tls://, or allow the secret in clear with "
            "allow_plaintext_secret=True or KUNCI_ALLOW_PLAINTEXT_SECRET=1"
            % P.format_address(address))

class KeyStatus(NamedTuple):
    """What ``query`` returns for a key that is not free: the key's state as
    the server answered ``Q``: the active grant's ``token`` (0 when no
    grant is known, e.g. during the grace after an unclean restart), the
    ``owner`` id of the request that was granted, the time left on the
    lease (``lease_left``, seconds as a float like every time the client
    gives; ``lease_ms``, the same in whole ms as the server sent it) and
    the number of queued ``waiters``. It is out of date as soon as it
    arrives: never use it as a lock."""

    token: int
    owner: int
    lease_ms: int
    waiters: int

    @property
    def lease_left(self) -> float:
        """Seconds left on the lease (``lease_ms`` / 1000), as
        :attr:`Grant.lease_left`."""
        return self.lease_ms / 1000.0


class Grant(NamedTuple):
    """One grant of a key (a ``G`` frame): its fencing ``token`` (0 is the
    unknown grant of a crash grace), the ``owner`` id of the request that
    was granted, the permits it holds (``take``; 0 is all of them), the
    time left on its lease and the time it has been held (``lease_left``,
    ``held_for``: seconds as floats) and its ``label`` (``""`` when
    none)."""

    token: int
    owner: int
    take: int
    lease_left: float
    held_for: float
    label: str


class Waiter(NamedTuple):
    """One waiter of a key (a ``W`` frame): its ``owner`` id, the permits
    it asks for (``take``; 0 is all), the seconds left until its wait runs
    out (``wait_left``, a float) and its ``label``."""

    owner: int
    take: int
    wait_left: float
    label: str


class Holders(NamedTuple):
    """What ``holders(key)`` found: the key's ``grants`` in token order and
    its ``waiters`` in queue order (lists), and how many the server left
    out (``left_out``; it lists at most 1000 of each). A snapshot: out of
    date as soon as it arrives; never use it as a lock."""

    grants: List[Grant]
    waiters: List[Waiter]
    left_out: int


class KeyInfo(NamedTuple):
    """One key of the server's table (a ``K`` frame): the ``key`` (str),
    its numbers of ``grants`` and ``waiters``, and its ``limit`` of permits
    (0 when no request named one)."""

    key: str
    grants: int
    waiters: int
    limit: int


class KeyState(NamedTuple):
    """A key's state as one ``O`` answers it (spec §13.2): its current
    ``token`` (the smallest among its grants, 0 when it has none or during
    a crash grace), that grant's ``lease_ms`` left and ``held_ms`` held
    (``None`` where unknown), the number of ``grants`` and ``waiters``, and
    that grant's ``label``."""

    token: int
    lease_ms: int
    held_ms: Optional[int]
    grants: int
    waiters: int
    label: str


class Leader(NamedTuple):
    """Who leads an election (spec §13.6): the ``value`` it campaigned
    with (str), its ``term`` (the grant's token: a fencing token for what
    it writes) and how long it has led (``held_for``, seconds as a float,
    as the server answered; on etcd from the grant time the leader wrote
    into its entry, by the wall clocks of both machines, and ``None``
    where it wrote none). During a server's crash grace (spec §7.2) the
    key is still held by the previous run's grant, whose value and term
    the server does not know: the *unknown leader*, ``value`` ``None``,
    ``term`` 0, ``held_for`` ``None`` (:attr:`known` is false)."""

    value: Optional[str]
    term: int
    held_for: Optional[float]

    @property
    def known(self) -> bool:
        """Whether the value and term are known (not a crash grace's)."""
        return self.term != 0


#: The leader during a crash grace (spec §13.6): one leads, unknown.
UNKNOWN_LEADER = Leader(None, 0, None)


def leader_of(state):
    """The :class:`Leader` a :class:`KeyState` shows, or ``None``. A key
    with a grant but no token is in a crash grace: the unknown leader."""
    if state.token == 0:
        return UNKNOWN_LEADER if state.grants > 0 else None
    held_ms = state.held_ms
    return Leader(state.label, state.token, None if held_ms is None else held_ms / 1000.0)


# Result kinds a call ends with. A tuple whose first item is one of these.
INDETERMINATE = ("?",)
MOVED = "moved"  # ("moved", reason, code): executed by nobody, may move on
DENIED = "denied"  # ("denied", reason): the credentials were refused, nothing executed

# Whether a write left the request certainly not sent, or possibly sent.
UNSENT = 0
SENT = 1

_U64 = (1 << 64) - 1


class Call(object):
    """One request of one call, through all its attempts (same owner, same
    deadlines, spec §8 rule 2)."""

    __slots__ = (
        "op", "key", "owner", "token", "nonce", "lease", "wait_until",
        "deadline", "result", "sent_at", "writing", "background", "abandoned",
        "reason", "refusals", "tried", "waiter", "signalled", "future", "timer",
        "session", "answered_at", "limit", "take", "label",
        "ident", "cursor", "count", "gathered", "clean_up_for", "denials", "wait_s",
        "stamp", "transport", "seen",
    )

    def __init__(self, op, key, deadline, owner=0, token=0, nonce=0, lease=0,
                 wait_until=None, background=False, limit=0, take=0, label=b"",
                 ident=0, cursor=0, count=0, clean_up_for=None, wait_s=0, stamp=False,
                 transport=P.TRANSPORT_DEADLINE):
        self.op = op
        # The seconds past its work (the wait of an acquire or an ``O``)
        # that the call gives the transport: ``D − Dw`` of rule 2.
        self.transport = transport
        # An ``O`` of ``observe``: what it last reported, ``(value, term,
        # time in office known)`` (on etcd, a change of these since then is
        # answered at once, as one of the token).
        self.seen = None
        # A campaign's acquire (spec §13.6): on etcd its entry stores the
        # wall-clock grant time, for ``leader``'s ``held_for``.
        self.stamp = stamp
        # ``O`` (spec §13): its wait in whole seconds; ``token`` is its since.
        self.wait_s = wait_s
        # ``H`` and ``L`` (spec §11): the request's id, ``L``'s cursor and
        # count, and the frames of the answer that came before its ``Z``.
        self.ident = ident
        self.cursor = cursor
        self.count = count
        self.gathered: Any = ([], []) if op == "H" else []
        # An ``H`` sent to clean up after an acquire by this owner ended
        # indeterminate (spec §8 rule 11): its grants are released.
        self.clean_up_for = clean_up_for
        self.key = key
        # An acquire's permits and label (spec §10, §11.1): with limit 0,
        # take 0 and no label it is sent as ``A``, else as ``S``.
        self.limit = limit
        self.take = take
        self.label = label
        self.owner = owner
        self.token = token
        self.nonce = nonce
        self.lease = lease
        self.wait_until = wait_until
        self.deadline = deadline
        self.result: Any = None
        self.sent_at = None
        self.writing = False
        # Nobody waits for the outcome (a compensating or dropped ticket's
        # release); it never closes a session at its deadline.
        self.background = background
        # The caller gave up (cancelled, interrupted): a late grant is
        # released, other answers are dropped.
        self.abandoned = False
        self.reason = None
        self.refusals = set()
        # Addresses this call already failed on: others are tried first.
        self.tried = set()
        self.waiter = None
        self.signalled = False
        self.future = None
        self.timer = None
        self.session = None
        self.answered_at = None
        # The client's count of refused sessions when this call began
        # (``AddressBook.denial_for``).
        self.denials = None

    def waiting(self):
        """Whether somebody waits for this call's outcome."""
        return self.result is None and not self.background and not self.abandoned

    def move_on(self, index):
        """Readies the call for another address after its ``MOVED`` result
        from address ``index`` (an ``X 7``/``X 9`` as the session's first
        frame: nothing executed, rule 4). An address that answered ``X 9``
        is never tried again by this call."""
        self.reason = self.result[1]
        self.tried.add(index)
        if self.result[2] == P.ERROR_NOT_ALLOWED:
            self.refusals.add(index)
        self.result = None
        self.future = None

    def encode(self, now):
        """The frame, with the wire wait computed at ``now`` (rule 3)."""
        op = self.op
        if op == "A":
            wait_s = P.wire_wait(self.wait_until, now)
            if self.limit == 0 and self.take == 0 and not self.label:
                return P.encode_acquire(wait_s, self.lease, self.owner, self.key)
            return P.encode_acquire_permits(
                wait_s, self.lease, self.owner, self.limit, self.take, self.key, self.label)
        if op == "R":
            return P.encode_release(self.token, self.key)
        if op == "C":
            return P.encode_proclaim(self.token, self.key, self.label)
        if op == "E":
            return P.encode_extend(self.lease, self.token, self.key)
        if op == "Q":
            return P.encode_query(self.key)
        if op == "P":
            return P.encode_ping(self.nonce)
        if op == "H":
            return P.encode_holders(self.ident, self.key)
        if op == "L":
            return P.encode_list(self.ident, self.cursor, self.count, self.key)
        if op == "O":
            return P.encode_observe(self.wait_s, self.ident, self.token, self.key)
        return P.INFO_FRAME

    def error_id(self):
        """The id an ``X`` answer to this request carries (spec §6)."""
        if self.op == "A":
            return self.owner
        if self.op in ("R", "E", "C"):
            return self.token
        if self.op == "P":
            return self.nonce
        if self.op in ("H", "L", "O"):
            return self.ident
        return 0


class Pending(object):
    """The possibly-sent (or being written) requests of one session, for
    correlation: acquires by owner, the others in request order."""

    __slots__ = ("acquires", "others")

    def __init__(self):
        self.acquires: Dict[int, Any] = {}
        self.others: Deque[Any] = collections.deque()

    def add(self, call):
        if call.op == "A":
            self.acquires[call.owner] = call
        else:
            self.others.append(call)

    def remove(self, call):
        if call.op == "A":
            owner = call.owner
            if self.acquires.get(owner) is call:
                del self.acquires[owner]
        else:
            try:
                self.others.remove(call)
            except ValueError:
                pass

    def take_all(self):
        calls = list(self.acquires.values())
        calls.extend(self.others)
        self.acquires.clear()
        self.others.clear()
        return calls

    def calls(self):
        calls = list(self.acquires.values())
        calls.extend(self.others)
        return calls

    def _take_other(self, matches):
        others = self.others
        for index, call in enumerate(others):
            if matches(call):
                if index == 0:
                    others.popleft()
                else:
                    del others[index]
                return call
        return None

    def find_listing(self, op, ident):
        """The ``H`` or ``L`` request with this id, left in place."""
        for call in self.others:
            if call.op == op and call.ident == ident:
                return call
        return None

    def correlate(self, frame):
        """The request ``frame`` answers, taken out; ``None`` if none.
        ``G``, ``W``, ``K`` and ``Z`` are handled by :func:`answered_call`."""
        kind = frame[0]
        if kind in ("A", "T", "B"):
            return self.acquires.pop(frame[1], None)
        if kind == "R" or kind == "E" or kind == "C":
            token = frame[1]
            return self._take_other(lambda call: call.op == kind and call.token == token)
        if kind == "N":
            token = frame[1]
            return self._take_other(
                lambda call: call.op in ("R", "E", "C") and call.token == token)
        if kind == "Q" or kind == "I":
            return self._take_other(lambda call: call.op == kind)
        if kind == "P":
            nonce = frame[1]
            return self._take_other(lambda call: call.op == "P" and call.nonce == nonce)
        if kind == "V":
            ident = frame[1]
            return self._take_other(lambda call: call.op == "O" and call.ident == ident)
        if kind == "X":
            ident = frame[2]
            call = self.acquires.get(ident)
            if call is not None:
                del self.acquires[ident]
                return call
            return self._take_other(lambda call: call.op != "A" and call.error_id() == ident)
        return None


class Access(object):
    """A client's credentials (spec §12.5), checked when the client is
    made: the ``U`` frame that opens each session when a secret is set,
    and the TLS context of each address (``None``: plaintext).

    ``tls``: ``None`` (plaintext, but a ``tls://`` address uses the system's
    trust), ``True`` (every TCP address speaks TLS with the system's trust)
    or an ``ssl.SSLContext`` (every TCP address speaks TLS with it: a
    private CA, a client certificate). ``unix:`` addresses stay plaintext:
    a socket file is guarded by its permissions, and the server's TLS
    listeners are TCP.

    On etcd members: ``etcds://`` speaks TLS with ``tls`` (``None`` or
    ``True``: the system's trust) and ``etcd://`` plain HTTP, which takes
    no ``tls`` (say ``etcds://`` instead). ``etcd_credentials``: ``(user,
    password)`` for etcd's own authentication; when ``None``,
    ``$KUNCI_ETCD_USER`` and ``$KUNCI_ETCD_PASSWORD`` if the user is set (as
    ``$KUNCI_SERVER`` gives the addresses). A secret is for kunci servers
    only. ``etcd_tls`` and ``etcd_credentials`` are what the etcd recipe
    uses."""

    def __init__(self, addresses, secret, tls, etcd_credentials=None, secret_file=None,
                 allow_plaintext_secret=False):
        self.etcd_tls = None
        self.etcd_credentials = None
        kinds = set(kind for kind, _ in addresses)
        if secret is not None and secret_file is not None:
            raise InvalidArgument("give a secret or a secret_file, not both")
        if kinds & set(P.ETCD_KINDS):
            if secret_file is not None:
                secret = secret_file  # refused below, as a secret is
            self._init_etcd(kinds, secret, tls, etcd_credentials)
            self.auth_frame = None
            self.contexts = [None] * len(addresses)
            return
        if etcd_credentials is not None:
            raise InvalidArgument(
                "etcd_credentials are for etcd:// and etcds:// addresses; a kunci server "
                "takes a secret")
        secret = check_args(P.check_secret, _secret_of(secret, secret_file))
        self.auth_frame = None if secret is None else P.encode_auth(secret)
        if tls is None or tls is False:
            chosen = None
        elif tls is True:
            chosen = _default_context()
        elif isinstance(tls, ssl.SSLContext):
            chosen = tls
        else:
            raise InvalidArgument(
                "tls must be None, True or an ssl.SSLContext, not %s" % type(tls).__name__)
        system = chosen
        self.contexts = []
        for kind, _ in addresses:
            if kind == "unix":
                self.contexts.append(None)
            elif chosen is not None:
                self.contexts.append(chosen)
            elif kind == "tls":
                if system is None:
                    system = _default_context()
                self.contexts.append(system)
            else:
                self.contexts.append(None)
        if self.auth_frame is not None and not (
                allow_plaintext_secret or allow_plaintext_secret_from_env()):
            for address, context in zip(addresses, self.contexts):
                refusal = plaintext_secret_refusal(address, context)
                if refusal is not None:
                    raise InvalidArgument(refusal)

    def tls_for(self, address_index):
        return self.contexts[address_index]

    def _init_etcd(self, kinds, secret, tls, credentials):
        if secret is not None:
            raise InvalidArgument(
                "a secret is for kunci servers: etcd takes a user and password "
                "(etcd_credentials, docs/ETCD.md)")
        if "etcds" in kinds:
            # As in the Rust client, one etcds:// member makes the cluster TLS.
            if tls is None or tls is True:
                self.etcd_tls = _default_context()
            elif isinstance(tls, ssl.SSLContext):
                self.etcd_tls = tls
            else:
                raise InvalidArgument(
                    "tls must be None, True or an ssl.SSLContext for etcds://, not %r" % (tls,))
        elif tls is not None and tls is not False:
            raise InvalidArgument(
                "etcd:// is plain HTTP and takes no tls; write etcds://HOST:PORT for TLS to "
                "the etcd members")
        if credentials is None:
            credentials = _etcd_credentials_from_env()
        if credentials is not None:
            if (not isinstance(credentials, (tuple, list)) or len(credentials) != 2
                    or not all(isinstance(part, str) for part in credentials)):
                raise InvalidArgument("etcd_credentials must be a (user, password) pair of str")
            if not credentials[0]:
                raise InvalidArgument("etcd_credentials: the user is empty")
            self.etcd_credentials = (credentials[0], credentials[1])


def _secret_of(secret, secret_file):
    """The secret to check: ``secret``, else the contents of
    ``secret_file``, else ``$KUNCI_SECRET`` (as the ``kunci`` command:
    the file wins over the variable), else ``None``."""
    if secret is not None:
        return secret
    if secret_file is not None:
        try:
            with open(secret_file, "rb") as file:
                return file.read()
        except (OSError, TypeError, ValueError) as error:
            raise InvalidArgument("secret_file %r: %s" % (secret_file, error)) from None
    secret = os.environ.get("KUNCI_SECRET")
    if not secret:
        return None
    try:
        P.check_secret(secret)
    except ValueError as error:
        raise InvalidArgument("KUNCI_SECRET: %s" % error) from None
    return secret


def _default_context():
    """The trust for ``tls://`` when the caller gives no context: the CA
    file in ``$KUNCI_TLS_CA`` (as the ``kunci`` command reads it), else
    the system's store."""
    cafile = os.environ.get("KUNCI_TLS_CA")
    if not cafile:
        return ssl.create_default_context()
    try:
        return ssl.create_default_context(cafile=cafile)
    except (OSError, ssl.SSLError) as error:
        raise InvalidArgument("KUNCI_TLS_CA %r: %s" % (cafile, error)) from None


def _etcd_credentials_from_env():
    """``($KUNCI_ETCD_USER, $KUNCI_ETCD_PASSWORD)`` if the user is set."""
    user = os.environ.get("KUNCI_ETCD_USER")
    if not user:
        return None
    password = os.environ.get("KUNCI_ETCD_PASSWORD")
    if password is None:
        raise InvalidArgument("KUNCI_ETCD_USER is set but KUNCI_ETCD_PASSWORD is not")
    return (user, password)


# The TLS alerts by which a server refuses the client's certificate, or its
# absence (OpenSSL's reason names).
_REFUSAL_ALERTS = (
    "CERTIFICATE_REQUIRED", "UNKNOWN_CA", "BAD_CERTIFICATE", "CERTIFICATE_UNKNOWN",
    "UNSUPPORTED_CERTIFICATE", "CERTIFICATE_EXPIRED", "CERTIFICATE_REVOKED", "ACCESS_DENIED",
)


def tls_refusal(error):
    """Why, when ``error`` is the TLS alert by which the server refused
    this client's certificate or its absence; else ``None``. With TLS 1.3
    it comes after the client's side of the handshake is done, on the
    first read; with TLS 1.2 during the handshake."""
    if not isinstance(error, ssl.SSLError) or isinstance(error, ssl.SSLCertVerificationError):
        return None
    reason = getattr(error, "reason", None) or ""
    if "ALERT" not in reason or not any(alert in reason for alert in _REFUSAL_ALERTS):
        return None
    return ("the server refused this client's certificate, or its absence "
            "(TLS alert: %s)" % reason.lower().replace("_", " "))


_UNTRUSTED = "the server's certificate is not trusted"

# What OpenSSL says when the peer's first bytes are no TLS record: the
# port speaks something else (a plain kunci port addressed as tls://).
_NOT_TLS_REASONS = (
    "WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "UNKNOWN_PROTOCOL",
    "HTTP_REQUEST",
)


def tls_not_spoken(error):
    """Why, when ``error`` says the server answered the TLS handshake with
    bytes that are no TLS record (as the ``kunci`` command says it); else
    ``None``."""
    if not isinstance(error, ssl.SSLError) or isinstance(error, ssl.SSLCertVerificationError):
        return None
    reason = getattr(error, "reason", None) or ""
    if reason not in _NOT_TLS_REASONS:
        return None
    return ("the server does not speak TLS on that port (a plain kunci port?): address it "
            "without tls:// (TLS: %s)" % reason.lower().replace("_", " "))


def tls_untrusted(error):
    """Why, when ``error`` says the server's certificate failed
    verification (not trusted, expired, another name); else ``None``."""
    if not isinstance(error, ssl.SSLCertVerificationError):
        return None
    return _UNTRUSTED + ": %s" % (
        error.verify_message or error.reason or error)


def secret_refusal(sent_secret, text):
    """Why a session was refused with ``X 12``."""
    if sent_secret:
        return "the server refused the secret (X 12: %s)" % text
    return "the server requires a secret and this client has none (X 12: %s)" % text


class AddressBook(object):
    """The addresses of one service and what the client knows of each: its
    session, its failures in a row, when it may be tried again and why it
    last failed. The time comes from the caller; the sync client calls
    every method with its lock held."""

    def __init__(self, addresses):
        count = len(addresses)
        self.addresses = addresses
        self.sessions = [None] * count
        self.failures = [0] * count
        self.retry_at = [0.0] * count
        self.last_failure = [None] * count
        self.preferred = 0
        # Sessions refused for the client's credentials so far, and the
        # last reason: calls under way then end PermissionDenied.
        self.denials = 0
        self.denial = None
        # Sessions ended by the server's ``X 8`` (it is shutting down), and
        # sessions ended at all (a keep-alive that sees this change may be
        # renewing on a restarted server).
        self.shutdowns = 0
        self.ended = 0

    def live_session(self):
        """A live session, the preferred address's first; else ``None``."""
        count = len(self.addresses)
        first = self.preferred
        for offset in range(count):
            session = self.sessions[(first + offset) % count]
            if session is not None and session.alive:
                return session
        return None

    def denial_for(self, call):
        """Why ``call`` ends ``PermissionDenied`` now: a session of this
        client was refused for its credentials since the call began (the
        same secret and certificate are never tried again within a call,
        spec §8 rule 12, not on another address either); else ``None``."""
        if call.denials is None:
            call.denials = self.denials
            return None
        if call.denials != self.denials:
            return self.denial
        return None

    def gives_up(self, call, now, closed):
        """Whether ``call`` looks for a session no longer: its deadline
        has passed, or the client's credentials were refused since it
        began (its result then says so). Raises once the client is
        closed."""
        if now >= call.deadline:
            return True
        if closed:
            raise Error("the client is closed")
        denial = self.denial_for(call)
        if denial is not None:
            call.result = (DENIED, denial)
            return True
        return False

    def deny(self, reason):
        self.denials += 1
        self.denial = reason

    def allowed(self, call):
        """The addresses ``call`` may still connect to, the preferred one
        first (none that refused it with ``X 9``). A call with no reason
        of its own yet takes the last failure among them as its reason."""
        count = len(self.addresses)
        first = self.preferred
        order = [(first + offset) % count for offset in range(count)]
        allowed = [i for i in order if i not in call.refusals]
        if call.reason is None:
            failures = [self.last_failure[i] for i in allowed if self.last_failure[i]]
            if failures:
                call.reason = failures[0]
        return allowed

    def ready(self, allowed, call, now):
        """Those of ``allowed`` whose retry time has come, the ones
        ``call`` has not failed on first."""
        ready = [i for i in allowed if self.retry_at[i] <= now]
        ready.sort(key=lambda i: i in call.tried)
        return ready

    def next_try(self, allowed):
        return min(self.retry_at[i] for i in allowed)

    def connected(self, session):
        self.sessions[session.index] = session
        self.preferred = session.index

    def answered(self, index):
        self.failures[index] = 0

    def note_failure(self, index, reason, now):
        """One more failure in a row: the address waits longer (backoff)."""
        self.failures[index] += 1
        self.retry_at[index] = now + P.retry_delay(self.failures[index])
        self.last_failure[index] = reason

    def connect_failed(self, index, call, error, now):
        """A connection (or its TLS handshake) failed. A server whose
        certificate is not trusted is not tried again by this call: the
        certificate and the trust do not change within a call (nor does a
        port that does not speak TLS); another address may still serve it. A server that refused the client's
        certificate refuses it everywhere: the call ends PermissionDenied."""
        address = P.format_address(self.addresses[index])
        refused = tls_refusal(error)
        untrusted = tls_untrusted(error) or tls_not_spoken(error)
        if refused is not None:
            reason = "%s: %s" % (address, refused)
            self.deny(reason)
        elif untrusted is not None:
            reason = "cannot connect to %s: %s" % (address, untrusted)
            call.refusals.add(index)
        else:
            reason = "cannot connect to %s: %s" % (address, error)
        self.note_failure(index, reason, now)
        call.reason = reason
        call.tried.add(index)

    def session_ended(self, session, reason, now):
        self.ended += 1
        if self.sessions[session.index] is session:
            self.sessions[session.index] = None
        if session.denied is not None:
            self.deny(session.denied)
        if getattr(session, "shutting_down", False):
            self.shutdowns += 1
        self.note_failure(session.index, reason, now)


def answered_call(session, frame):
    """The call ``frame`` answers on ``session``, taken out of its pending
    requests, and ``None``; or ``None`` and why the session must end; or
    ``(None, None)`` for the answer to the session's ``U``. A refusal as
    the session's first frame (``X 7``/``X 9``) also sets
    ``session.refused``, an ``X 12`` sets ``session.denied``: nothing sent
    on it was executed."""
    first = session.frames == 0
    session.frames += 1
    kind = frame[0]
    if kind == "X" and first and frame[1] in (P.ERROR_CONNECTION_LIMIT, P.ERROR_NOT_ALLOWED):
        session.refused = (refusal_reason(frame[1]), frame[1])
        return None, session.refused[0]
    if kind == "X" and first and frame[1] == P.ERROR_NOT_AUTHENTICATED:
        session.denied = secret_refusal(session.authenticating, frame[3])
        return None, session.denied
    if kind == "X" and first and frame[1] == P.ERROR_UNKNOWN_OP and session.authenticating:
        # The server stopped at the U: it executed nothing after it.
        session.denied = ("the server does not know U, so it cannot check the secret "
                          "(X 1: %s)" % frame[3])
        return None, session.denied
    if kind == "X" and frame[1] not in P.NON_FATAL_ERRORS:
        if frame[1] == P.ERROR_SHUTTING_DOWN:
            session.shutting_down = True
        return None, "server error %d: %s" % (frame[1], frame[3])
    if session.authenticating:
        if kind != "U":
            return None, "answer %r came before the answer to U" % (frame,)
        session.authenticating = False
        session.user = frame[1]
        return None, None
    if kind == "U":
        return None, "answer %r matches no request" % (frame,)
    if frame[0] in _LISTING_FRAMES or frame[0] == "Z":
        return _gather(session.pending, frame)
    call = session.pending.correlate(frame)
    if call is None:
        return None, "answer %r matches no request" % (frame,)
    return call, None


def answers(book, session, frames, close):
    """The ``(call, frame)`` pairs of ``frames`` (decoded from
    ``session``): each call taken out of the session's pending requests by
    :func:`answered_call`, its address noted as answering, one pair at a
    time while the session lives. A frame that must end the session goes
    to ``close(session, why)`` and ends the pairs; the answer to the
    session's ``U`` makes no pair."""
    for frame in frames:
        if not session.alive:
            return
        call, failure = answered_call(session, frame)
        if call is None:
            if failure is not None:
                close(session, failure)
                return
            continue
        book.answered(session.index)
        yield call, frame


# The frames of a multi-frame answer and the op of the request they answer.
_LISTING_FRAMES = {"G": "H", "W": "H", "K": "L"}


def _gather(pending, frame):
    """Keeps a ``G``, ``W`` or ``K`` frame with the ``H`` or ``L`` its id
    names, until the ``Z`` (which ends the call). Returns as
    :func:`answered_call` does; a frame out of order or past the spec's
    bounds ends the session."""
    kind, ident = frame[0], frame[1]
    if kind == "Z":
        call = pending.find_listing("H", ident) or pending.find_listing("L", ident)
        if call is None:
            return None, "answer %r matches no request" % (frame,)
        count = frame[2]
        got = len(call.gathered[0]) + len(call.gathered[1]) if call.op == "H" else len(call.gathered)
        if count != got:
            return None, "end of a list counts %d frames, %d came" % (count, got)
        pending.remove(call)
        return call, None
    call = pending.find_listing(_LISTING_FRAMES[kind], ident)
    if call is None:
        return None, "answer %r matches no request" % (frame,)
    if kind == "K":
        if len(call.gathered) >= call.count:
            return None, "more keys than the %d asked for" % call.count
        call.gathered.append(KeyInfo(frame[5], frame[2], frame[3], frame[4]))
    elif kind == "G":
        grants, waiters = call.gathered
        if waiters or len(grants) >= P.HOLDERS_MAX:
            return None, "a grant after a waiter, or more than %d" % P.HOLDERS_MAX
        grants.append(Grant(frame[2], frame[3], frame[6], frame[4] / 1000.0,
                            frame[5] / 1000.0, frame[7]))
    else:
        waiters = call.gathered[1]
        if len(waiters) >= P.HOLDERS_MAX:
            return None, "more than %d waiters" % P.HOLDERS_MAX
        waiters.append(Waiter(frame[2], frame[4], frame[3] / 1000.0, frame[5]))
    return call, None


def closed_result(session):
    """The result of a possibly-sent call whose session ended unanswered:
    denied when the server refused the client's credentials, moved when it
    refused the session before reading anything, else indeterminate, with
    why the session ended (``session.ended_by``) when it is known."""
    if session.denied is not None:
        return (DENIED, session.denied)
    if session.refused is not None:
        return (MOVED,) + session.refused
    return indeterminate(getattr(session, "ended_by", None))


def indeterminate(why):
    """An indeterminate result that says ``why`` (``None``: not known)."""
    return INDETERMINATE if why is None else ("?", why)


#: Why a grant noticed at or after the call's deadline ends it indeterminate.
LATE_GRANT = "its grant came after the call's deadline (the client releases it)"


def result_of(call, frame, now, compensate):
    """The result ``frame`` gives ``call`` (already correlated), or ``None``
    when nobody gets it. A grant that nobody may take (a background or
    abandoned acquire, or one noticed at or after ``D``: rule 7) is handed
    to ``compensate(key, token)`` for a release of that exact token."""
    kind = frame[0]
    if kind == "A":
        token = frame[2]
        if not call.waiting():
            compensate(call.key, token)
            return None
        if now >= call.deadline:
            compensate(call.key, token)
            return indeterminate(LATE_GRANT)
        return ("A", token)
    if kind in ("G", "W", "K"):
        return None  # kept with the call until its ``Z``
    if kind == "Z":
        if call.op == "L":
            return ("L", (list(call.gathered), frame[3]))
        holders = Holders(call.gathered[0], call.gathered[1], frame[3])
        if call.clean_up_for is not None:
            for grant in holders.grants:
                if grant.owner == call.clean_up_for:
                    compensate(call.key, grant.token)
        return ("H", holders) if call.waiting() else None
    if not call.waiting():
        return None
    if kind == "Q":
        return ("Q", KeyStatus(frame[1], frame[2], frame[3], frame[4]))
    if kind == "P":
        return ("P", now - call.sent_at)
    if kind == "V":
        return ("O", KeyState(*frame[2:]))
    if kind == "I":
        return ("I", frame[1])
    if kind == "X":
        return ("X", frame[1], frame[3])
    return (kind,)


def refusal_reason(code):
    if code == P.ERROR_CONNECTION_LIMIT:
        return "the server refused the connection: connection limit reached (X 7)"
    return "the server refused the connection: peer not allowed (X 9)"


def raise_for(call, result):
    """Raises the exception for a result that is not the call's answer."""
    kind = result[0]
    if kind == "T":
        if call.wait_until is None:
            raise Timeout("timeout: key %r was held at the one attempt (wait 0); nothing was "
                          "acquired" % key_text(call.key))
        raise Timeout("timeout: key %r stayed held for the whole wait; nothing was acquired"
                      % key_text(call.key))
    if kind == "B":
        raise Busy("busy: the server has no capacity for the request, or is shutting down")
    if kind == "N":
        raise NotHeld("not held: token %d is not the key's active grant" % call.token)
    if kind == "X":
        code, text = result[1], result[2]
        if code == P.ERROR_TOO_MANY_WATCHES:
            raise Busy("busy: the server holds as many watches or waits as it allows "
                       "(X 14: %s); nothing is held" % text)
        if code == P.ERROR_NOT_PERMITTED:
            raise PermissionDenied(
                "permission denied: the secret's scopes do not cover this request (X 13: %s); "
                "nothing changed" % text)
        if code == P.ERROR_LIMIT_MISMATCH:
            key_limit = P.key_limit_of_mismatch(text)
            raise LimitMismatch(
                "limit mismatch: key %r has %s, this request named limit %d; nothing was "
                "acquired" % (key_text(call.key), "no known limit" if key_limit is None
                              else "limit %d" % key_limit, call.limit),
                key_limit)
        raise InvalidArgument("the server refused the request: %s (X %d)" % (text, code))
    if kind == MOVED:
        raise Unavailable(result[1])
    if kind == DENIED:
        raise PermissionDenied("permission denied: %s; nothing was executed" % result[1])
    if kind == "?":
        why = result[1] if len(result) > 1 else "no answer came in time"
        raise Indeterminate("indeterminate: %s may have reached the server, but %s; %s"
                            % (_request_text(call), why, _UNKNOWN_EFFECT.get(call.op, "")))
    raise Indeterminate("unexpected answer %r" % (result,))


def _request_text(call):
    """The request of ``call`` in words, for a message."""
    op = call.op
    key = key_text(call.key) if op not in ("I", "P", "L") else ""
    if op == "A":
        return "the acquire of %r" % key
    if op == "R":
        return "the release of %r (token %d)" % (key, call.token)
    if op == "E":
        return "the renewal of %r (token %d)" % (key, call.token)
    if op == "C":
        return "the proclaim of %r (token %d)" % (key, call.token)
    return {"Q": "the query of %r" % key, "H": "the holders request for %r" % key,
            "O": "the observe request for %r" % key, "L": "the listing request",
            "I": "the info request", "P": "the ping"}.get(op, "the request")


# What an indeterminate outcome leaves unknown, by op.
_UNKNOWN_EFFECT = {
    "A": "do not assume the lock is held (a grant that comes late is released by the client)",
    "R": "the lock may or may not be released (releasing again is harmless)",
    "E": "the lease may or may not have been renewed",
    "C": "the label may or may not have changed",
}
for _op in "QHOLIP":
    _UNKNOWN_EFFECT[_op] = "it changed nothing; ask again"
del _op


def check_connect_timeout(value):
    """``connect_timeout`` as a float: a number of seconds > 0."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise InvalidArgument(
            "connect_timeout must be a number of seconds > 0, got %r" % (value,))
    return float(value)


def check_transport_timeout(value):
    """``transport_timeout`` as a float: a number of seconds > 0 and at
    most 3600."""
    if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
            or not 0 < value <= 3600):
        raise InvalidArgument(
            "transport_timeout must be a number of seconds above 0 and at most 3600, got %r"
            % (value,))
    return float(value)


def check_on_lost(on_lost):
    if on_lost is not None and not callable(on_lost):
        raise InvalidArgument("on_lost must be callable (it gets the ticket), not %s"
                              % type(on_lost).__name__)


def client_repr(client):
    """``<kunci.Client 127.0.0.1:5862, ...>``: its class and addresses."""
    return "<%s.%s %s%s>" % (
        type(client).__module__.replace("._sync", ""), type(client).__name__,
        ", ".join(P.format_address(address) for address in client._addresses),
        " closed" if client._closed else "")


def check_args(check, *values):
    try:
        return check(*values)
    except ValueError as error:
        raise InvalidArgument(str(error)) from None


def key_text(key):
    return key if isinstance(key, str) else bytes(key).decode("utf-8")


# The calls of the API, their input checked; ``now`` is when the call
# starts (its deadline counts from there, rule 2).

def acquire_call(key, wait, lease, owner, now, limit=None, take=None, shared=False, label=None,
                 stamp=False, transport=P.TRANSPORT_DEADLINE):
    key_bytes = check_args(P.check_key, key)
    wait = check_args(P.check_wait, wait)
    lease = check_args(P.check_lease, lease)
    limit, take = check_args(P.check_permits, limit, take, shared)
    label = check_args(P.check_label, label)
    wait_until = now + wait
    return Call("A", key_bytes, wait_until + transport, owner=owner, lease=lease,
                wait_until=wait_until if wait > 0 else None, limit=limit, take=take,
                label=label, stamp=stamp, transport=transport)


def release_call(key, token, now, transport=P.TRANSPORT_DEADLINE):
    key_bytes = check_args(P.check_key, key)
    token = check_args(P.check_token, token)
    return Call("R", key_bytes, now + transport, token=token, transport=transport)


def renew_call(key, token, lease, now, transport=P.TRANSPORT_DEADLINE):
    # A ticket passes its key as bytes, already checked.
    key_bytes = key if isinstance(key, bytes) else check_args(P.check_key, key)
    token = check_args(P.check_token, token)
    lease = check_args(P.check_lease, lease)
    return Call("E", key_bytes, now + transport, token=token, lease=lease, transport=transport)


def proclaim_call(key, token, label, now, transport=P.TRANSPORT_DEADLINE):
    """``C`` (spec §13.4a): the grant ``token`` of ``key`` takes ``label``."""
    return Call("C", key, now + transport, token=token, label=label, transport=transport)


def query_call(key, now, transport=P.TRANSPORT_DEADLINE):
    return Call("Q", check_args(P.check_key, key), now + transport, transport=transport)


def holders_call(key, ident, now, clean_up_for=None, transport=P.TRANSPORT_DEADLINE):
    return Call("H", check_args(P.check_key, key), now + transport, ident=ident,
                clean_up_for=clean_up_for, transport=transport)


def list_call(prefix, cursor, count, ident, now, transport=P.TRANSPORT_DEADLINE):
    prefix = check_args(P.check_prefix, prefix)
    if not _is_u64(cursor):
        raise InvalidArgument("cursor must be an unsigned 64-bit integer")
    if not isinstance(count, int) or isinstance(count, bool) or not 1 <= count <= P.LIST_COUNT_MAX:
        raise InvalidArgument("count must be a whole number from 1 to %d" % P.LIST_COUNT_MAX)
    return Call("L", prefix, now + transport, ident=ident, cursor=cursor, count=count,
                transport=transport)


def observe_call(key, since, wait_s, ident, now, transport=P.TRANSPORT_DEADLINE):
    """One ``O`` (spec §13.1): ``wait_s`` whole seconds (0 to 255); its
    deadline is ``start + wait + 5 s`` (rule 5, as a query's; 5 s is the
    client's ``transport_timeout``)."""
    return Call("O", check_args(P.check_key, key), now + wait_s + transport,
                token=since, ident=ident, wait_s=wait_s, transport=transport)


def check_campaign_value(value):
    """A candidate's value as label bytes: 1 to 128 UTF-8 bytes, no newline."""
    try:
        label = P.check_label(value)
    except ValueError as error:
        # The candidate's value travels as the grant's label: say value.
        raise InvalidArgument(str(error).replace("label", "value")) from None
    if not label:
        raise InvalidArgument("value is empty (a candidate's value is 1 to 128 bytes)")
    return label


class Follow(object):
    """The decisions of ``observe(name)`` (spec §13.6), free of I/O; each
    client drives it: the first ``O`` reads (wait 0), each next one waits
    255 s with the last answer's token as its since. After a failure other
    than ``InvalidArgument`` or ``PermissionDenied`` it asks again after a
    pause that doubles from 0.1 s up to 2 s. A state is reported only when
    it differs from the last one reported, and never with a term older
    than the last reported."""

    #: What :meth:`answered` returns when there is nothing to report.
    NOTHING: ClassVar[object]

    def __init__(self, key, transport=P.TRANSPORT_DEADLINE):
        self.key = key
        self.transport = transport
        self.since = None
        self.reported: Any = _NOTHING
        self.pause = RETRY_PAUSE_FIRST

    def call(self, ident, now):
        if self.since is None:
            return observe_call(self.key, 0, 0, ident, now, self.transport)
        call = observe_call(self.key, self.since, P.WAIT_MAX, ident, now, self.transport)
        call.seen = None if self.reported is _NOTHING else self.reported
        return call

    def failed(self, error):
        """The pause before asking again after ``error``; raises it if it
        is one that asking again cannot change."""
        if isinstance(error, (InvalidArgument, PermissionDenied)):
            raise error
        pause = jittered(self.pause)
        self.pause = min(self.pause * 2, RETRY_PAUSE_MAX)
        return pause

    def answered(self, state):
        """The leader (or ``None``) to report after ``state``, or
        ``Follow.NOTHING`` when it reports nothing new."""
        self.pause = RETRY_PAUSE_FIRST
        self.since = state.token
        leader = leader_of(state)
        # On etcd a leader's time in office may become known after its
        # grant (its campaign stamps it then): that is news too.
        shown = None if leader is None else (
            leader.value, leader.term, leader.held_for is not None)
        last = self.reported
        if last is not _NOTHING:
            if shown == last:
                return _NOTHING
            if shown is not None and last is not None and shown[1] < last[1]:
                return _NOTHING
        self.reported = shown
        return leader


_NOTHING = object()
Follow.NOTHING = _NOTHING


def _is_u64(value):
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _U64


def info_call(now, transport=P.TRANSPORT_DEADLINE):
    return Call("I", b"", now + transport, transport=transport)


def ping_call(nonce, now, transport=P.TRANSPORT_DEADLINE):
    return Call("P", b"", now + transport, nonce=nonce, transport=transport)


def waits_forever(wait):
    """Whether ``wait`` asks to wait until granted: ``None`` or ``math.inf``."""
    return wait is None or (isinstance(wait, float) and wait == math.inf)


#: The wait of each attempt of ``acquire(wait=None)``: the longest a
#: request may carry (spec §1).
WAIT_FOREVER_SLICE = float(P.WAIT_MAX)
#: The first pause before ``acquire(wait=None)`` asks again after a
#: restart, an outage or an unknown outcome; it doubles up to the second.
#: Each pause taken is ``jittered``.
RETRY_PAUSE_FIRST = 0.1
RETRY_PAUSE_MAX = 2.0
#: The jitter of a retry pause: ±25 % (spec §13.6), so that the clients of
#: a server that restarts do not all come back in the same millisecond.
RETRY_JITTER = 0.25


def jittered(pause):
    """``pause`` seconds ± ``RETRY_JITTER``, uniformly."""
    return pause * random.uniform(1.0 - RETRY_JITTER, 1.0 + RETRY_JITTER)
#: How long after a ``Busy`` the ``X 8`` of a shutting-down server may
#: still come (the server sends the two back to back).
SHUTDOWN_NOTICE_WAIT = 0.2


class WaitForever(object):
    """The decisions of ``acquire(wait=None)``, as ``kunci acquire --wait
    inf`` makes them (spec §9), free of I/O; each client drives it (the
    sync client blocking, the asyncio one awaiting):

    - every attempt is a new request (a fresh owner) at the tail of the
      queue, with the longest wire wait (``WAIT_FOREVER_SLICE``): the place
      in the queue is not kept from one attempt to the next;
    - ``Timeout`` asks again at once;
    - ``Busy`` from a server that is shutting down (its ``X 8`` follows),
      and ``Unavailable`` (but not a server certificate that is not
      trusted), ask again after a pause that doubles from 0.1 s up to 2 s;
    - ``Indeterminate``: the attempt's own grant, if the server made one,
      is released first (``own_grants``; rule 11), then it asks again
      after the pause;
    - every other outcome (a ``Busy`` at a capacity limit included) ends
      the call."""

    def __init__(self, key, lease, limit=None, take=None, shared=False, label=None,
                 stamp=False, transport=P.TRANSPORT_DEADLINE, wait=None):
        self.args = (key, lease, limit, take, shared, label)
        self.stamp = stamp
        self.transport = transport
        # A bounded wait (``campaign(..., wait=S)``): the instant the last
        # attempt's wait ends, ``None`` for ever.
        self.until = None if waits_forever(wait) else (
            time.monotonic() + check_args(P.check_wait, wait))
        self.pause = RETRY_PAUSE_FIRST
        # Checked once, before anything is sent.
        self.call(0, time.monotonic())

    def call(self, owner, now):
        """The next attempt's call."""
        key, lease, limit, take, shared, label = self.args
        wait = WAIT_FOREVER_SLICE
        if self.until is not None:
            wait = max(0.0, min(wait, self.until - now))
        return acquire_call(key, wait, lease, owner, now, limit, take, shared, label,
                            self.stamp, self.transport)

    def after(self, error, shut_down):
        """After an attempt raised ``error`` (``shut_down``: a server said
        it is shutting down since the attempt began): the seconds to pause
        before the next attempt, or ``None`` when ``error`` ends the call.
        The caller cleans up first after ``Indeterminate``."""
        left = None if self.until is None else self.until - time.monotonic()
        if left is not None and left <= 0:
            return None  # a bounded wait ran out: the last outcome stands
        if isinstance(error, Timeout):
            self.pause = RETRY_PAUSE_FIRST
            return 0.0
        if isinstance(error, Busy) and not shut_down:
            return None
        if isinstance(error, Unavailable) and _UNTRUSTED in error.reason:
            return None  # a certificate does not change by waiting
        if not isinstance(error, (Busy, Unavailable, Indeterminate)):
            return None
        pause = jittered(self.pause)
        self.pause = min(self.pause * 2, RETRY_PAUSE_MAX)
        return pause if left is None else min(pause, left)


def own_grants(holders, owner):
    """The tokens ``holders`` shows granted to the request of ``owner``."""
    return [grant.token for grant in holders.grants if grant.owner == owner and grant.token != 0]


def granted_token(call, result, now, compensate):
    """The token an acquire hands over, or raises. A grant is handed over
    only before ``D`` (the hand-over gate, rule 7): one noticed at or after
    it goes to ``compensate(key, token)`` and the call ends indeterminate."""
    if result[0] != "A":
        raise_for(call, result)
    token = result[1]
    if now >= call.deadline:
        compensate(call.key, token)
        raise_for(call, indeterminate(LATE_GRANT))
    return token


def outcome_of(call, result):
    """What a release, renew, query, info or ping returns for ``result``;
    raises for every result that is not the answer to its op. A renew
    returns ``(valid_until, sent_at)``."""
    op = call.op
    if result[0] != op:
        raise_for(call, result)
    if op == "E":
        return P.valid_until(call.sent_at, call.lease), call.sent_at
    if op == "Q":
        status = result[1]
        return None if status == (0, 0, 0, 0) else status
    if op == "I":
        return P.parse_info(result[1])
    if op == "P":
        return result[1]
    if op in ("H", "L", "O"):
        return result[1]
    return None


def needs_clean_up(call, result):
    """Whether an acquire that ended with ``result`` may have been
    granted without the grant reaching the caller, so that the client
    should look for it with ``H`` and release it (spec §8 rule 11)."""
    return call.op == "A" and result[0] == "?" and call.sent_at is not None


class OwnerIds(object):
    """Owner ids and ping nonces unique within one client: a random base
    plus a counter (``next`` on an ``itertools.count`` is atomic under the
    GIL), skipping 0."""

    def __init__(self):
        import itertools
        self._base = P.random_u64()
        self._count = itertools.count()

    def next(self):
        while True:
            value = (self._base + next(self._count)) & _U64
            if value:
                return value


_TICKET_SERIALS = itertools.count(1)


def current_pid():
    return os.getpid()


class TicketBase(object):
    """The bookkeeping of a granted lock that does not depend on how its
    client waits: validity, loss, ownership across a fork. A subclass
    supplies ``renew``, ``release`` and ``_report_lost`` (how ``on_lost``
    runs), and its keep-alive (``_keep_alive_type``: a
    :class:`kunci._engine.KeepAlive`)."""

    key: str
    token: int
    lease: int
    limit: Optional[int]
    take: int
    valid_until: float

    # What guards the ticket's state against another thread (the sync
    # ticket's lock); nothing in an event loop.
    _state_lock: Any = contextlib.nullcontext()
    # The flavour's keep-alive (a ``kunci._engine.KeepAlive``).
    _keep_alive_type: Any
    # A campaign's ticket: resigning a lead already lost returns quietly.
    _resign_quietly = False

    def _report_lost(self, on_lost):
        """Hands the ticket to ``on_lost`` as the flavour does."""
        raise NotImplementedError

    def __init__(self, client, key, key_bytes, token, lease, sent_at, limit=0, take=0,
                 label=b""):
        self._client = client
        # The grant's label (a campaign's value): proclaimed again after
        # the grant was adopted by a restarted server (spec §7.5).
        self._label = label
        self.key = key
        self._key_bytes = key_bytes
        self.token = token
        self.lease = lease
        # The permits of the grant (spec §10): ``limit`` as the request
        # named it (``None``: no limit), ``take`` the permits it holds
        # (0: all of them, an exclusive lock).
        self.limit = limit or None
        self.take = take
        self.valid_until = P.valid_until(sent_at, lease)
        self._lease_sent_at = sent_at
        self._pid = os.getpid()
        self._done = False  # released or detached: the drop does nothing
        self._released = False  # given back on purpose: no longer valid
        self._lost = False
        # A release of it ended Indeterminate: it may be released already,
        # so it is not valid, but a release may be tried again (a second
        # ``R`` finds nothing: ``N``), and the drop and the flush at exit
        # still release it.
        self._release_unsure = False
        self._keepalive = None
        self._on_lost = None
        # The client knows its tickets (weakly) to release them at exit.
        self._serial = next(_TICKET_SERIALS)
        client._tickets[self._serial] = weakref.ref(self)

    def __repr__(self):
        permits = "" if self.limit is None else ", take=%d, limit=%d" % (self.take, self.limit)
        # The time left, not the raw monotonic instant of valid_until.
        return "Ticket(key=%r, token=%d, lease=%d%s, valid_for=%.3fs%s)" % (
            self.key, self.token, self.lease, permits,
            max(0.0, self.valid_until - time.monotonic()), ", lost" if self._lost else "")

    def _foreign(self):
        return self._pid != os.getpid()

    @property
    def lost(self) -> bool:
        """Whether the lock is known to be lost (a renewal answered ``N``,
        or ``valid_until`` passed under keep-alive). Always true in a
        forked child: the lock belongs to the parent."""
        return self._lost or self._foreign()

    @property
    def released(self) -> bool:
        """Whether this ticket was released on purpose (``release()``, the
        end of its ``with`` block, the flush at exit): it is no longer
        valid, and no loss is ever reported for it."""
        return self._released

    def is_valid(self) -> bool:
        """Whether ``valid_until`` is still ahead, the ticket was not
        released, and no loss is known."""
        return (not self.lost and not self._released and not self._release_unsure
                and time.monotonic() < self.valid_until)

    def check(self) -> None:
        """Raises :class:`LockLost` unless the lock is still held
        (``is_valid()``). Call it before each step that relies on the
        lock; pass ``token`` to the resource all the same."""
        if self._foreign():
            raise LockLost("this ticket belongs to process %d" % self._pid)
        if self._released:
            raise LockLost("lock on %r (token %d) was released" % (self.key, self.token))
        self._raise_if_lost()
        self._raise_if_release_unsure()
        if self._declare_lost_if_expired():
            raise LockLost("lock on %r (token %d): valid_until has passed" % (self.key, self.token))

    def detach(self) -> int:
        """Keeps the lock held after this object is dropped, and at the
        program's end; returns the token. The lease still ends unless
        someone renews it."""
        self._stop_keepalive()
        self._done = True
        return self.token

    def __del__(self):
        try:
            self._client._tickets.pop(self._serial, None)
            if not self._done and not self._foreign():
                self._done = True
                self._client._release_background(self._key_bytes, self.token)
        except Exception:
            pass

    def _take_for_exit(self):
        """At the program's end: whether the flush releases this ticket
        (not released, detached or lost, and this process's), marking it
        released and stopping its keep-alive."""
        if self._done or self._foreign() or self._lost:
            return False
        self._done = True
        self._released = True
        # Only marked: its thread or event loop (maybe closed, maybe
        # another thread's) is not touched from here.
        keepalive = self._keepalive
        if keepalive is not None:
            keepalive.stopped = True
        return True

    def _check_owned(self):
        if self._foreign():
            raise Error("this ticket belongs to process %d; a forked child never "
                        "renews or releases its parent's locks" % self._pid)

    def _raise_if_release_unsure(self):
        if self._release_unsure:
            raise LockLost("lock on %r (token %d) may be released: a release of it ended "
                           "Indeterminate (release it again to be sure)" % (self.key, self.token))

    def _raise_if_lost(self):
        if self._released:
            raise LockLost("lock on %r (token %d) was released" % (self.key, self.token))
        if self._lost:
            raise LockLost("lock on %r (token %d) was lost" % (self.key, self.token))

    def _declare_lost(self, why):
        """Declares the loss, once and never after a release: ``valid_until``
        no later than now, the keep-alive stopped, a warning logged, and
        ``on_lost`` handed the ticket (``_report_lost``)."""
        with self._state_lock:
            if self._lost or self._released:
                return
            self._lost = True
            self.valid_until = min(self.valid_until, time.monotonic())
            on_lost = self._on_lost
        self._stop_keepalive()
        log.warning("lock on %r (token %d) lost: %s", self.key, self.token, why)
        if on_lost is not None:
            self._report_lost(on_lost)

    def _stop_keepalive(self):
        if self._foreign():
            # In a forked child: the parent's keep-alive is not ours (and
            # the lock may have been held by a thread that is gone).
            return
        with self._state_lock:
            keepalive, self._keepalive = self._keepalive, None
        if keepalive is not None:
            keepalive.stop()

    def _declare_lost_if_expired(self):
        """Declares the loss once ``valid_until`` has passed (rule 10);
        whether it has."""
        if time.monotonic() >= self.valid_until:
            self._declare_lost("valid_until passed without a successful renewal")
            return True
        return False

    def _renewal_lease(self, lease):
        """The lease a renewal asks for (default: the ticket's), or raises
        when this ticket may not renew."""
        self._check_owned()
        self._raise_if_lost()
        self._raise_if_release_unsure()
        return self.lease if lease is None else check_args(P.check_lease, lease)

    def _needs_renewal_before_handover(self):
        """Whether a managed lock renews this new grant before handing it
        over (rule 10): less than two thirds of its lease is left on
        ``valid_until``, which counts from the acquire's send instant, so a
        grant that came after a wait may have spent most of it, or all."""
        return self.valid_until - time.monotonic() < self.lease * 2.0 / 3.0

    def _handover_renewal_failed(self, error):
        """The renewal before hand-over raised ``error``. Returns when the
        ticket may still be handed over: ``valid_until`` is ahead, and the
        keep-alive retries at once (its renewal is already due). Else
        raises :class:`LockLost` and nothing is handed over; a grant the
        server may still hold (the renewal's outcome is unknown) is
        released in the background."""
        if isinstance(error, PermissionDenied):
            # Definitive, and a renewal of this grant will not fare better.
            self._declare_lost("the renewal was refused: %s" % error)
            self._done = True
            raise LockLost(
                "lock on %r (token %d) was lost before it was handed over: its renewal was "
                "refused (%s)" % (self.key, self.token, error)) from error
        if isinstance(error, NotHeld):
            # renew() declared the loss; the token holds nothing to release.
            self._done = True
            raise LockLost(
                "lock on %r (token %d) was lost before it was handed over: the grant came "
                "with less than 2/3 of its lease left and its renewal was answered N"
                % (self.key, self.token)) from error
        if not self._declare_lost_if_expired():
            return
        self._done = True
        self._client._release_background(self._key_bytes, self.token)
        raise LockLost(
            "lock on %r (token %d) was lost before it was handed over: the grant came "
            "after its valid_until and could not be renewed (%s)"
            % (self.key, self.token, error)) from error

    def _renew_due_at(self):
        """When a keep-alive renews next: a third into the lease."""
        return self._lease_sent_at + self.lease / 3.0

    def _renewal_indeterminate(self, started, lease):
        # The renewal may have set a lease from any instant after
        # ``started``: keep the earlier of the two bounds.
        self.valid_until = min(self.valid_until, P.valid_until(started, lease))

    def _renewed(self, sent_at, lease, valid_until):
        # Renewals may end out of order: the latest sent one counts.
        if sent_at >= self._lease_sent_at:
            self._lease_sent_at = sent_at
            self.lease = lease
            self.valid_until = valid_until

    def _begin_release(self):
        """Before a release: raises when there is nothing this process may
        release; else marks the ticket released while its ``R`` is under
        way (no second release, no flush at exit, no loss reported) and
        stops its keep-alive. Returns what :meth:`_release_ended` needs to
        put the ticket back as it was if the release sent nothing."""
        self._check_owned()
        with self._state_lock:
            if self._released:
                raise LockLost(
                    "lock on %r (token %d) was released already" % (self.key, self.token))
            if self._lost:
                self._done = True
                self._raise_if_lost()
            before = (self._done, self._release_unsure, self._keepalive is not None)
            self._done = True
            self._released = True
        self._stop_keepalive()
        return before

    def _release_at_block_end(self):
        """Leaving a ``with`` block: stops the keep-alive; ``None`` when no
        release is sent (after a known loss, for a parent's ticket, or a
        second time), else as :meth:`_begin_release`. The keep-alive is not
        started again whatever the release's outcome: the block that wanted
        the lock is over."""
        self._stop_keepalive()
        with self._state_lock:
            if self._foreign() or self._done:
                return None
            self._done = True
            if self._lost:
                return None
            self._released = True
            return (False, self._release_unsure, False)

    def _release_ended(self, before, sent):
        """A release begun by :meth:`_begin_release` (which returned
        ``before``) did not end with the server's answer. ``sent`` is
        ``False`` when its ``R`` certainly reached no server (``Unavailable``,
        a closed client, a refusal that executed nothing, an interruption
        before the write): the ticket is put back exactly as it was, its
        keep-alive started again. Else (``Indeterminate``) the release may
        or may not have happened: the ticket is no longer valid, but may be
        released again, and the drop and the flush at exit still release
        it."""
        done, unsure, kept_alive = before
        with self._state_lock:
            self._released = False
            if sent:
                self._done = False
                self._release_unsure = True
                return
            self._done = done
            self._release_unsure = unsure
            restart = kept_alive and not self._lost and not self._done and self._keepalive is None
        if restart:
            keepalive = self._keep_alive_type(self)
            self._keepalive = keepalive
            keepalive.start()
