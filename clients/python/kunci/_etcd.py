"""The client on an etcd v3 cluster (``etcd://HOST:PORT[,HOST:PORT…]``):
the same calls and outcomes as on a kunci server, through etcd's JSON
gateway (``/v3/…``) over HTTP/1.1. docs/ETCD.md describes the mapping,
which the Rust client follows too (src/client/etcd/recipe.rs); this module
is its Python form, decision for decision.

One acquire is one etcd lease (TTL = the kunci lease) and one entry
``kunci/LEN:KEY/LEASEID`` attached to it, valued ``OWNER`` (a plain
exclusive lock) or ``OWNER LIMIT TAKE [LABEL]`` (permits). With the
entries in create-revision order, an entry holds when it and every earlier
entry fit (a prefix sum: :func:`judge`); its create revision is the fencing
token. A waiter watches only earlier entries, and only as many as must go
before it can fit. Every failure path removes the caller's entry by
revoking its lease.

Every call runs on the thread that calls :meth:`Cluster.run` and blocks
until its outcome (the asyncio client runs it on a thread of its own);
background work (releases nobody waits for, lease revocations) runs on
short-lived threads. A call's outcome is a result tuple of ``_common``,
so tickets, keep-alives and exceptions are those of a kunci server.
"""

import collections
import json
import re
import threading
import time
from typing import Any, List, Optional

from . import _protocol as P
from ._common import (
    DENIED, INDETERMINATE, MOVED, Grant, Holders, KeyInfo, KeyState, KeyStatus, Waiter, exiting,
    log,
)
from ._errors import InvalidArgument
from ._etcd_http import (
    RETRY_PAUSE, Denied, Members, _array, _b64, _bytes, _field, _int, _parse, _Unanswered, _Unsent,
)

monotonic = time.monotonic

#: How long one attempt of a repeatable request (a read, a revocation, a
#: grant, a keep-alive) waits for its answer before it is tried again on
#: another member, within the call's deadline. A healthy cluster answers in
#: milliseconds; an election takes about one election timeout (1 s by
#: default).
ATTEMPT_LIMIT = 2.0

#: How long a waiting acquire reads its watch before it looks whether its
#: caller gave up (a cancelled asyncio task).
_ABANDON_CHECK = 0.2

#: etcd's error code for "not found" (gRPC ``NotFound``): a lease that
#: expired or was revoked.
CODE_NOT_FOUND = 5

#: How many listing cursors one client remembers.
CURSORS_MAX = 1024

ROOT = b"kunci/"
ROOT_END = b"kunci0"

UNREACHABLE = "no etcd member could be reached by the deadline"


class Fault(Exception):
    """A request that changes something failed: ``sent`` says whether it
    may have reached etcd (``Indeterminate``) or certainly did not
    (``Unavailable``)."""

    def __init__(self, sent):
        super().__init__("possibly sent" if sent else "not sent")
        self.sent = sent

    def result(self):
        return INDETERMINATE if self.sent else (MOVED, UNREACHABLE, 0)


# ---------------------------------------------------------- the mapping


def prefix_of(key):
    """Where one kunci key's entries live: ``kunci/LEN:KEY/``. The length
    makes the prefixes of different keys disjoint."""
    return b"kunci/%d:%s/" % (len(key), key)


def prefix_end(prefix):
    """The first key after every key that starts with ``prefix`` (which
    ends with ``/``): its last byte plus one. (For ``KEY/`` of etcd's
    layout with a key that ends with ``/`` itself, stripping every ``/``
    would take in other keys' entries.)"""
    return prefix[:-1] + b"0"


class Entry(collections.namedtuple("Entry", "name create_revision lease value raw",
                                   defaults=(None,))):
    """A key-value pair as a range returns it: ``value`` as kunci's
    encoding reads it; ``raw``, when set, the value stored (etcd's
    layout)."""

    __slots__ = ()

    def raw_value(self):
        return self.value if self.raw is None else self.raw


def _entry(kv):
    name, revision = _bytes(kv, "key"), _int(kv, "create_revision")
    lease, value = _int(kv, "lease"), _bytes(kv, "value")
    if None in (name, revision, lease, value):
        return None
    return Entry(name, revision, lease, value)


def _entries(range_answer):
    """Every entry of a range answer, in its order; ``None`` if one is
    malformed."""
    found = [_entry(kv) for kv in _array(range_answer, "kvs")]
    return None if None in found else found


EXCLUSIVE = (0, 0)
U64_MAX = (1 << 64) - 1
_UNSIGNED = re.compile(r"\+?[0-9]+\Z")
# Unicode White_Space, as Rust's ``str::trim`` (Python's ``strip()`` also
# takes U+001C..U+001F).
_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680" + "".join(
    chr(c) for c in range(0x2000, 0x200B)) + "\u2028\u2029\u202f\u205f\u3000"


def _unsigned(text, maximum):
    if not _UNSIGNED.match(text):
        return None
    number = int(text)
    return number if number <= maximum else None


def decode(value):
    """``(owner, (limit, take))`` of an entry's value. A value that cannot
    be read (another tool wrote it, or a future format) counts as
    exclusive with no limit: it blocks while it is there and never lets
    anyone overcommit."""
    try:
        text = _base(value).decode("utf-8")
    except UnicodeDecodeError:
        return 0, EXCLUSIVE
    owner = _unsigned(text.strip(_WHITESPACE), U64_MAX)
    if owner is not None:
        return owner, EXCLUSIVE  # the owner alone, as a plain acquire writes it
    fields = text.split(" ", 3)
    owner = _unsigned(fields[0], U64_MAX)
    if len(fields) < 3:
        return owner or 0, EXCLUSIVE
    limit = _unsigned(fields[1], P.PERMITS_MAX)
    take = _unsigned(fields[2], P.PERMITS_MAX)
    if owner is not None and limit is not None and take is not None and take <= limit:
        return owner, (limit, take)
    return owner or 0, EXCLUSIVE


def decode_label(value):
    """The label of an entry's value: the rest after ``OWNER LIMIT TAKE ``
    when those three are numbers; else empty."""
    try:
        text = _base(value).decode("utf-8")
    except UnicodeDecodeError:
        return ""
    fields = text.split(" ", 3)
    if len(fields) == 4 and _unsigned(fields[0], U64_MAX) is not None \
            and _unsigned(fields[1], P.PERMITS_MAX) is not None \
            and _unsigned(fields[2], P.PERMITS_MAX) is not None:
        return fields[3]
    return ""


def _base(value):
    """The first line of a value: ``OWNER[ LIMIT TAKE[ LABEL]]``. A label
    has no newline, so what follows one is the trailer (:func:`granted_ms`)."""
    end = value.find(b"\n")
    return value if end < 0 else value[:end]


def granted_ms(value):
    """The wall-clock grant time (ms since the Unix epoch) the holder
    wrote into its entry, or ``None``. It is a trailer line after the
    value, ``\ngranted_ms=MS`` (decimal digits); the value's lines after
    the first are ``NAME=VALUE`` fields, unknown names ignored. Only a
    campaign writes it (spec §13.6; a lock does not), after its label,
    which has no newline, so an older reader still reads the owner, limit
    and take exactly (the trailer lands in what it shows as the label)."""
    for line in value.split(b"\n")[1:]:
        name, _, field = line.partition(b"=")
        if name == b"granted_ms" and re.match(rb"[0-9]{1,19}\Z", field):
            return int(field)
    return None


def claim_value(owner, limit, take, label, granted_at=None):
    """The entry's value: the owner alone for a plain exclusive claim
    without a label (as every version wrote it); else ``OWNER LIMIT
    TAKE``, then `` LABEL`` when there is one, then, for a labelled claim
    put as a grant, the grant time ``granted_at`` (seconds since the
    epoch, wall clock) as the trailer ``\ngranted_ms=MS``."""
    if not label:
        if limit == 0 and take == 0:
            return b"%d" % owner
        return b"%d %d %d" % (owner, limit, take)
    value = b"%d %d %d %s" % (owner, limit, take, label)
    if granted_at is not None:
        value += b"\ngranted_ms=%d" % max(0, int(granted_at * 1000))
    return value


def judge(own, earlier, check_limit):
    """Where an entry with slot ``own`` = ``(limit, take)`` stands, from
    ``earlier`` (the entries created before it, the latest first; all of
    them when ``check_limit``): ``("mismatch", limit)``, ``("holds",)``, or
    ``("waits", wake)`` with its wake set, earlier entries such that it
    cannot hold while all of them live (the latest first: FIFO removes
    them last, so a waiter wakes late and seldom)."""
    own_limit, own_take = own
    if check_limit and own_limit != 0:
        for entry in reversed(earlier):
            limit = decode(entry.value)[1][0]
            if limit != 0 and limit != own_limit:
                return ("mismatch", limit)
    if not earlier:
        return ("holds",)
    if own_take == 0:
        return ("waits", [earlier[0]])
    room = max(own_limit - own_take, 0)
    used = 0
    for index, entry in enumerate(earlier):
        take = decode(entry.value)[1][1]
        if take == 0:
            return ("waits", [entry])
        used += take
        if used > room:
            return ("waits", earlier[:index + 1])
    return ("holds",)


def holding(entries):
    """How many of a key's entries (create-revision order) hold: the
    longest prefix in which each fits."""
    used = 0
    for index, entry in enumerate(entries):
        limit, take = decode(entry.value)[1]
        if take == 0:
            return 1 if index == 0 else index
        used += take
        if used > limit:
            return index
    return len(entries)


def key_of(name):
    """The kunci key (bytes) an entry name ``kunci/LEN:KEY/LEASEID``
    belongs to; ``None`` for a name kunci did not write."""
    if not name.startswith(ROOT):
        return None
    rest = name[len(ROOT):]
    colon = rest.find(b":")
    if colon < 0 or not rest[:colon].isdigit():
        return None
    length = int(rest[:colon])
    key = rest[colon + 1:colon + 1 + length]
    if len(key) != length or rest[colon + 1 + length:colon + 2 + length] != b"/":
        return None
    try:
        key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return key


def _range_body(prefix, limit, order, max_create_revision):
    return {
        "key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "limit": str(limit),
        "sort_target": "CREATE", "sort_order": order,
        "max_create_revision": str(max_create_revision),
    }


def _header_revision(answer):
    revision = _int(_field(answer, "header"), "revision")
    return revision if revision else None


def _txn_ranges(answer):
    return [response["response_range"] for response in _array(answer, "responses")
            if isinstance(response, dict) and isinstance(response.get("response_range"), dict)]


def _encode(body):
    return json.dumps(body, separators=(",", ":")).encode()


#: Seconds an interrupted acquire may take to revoke its entry's lease.
WITHDRAW_WAIT = 1.0


def _attempt_until(deadline):
    return min(deadline, monotonic() + ATTEMPT_LIMIT)


def _pause_before_retry(deadline, sent):
    """Waits before the next attempt of a repeatable request, or ends it
    at ``deadline`` with the fault its attempts earned."""
    left = deadline - monotonic()
    if left <= 0:
        raise Fault(sent)
    time.sleep(min(left, RETRY_PAUSE))


def _spawn(target, name, *args):
    if exiting():
        # No thread starts while the program ends (Python 3.10 and 3.11
        # hang on one); a lease not revoked ends with its TTL.
        return False
    try:
        threading.Thread(target=target, args=args, name=name, daemon=True).start()
        return True
    except RuntimeError as error:
        log.warning("cannot start %s: %s", name, error)
        return False


class Cluster(object):
    """The client's view of one etcd cluster."""

    def __init__(self, endpoints, connect_timeout, tls=None, credentials=None, layout="kunci"):
        self.members = Members(endpoints, connect_timeout, tls, credentials)
        # ``"etcd"``: etcd's own layout (client/v3/concurrency), else kunci's.
        self.layout = layout
        # The client was closed: a watch that follows a key (``O``) ends.
        self.closed = False
        self._cursors = collections.OrderedDict()
        self._cursor_seq = 0
        self._lock = threading.Lock()

    # ------------------------------------------------------------ a call

    def run_aside(self, call):
        """As :meth:`run`, on connections and locks of its own (a fresh
        view of the same cluster, closed after): for a call made while
        this thread is inside another call of the same client (a signal
        handler), which may hold any lock of this cluster."""
        members = self.members
        aside = Cluster(members.endpoints, members.connect_timeout, members.tls,
                        members.credentials, self.layout)
        aside.members.preferred = members.preferred
        try:
            return aside.run(call)
        finally:
            aside.members.close_idle()

    def run(self, call):
        """Runs ``call`` (a ``_common.Call``) to its result tuple, setting
        ``call.sent_at`` for a grant or a renewal."""
        try:
            return self._run(call)
        except Denied as denied:
            return (DENIED, denied.reason)

    def _run(self, call):
        op = call.op
        if self.layout == "etcd":
            _check_etcd_layout(call)
        if op == "A":
            return self.acquire(call)
        if op == "R":
            return self.release(call.key, call.token, call.deadline)
        if op == "E":
            result, sent_at = self.renew(call.key, call.token, call.lease, call.deadline)
            if sent_at is not None:
                call.sent_at = sent_at
            return result
        if op == "Q":
            return self.query(call.key, call.deadline)
        if op == "O":
            return self.observe(call)
        if op == "H":
            return self.holders(call.key, call.deadline)
        if op == "L":
            return self.list(call.key, call.cursor, call.count, call.deadline)
        if op == "I":
            return self.info(call.deadline)
        if op == "P":
            return self.ping(call.deadline)
        if op == "C":
            return self.proclaim(call.key, call.token, call.label, call.deadline)
        raise InvalidArgument("unknown request %r" % op)

    def release_in_background(self, key, token):
        """Releases exactly ``token`` on a thread of its own (nobody waits
        for the outcome: a compensation or a dropped ticket)."""
        def release():
            try:
                result = self.release(key, token, monotonic() + P.TRANSPORT_DEADLINE)
            except Denied as denied:
                result = (DENIED, denied.reason)
            if result != ("R",):
                log.debug("background release of %d: %r", token, result)
        _spawn(release, "kunci-etcd-release")

    def close(self):
        """The client is closed: an ``O`` that follows a key ends within
        0.2 s (``Unavailable``; its caller sees the client closed)."""
        self.closed = True

    # ---------------------------------------------------------- layout

    def _prefix(self, key):
        """Where a key's entries live: ``kunci/LEN:KEY/``, or in etcd's
        layout ``KEY/`` (as ``concurrency.Mutex`` and ``Election``)."""
        return key + b"/" if self.layout == "etcd" else prefix_of(key)

    def _entry_name(self, prefix, lease):
        """An entry's name: the prefix and its lease id in hex (etcd's
        layout: lowercase, unpadded, as ``fmt.Sprintf("%s%x")``)."""
        return b"%s%x" % (prefix, lease) if self.layout == "etcd" else b"%s%016x" % (prefix, lease)

    def _claim(self, call, granted_at=None):
        """An acquire's value: kunci's encoding, or in etcd's layout the
        label alone (a Mutex writes ``""``, an Election its value)."""
        if self.layout == "etcd":
            return call.label or b""
        return claim_value(call.owner, call.limit, call.take, call.label, granted_at)

    def _entries(self, range_answer):
        """The entries of a range answer (:func:`_entries`); in etcd's
        layout each value is read as kunci's exclusive claim with that
        label (owner 0), the raw value kept for a move."""
        found = _entries(range_answer)
        if found is None or self.layout != "etcd":
            return found
        return [entry._replace(value=b"0 0 0 " + entry.value if entry.value else b"0",
                               raw=entry.value) for entry in found]

    # -------------------------------------------------------- requests

    def _write(self, path, body, deadline):
        """A request that changes something: sent at most once, moved to
        another member only while certainly unsent. An error answer is
        returned as such; the caller knows which are definitive."""
        try:
            sent_at, _, answer = self.members.post(path, _encode(body), deadline)
        except _Unsent:
            raise Fault(False)
        except _Unanswered:
            raise Fault(True)
        value = _parse(answer)
        if value is None:
            raise Fault(True)
        return sent_at, value

    def _read(self, path, body, deadline):
        """A request that changes nothing: tried again on any failure until
        ``deadline``."""
        data = _encode(body)
        sent = False
        while True:
            try:
                sent_at, status, answer = self.members.post(path, data, _attempt_until(deadline))
                sent = True
                value = _parse(answer) if status == 200 else None
                if value is not None:
                    return sent_at, value
                log.debug("etcd %s: status %d: %r", path, status, answer[:200])
            except _Unanswered:
                sent = True
            except _Unsent:
                pass
            _pause_before_retry(deadline, sent)

    def _revoke(self, lease, deadline):
        """Revokes a lease (removing its entries). Idempotent: a lease
        already gone counts as revoked; tried until ``deadline``."""
        data = _encode({"ID": str(lease)})
        sent = False
        while True:
            try:
                _, status, answer = self.members.post(
                    "/v3/lease/revoke", data, _attempt_until(deadline))
                if status == 200 or _int(_parse(answer), "code") == CODE_NOT_FOUND:
                    return
                sent = True
            except _Unanswered:
                sent = True
            except _Unsent:
                pass
            _pause_before_retry(deadline, sent)

    def revoke_in_background(self, lease):
        def revoke():
            try:
                self._revoke(lease, monotonic() + P.TRANSPORT_DEADLINE)
            except (Fault, Denied):
                log.warning("could not revoke etcd lease %x; it runs out by itself", lease)
        _spawn(revoke, "kunci-etcd-revoke")

    def _grant(self, lease_s, deadline):
        """``(sent_at, lease id, ttl)`` of a new lease. A grant whose answer
        is lost leaves at most a lease with nothing attached, which runs out
        by itself, so a fresh grant is asked for until ``deadline``."""
        while True:
            try:
                sent_at, value = self._write(
                    "/v3/lease/grant", {"TTL": str(lease_s)}, _attempt_until(deadline))
                lease, ttl = _int(value, "ID"), _int(value, "TTL")
                if lease and ttl is not None and ttl >= lease_s:
                    return sent_at, lease, ttl
            except Fault:
                pass
            _pause_before_retry(deadline, False)

    def _keep_alive(self, lease, deadline):
        """``(sent_at, ttl)`` of one keep-alive (the send instant of the
        attempt that was answered), ``None`` when the lease is gone. A
        keep-alive only ever makes a lease end later, so it is repeated on
        any failure until ``deadline``."""
        body = {"ID": str(lease)}
        sent = False
        while True:
            try:
                sent_at, value = self._write(
                    "/v3/lease/keepalive", body, _attempt_until(deadline))
                ttl = _int(_field(value, "result"), "TTL")
                if ttl is not None and isinstance(_field(value, "result"), dict):
                    return (sent_at, ttl) if ttl > 0 else None
                sent = True  # an error answer: no leader yet, a timeout in etcd
            except Fault as fault:
                sent = sent or fault.sent
            _pause_before_retry(deadline, sent)

    def _held_by(self, key, token, deadline):
        """The entry whose create revision is ``token``, if it holds; else
        raises ``_Ends`` with the result that ends the call."""
        if token > (1 << 63) - 1:
            raise _Ends(("N",))
        try:
            _, value = self._read(
                "/v3/kv/range", _range_body(self._prefix(key), 0, "DESCEND", token), deadline)
        except Fault as fault:
            raise _Ends(fault.result())
        found = self._entries(value)
        if found is None:
            raise _Ends(INDETERMINATE)
        if found and found[0].create_revision == token \
                and judge(decode(found[0].value)[1], found[1:], False) == ("holds",):
            return found[0]
        raise _Ends(("N",))

    # --------------------------------------------------------- acquire

    def acquire(self, call):
        """``A``, and ``S`` with permits: docs/ETCD.md, "The mapping"."""
        granted: List[Any] = []
        try:
            return self._acquire(call, granted)
        except BaseException:
            # Interrupted (KeyboardInterrupt, an exception from a signal
            # handler): the entry goes with its lease, revoked at once (for
            # at most WITHDRAW_WAIT: the program may be ending), as the
            # wait on a kunci server is withdrawn; else on a thread.
            for lease in granted:
                try:
                    self._revoke(lease, monotonic() + WITHDRAW_WAIT)
                except (Fault, Denied, OSError):
                    self.revoke_in_background(lease)
            raise

    def _acquire(self, call, granted):
        slot = (call.limit, call.take)
        plain = slot == EXCLUSIVE
        deadline = call.deadline
        try:
            set_at, lease, _ = self._grant(call.lease, deadline)
        except Fault as fault:
            return fault.result()
        granted.append(lease)
        prefix = self._prefix(call.key)
        name = self._entry_name(prefix, lease)
        put = {"request_put": {
            "key": _b64(name), "value": _b64(self._claim(call)), "lease": str(lease)}}
        # A campaign's put that is a grant (the key is free) carries the
        # grant time; a queued entry gets it when it is granted (_stamp).
        put_granted = put if not call.stamp else {"request_put": dict(
            put["request_put"], value=_b64(self._claim(call, time.time())))}
        # The entries before ours, the latest first: a plain acquire needs
        # only the latest; the rest need them all (the limit, the takes).
        earlier = {"request_range": _range_body(prefix, int(plain), "DESCEND", 0)}
        waits = call.wait_until is not None
        if waits:
            failure = [earlier, put]
        elif not plain:
            failure = [earlier]
        else:
            failure = []
        whole = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)), "target": "CREATE"}
        txn = {"compare": [dict(whole, result="EQUAL", create_revision="0")],
               "success": [put_granted], "failure": failure}
        try:
            _, answer = self._write("/v3/kv/txn", txn, deadline)
        except Fault as fault:
            self.revoke_in_background(lease)
            return fault.result()
        while True:
            revision = _header_revision(answer)
            if revision is None:
                self.revoke_in_background(lease)  # an error answer: applied or not
                return INDETERMINATE
            if answer.get("succeeded") is True:
                call.sent_at = set_at
                return ("A", revision)
            if not waits and plain:
                self.revoke_in_background(lease)
                return ("T",)
            ranges = _txn_ranges(answer)
            snapshot = self._entries(ranges[0]) if ranges else None
            if snapshot is None:
                self.revoke_in_background(lease)
                return INDETERMINATE
            verdict = judge(slot, snapshot, not plain)
            if not waits:
                # Nothing was put. Where it would fit, put it now unless an
                # entry was created since the read (entries can only have
                # gone, which never makes it fit less).
                if verdict[0] == "mismatch":
                    self.revoke_in_background(lease)
                    return _mismatch(verdict[1])
                if verdict[0] == "waits":
                    self.revoke_in_background(lease)
                    return ("T",)
                txn = {"compare": [dict(whole, result="LESS", create_revision=str(revision + 1))],
                       "success": [put_granted], "failure": [earlier]}
                try:
                    _, answer = self._write("/v3/kv/txn", txn, deadline)
                except Fault as fault:
                    self.revoke_in_background(lease)
                    return fault.result()
                continue
            # Our entry is in the queue, created at ``revision``.
            if verdict[0] == "holds":
                call.sent_at = set_at
                self._stamp(call, name, revision, lease, deadline)
                return ("A", revision)
            if verdict[0] == "mismatch":
                try:
                    self._revoke(lease, deadline)
                except Fault:
                    return INDETERMINATE
                return _mismatch(verdict[1])
            wake = [entry.name for entry in verdict[1]]
            place = (call.key, name, revision, slot)
            return self._wait_turn(call, place, (wake, revision), lease, set_at)

    def _wait_turn(self, call, place, first, lease, set_at):
        """Waits until the entry at ``place`` holds, keeping its lease
        alive meanwhile (every lease/3); at ``wait_until`` the entry is
        removed (its lease revoked): ``Timeout``."""
        deadline, wait_until, lease_s = call.deadline, call.wait_until, call.lease
        keep_every = lease_s / 3.0
        next_keep_alive = set_at + keep_every
        known = first
        while True:
            now = monotonic()
            if now >= wait_until or call.abandoned:
                return self._give_up(lease, deadline)
            if self.closed:
                # As a closed client's calls on a kunci server: the entry
                # leaves the queue (its lease revoked), nothing is held.
                given_up = self._give_up(lease, deadline)
                return given_up if given_up is INDETERMINATE else (MOVED, "the client is closed", 0)
            if now >= P.valid_until(set_at, lease_s):
                # The lease could not be kept alive: the entry may be gone.
                self.revoke_in_background(lease)
                return INDETERMINATE
            if now >= next_keep_alive:
                try:
                    kept = self._keep_alive(lease, min(wait_until, now + P.TRANSPORT_DEADLINE))
                except Fault:
                    next_keep_alive = monotonic() + RETRY_PAUSE
                    continue
                if kept is None:
                    self.revoke_in_background(lease)
                    return INDETERMINATE
                set_at = kept[0]
                next_keep_alive = set_at + keep_every
                continue
            if known is not None:
                turn, known = ("behind",) + known, None
            else:
                try:
                    turn = self._turn(place, min(wait_until, next_keep_alive))
                except Fault:
                    continue
            if turn[0] == "holder":
                # The grant's lease starts now, as on a kunci server: one
                # keep-alive if time allows; else the last one bounds it.
                try:
                    kept = self._keep_alive(lease, min(deadline, monotonic() + 1.0))
                except Fault:
                    kept = (set_at, 0)
                if kept is None:
                    self.revoke_in_background(lease)
                    return INDETERMINATE
                call.sent_at = kept[0]
                self._stamp(call, place[1], place[2], lease, deadline)
                return ("A", place[2])
            if turn[0] == "gone":
                self.revoke_in_background(lease)
                return INDETERMINATE
            self._watch_deletion(call, place, turn[1], turn[2] + 1,
                                 min(wait_until, next_keep_alive))

    def _stamp(self, call, name, revision, lease, deadline):
        """Writes the grant time into the entry of a campaign granted after
        it was queued (what ``leader``'s ``held_for`` reads): one put
        of the same value with the time, on the same lease, guarded by the
        entry's create revision and lease so that it never re-creates a
        released entry nor moves it back to a lease it left. Best effort
        (at most 1 s): without it the time is unknown, nothing else."""
        if not (call.stamp and call.label) or self.layout == "etcd":
            return  # etcd's layout stores the value alone
        value = self._claim(call, time.time())
        key = _b64(name)
        txn = {"compare": [
            {"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": str(revision)},
            {"key": key, "target": "LEASE", "result": "EQUAL", "lease": str(lease)}],
            "success": [{"request_put": {"key": key, "value": _b64(value), "lease": str(lease)}}]}
        try:
            self._write("/v3/kv/txn", txn, min(deadline, monotonic() + 1.0))
        except Fault:
            log.debug("could not write the grant time of %d", revision)

    def _turn(self, place, deadline):
        """Where the entry at ``place`` stands: one read-only transaction
        reads the entries before it (the latest only, for an exclusive
        entry) and the entry itself."""
        key, name, revision, slot = place
        exclusive = slot[1] == 0
        txn = {"success": [
            {"request_range": _range_body(self._prefix(key), int(exclusive), "DESCEND",
                                          revision - 1)},
            {"request_range": {"key": _b64(name)}}]}
        _, value = self._read("/v3/kv/txn", txn, deadline)
        seen = _header_revision(value)
        ranges = _txn_ranges(value)
        if seen is None or len(ranges) != 2:
            raise Fault(True)
        own, before = self._entries(ranges[1]), self._entries(ranges[0])
        if own is None or before is None:
            raise Fault(True)
        if not own or own[0].create_revision != revision:
            return ("gone",)
        verdict = judge(slot, before, False)
        if verdict[0] == "holds":
            return ("holder",)
        if verdict[0] == "waits":
            return ("behind", [entry.name for entry in verdict[1]], seen)
        raise Fault(True)

    def _watch_deletion(self, call, place, wake, from_revision, until):
        """Blocks until one of the ``wake`` entries is deleted at or after
        ``from_revision``, or until ``until``, or until the watch breaks
        (the caller checks again in every case). One entry is watched by its
        key; several by one watch on the key's prefix, whose other
        deletions are read and ignored."""
        if len(wake) == 1:
            request = {"key": _b64(wake[0])}
        else:
            prefix = self._prefix(place[0])
            request = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))}
        request.update(start_revision=str(from_revision), filters=["NOPUT"])

        def woken(result):
            for event in _array(result, "events"):
                deleted = _bytes(_field(event, "kv"), "key")
                if deleted is None or deleted == place[1] or deleted in wake:
                    return True
            return False
        self._watch(call, request, until, woken)

    def _give_up(self, lease, deadline):
        try:
            self._revoke(lease, deadline)
        except Fault:
            return INDETERMINATE
        return ("T",)

    # ------------------------------------------------- release & renew

    def release(self, key, token, deadline):
        """``R``: the entry is deleted only if its create revision is
        ``token``, then its lease is revoked."""
        try:
            entry = self._held_by(key, token, deadline)
        except _Ends as end:
            return end.result
        name = _b64(entry.name)
        txn = {"compare": [{"key": name, "target": "CREATE", "result": "EQUAL",
                            "create_revision": str(token)}],
               "success": [{"request_delete_range": {"key": name}}]}
        try:
            _, value = self._write("/v3/kv/txn", txn, deadline)
        except Fault as fault:
            return fault.result()
        if not isinstance(value.get("header"), dict):
            return INDETERMINATE
        if value.get("succeeded") is True:
            self.revoke_in_background(entry.lease)
            return ("R",)
        return ("N",)

    def renew(self, key, token, lease_s, deadline):
        """``E``: ``(result, sent_at)``. A keep-alive of the holder's lease
        when its length is ``lease_s``, confirmed by a read; else the entry
        moves to a new lease, guarded by its create revision."""
        try:
            entry = self._held_by(key, token, deadline)
        except _Ends as end:
            return end.result, None
        try:
            kept = self._keep_alive(entry.lease, deadline)
        except Fault as fault:
            return fault.result(), None
        if kept is None:
            return ("N",), None
        sent_at, ttl = kept
        if ttl == lease_s:
            # The entry must still be on the lease (a release deletes the
            # entry before it revokes the lease).
            try:
                _, value = self._read("/v3/kv/range", {"key": _b64(entry.name)}, deadline)
            except Fault:
                return INDETERMINATE, None
            now = self._entries(value)
            if now is None:
                return INDETERMINATE, None
            if now and now[0].create_revision == token:
                return ("E",), sent_at
            return ("N",), None
        try:
            moved_at, new_lease, new_ttl = self._grant(lease_s, deadline)
        except Fault as fault:
            return fault.result(), None
        if new_ttl == ttl:
            # etcd raised both to its minimum TTL: the keep-alive did it.
            self.revoke_in_background(new_lease)
            return ("E",), sent_at
        name = _b64(entry.name)
        txn = {"compare": [{"key": name, "target": "CREATE", "result": "EQUAL",
                            "create_revision": str(token)}],
               "success": [{"request_put": {"key": name, "value": _b64(entry.raw_value()),
                                            "lease": str(new_lease)}}]}
        try:
            _, value = self._write("/v3/kv/txn", txn, deadline)
        except Fault as fault:
            # Whether the entry moved is unknown: neither lease is revoked.
            return fault.result(), None
        if not isinstance(value.get("header"), dict):
            return INDETERMINATE, None
        if value.get("succeeded") is True:
            self.revoke_in_background(entry.lease)
            return ("E",), moved_at
        self.revoke_in_background(new_lease)
        return ("N",), None

    def proclaim(self, key, token, label, deadline):
        """``C`` (spec §13.4a): a put of the holder's own entry, guarded by
        its create revision, on its lease (``ignore_lease``), with
        ``label`` as its label: in kunci's layout the owner, limit, take
        and grant time stay; in etcd's the value is the label alone (as
        an ``Election``'s ``Proclaim``). ``N`` when ``token`` does not
        hold ``key``."""
        try:
            entry = self._held_by(key, token, deadline)
        except _Ends as end:
            return end.result
        if self.layout == "etcd":
            value = label
        else:
            fields = _base(entry.value).split(b" ", 3)
            owner, limit, take = (fields + [b"0", b"0"])[:3]
            newline = entry.value.find(b"\n")
            trailer = entry.value[newline:] if newline >= 0 else b""
            value = b"%s %s %s %s%s" % (owner, limit, take, label, trailer)
        name = _b64(entry.name)
        txn = {"compare": [{"key": name, "target": "CREATE", "result": "EQUAL",
                            "create_revision": str(token)}],
               "success": [{"request_put": {"key": name, "value": _b64(value),
                                            "ignore_lease": True}}]}
        try:
            _, answer = self._write("/v3/kv/txn", txn, deadline)
        except Fault as fault:
            return fault.result()
        if not isinstance(answer.get("header"), dict):
            return INDETERMINATE
        return ("C",) if answer.get("succeeded") is True else ("N",)

    # ----------------------------------------------------------- reads

    def _key_entries(self, key, deadline):
        """Every entry of ``key`` in create-revision order, in one read."""
        try:
            _, value = self._read(
                "/v3/kv/range", _range_body(self._prefix(key), 0, "ASCEND", 0), deadline)
        except Fault as fault:
            raise _Ends(fault.result())
        found = self._entries(value)
        if found is None:
            raise _Ends(INDETERMINATE)
        return found

    def _time_to_live(self, lease, deadline):
        """The lease's TTL in whole seconds as etcd reports it (rounded
        down; -1 when gone)."""
        _, value = self._read("/v3/kv/lease/timetolive", {"ID": str(lease)}, deadline)
        return _int(value, "TTL") or 0

    def query(self, key, deadline):
        """``Q``: the first entry (it always holds), its lease's time to
        live, and the number of entries that do not hold."""
        try:
            found = self._key_entries(key, deadline)
        except _Ends as end:
            return end.result
        if not found:
            return ("Q", KeyStatus(0, 0, 0, 0))
        first = found[0]
        try:
            ttl = self._time_to_live(first.lease, deadline)
        except Fault as fault:
            return fault.result()
        return ("Q", KeyStatus(first.create_revision, decode(first.value)[0],
                               min(max(ttl, 0) * 1000, 0xFFFFFFFF), len(found) - holding(found)))

    def observe(self, call):
        """``O`` (spec §13.1 on etcd): the key's state, whose current token
        is the create revision of its first entry (the earliest grant; 0
        when it has none), answered at once when that differs from the
        call's since or its wait is 0; else followed with an etcd watch
        (not polling) until it differs, the first entry's label changes (a
        proclaim, spec §13.4a), or the wait ends. The first entry can be
        replaced only by its own deletion (later entries come after it), so
        a held key's watch is on that entry (its deletion, and its puts: a
        proclaim), and a free key's on a put under its prefix. A watch that
        breaks or cannot be opened (an outage) only sends it back to the
        read, which is retried until the call's deadline."""
        since, wait_until = call.token, call.deadline - call.transport
        prefix = self._prefix(call.key)
        # What this watch reports a change of besides the token: the label
        # (a proclaim), and the grant time the new leader stamps into its
        # entry after its grant; as the observer last reported them.
        seen = call.seen
        label, stamped = (seen[0], seen[2]) if seen else (None, None)
        while True:
            try:
                _, value = self._read(
                    "/v3/kv/range", _range_body(prefix, 0, "ASCEND", 0), call.deadline)
            except Fault as fault:
                return fault.result()
            found, revision = self._entries(value), _header_revision(value)
            if found is None or revision is None:
                return INDETERMINATE
            state = _key_state(found)
            if label is None:
                label, stamped = state.label, state.held_ms is not None
            if (state.token != since or state.label != label
                    or (state.held_ms is not None) != stamped or monotonic() >= wait_until
                    or call.abandoned):
                return ("O", state)
            if self.closed:
                return (MOVED, "the client is closed", 0)
            if found:
                request = {"key": _b64(found[0].name)}
            else:
                request = {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                           "filters": ["NODELETE"]}
            request["start_revision"] = str(revision + 1)
            self._watch(call, request, wait_until)

    def _watch(self, call, request, until, ends=lambda result: bool(_array(result, "events"))):
        """Blocks until the watch ``request`` reports a result that
        ``ends`` (by default: any event), or until ``until``, or until the
        watch breaks, the caller gave up or the client closed (the caller
        checks again in every case)."""
        stream = self.members.open_stream("/v3/watch", _encode({"create_request": request}), until)
        if stream is None:
            time.sleep(max(0.0, min(until - monotonic(), RETRY_PAUSE)))
            return
        try:
            while True:
                try:
                    message = stream.next_message(min(until, monotonic() + _ABANDON_CHECK))
                except (OSError, EOFError, ValueError) as error:
                    log.debug("etcd watch broke: %s", error)
                    time.sleep(max(0.0, min(until - monotonic(), RETRY_PAUSE)))
                    return
                if message is None:
                    if monotonic() >= until or call.abandoned or self.closed:
                        return
                    continue
                result = _field(_parse(message), "result")
                if not isinstance(result, dict) or result.get("canceled") is True:
                    # Unreadable, an error on the stream, or cancelled: the
                    # caller reads and watches again, after a pause (a
                    # gateway that refuses every watch is no busy loop).
                    time.sleep(max(0.0, min(until - monotonic(), RETRY_PAUSE)))
                    return
                if ends(result):
                    return
        finally:
            stream.close()

    def holders(self, key, deadline):
        """``H``: the prefix that fits holds, the rest wait. A grant whose
        lease has under a second left or is gone is not listed; etcd keeps
        no wall time, so time held and wait left are 0 (unknown)."""
        try:
            found = self._key_entries(key, deadline)
        except _Ends as end:
            return end.result
        held_count = holding(found)
        held, queued = found[:held_count], found[held_count:]
        grants = []
        for entry in held[:P.HOLDERS_MAX]:
            try:
                ttl = self._time_to_live(entry.lease, deadline)
            except Fault as fault:
                return fault.result()
            if ttl <= 0:
                continue
            owner, (_, take) = decode(entry.value)
            grants.append(Grant(entry.create_revision, owner, take, float(ttl), 0.0,
                                decode_label(entry.value)))
        waiters = [Waiter(decode(entry.value)[0], decode(entry.value)[1][1], 0.0,
                          decode_label(entry.value)) for entry in queued[:P.HOLDERS_MAX]]
        left_out = max(len(held) - P.HOLDERS_MAX, 0) + max(len(queued) - P.HOLDERS_MAX, 0)
        return ("H", Holders(grants, waiters, left_out))

    def list(self, prefix_key, cursor, count, deadline):
        """``L``: one range of at most ``count`` entries under ``kunci/`` in
        key order from the cursor's place, grouped by kunci key and
        filtered by the prefix here. A key the page cut is read whole. The
        cursor is a number this client keeps for the etcd key to go on
        from."""
        if cursor == 0:
            start: Optional[bytes] = ROOT
        else:
            with self._lock:
                start = self._cursors.get(cursor)
            if start is None:
                raise InvalidArgument("unknown or forgotten listing cursor")
        body = {"key": _b64(start), "range_end": _b64(ROOT_END), "limit": str(count)}
        try:
            _, value = self._read("/v3/kv/range", body, deadline)
        except Fault as fault:
            return fault.result()
        page = self._entries(value)
        if page is None:
            return INDETERMINATE
        more = value.get("more") is True
        # The next page starts after the last entry and after every entry
        # of its kunci key.
        resume_at = (page[-1].name if page else b"") + b"\0"
        last_key = key_of(page[-1].name) if page else None
        if last_key is not None:
            resume_at = max(resume_at, prefix_end(self._prefix(last_key)))
        groups: List[Any] = []
        for entry in page:
            name = key_of(entry.name)
            if name is None:
                continue
            if groups and groups[-1][0] == name:
                groups[-1][1].append(entry)
            else:
                groups.append((name, [entry]))
        keys = []
        for index, (name, group) in enumerate(groups):
            if not name.startswith(prefix_key):
                continue
            if more and index + 1 == len(groups):
                try:
                    group = self._key_entries(name, deadline)
                except _Ends as end:
                    return end.result
            group.sort(key=lambda entry: entry.create_revision)
            if not group:
                continue
            grants = holding(group)
            limit = next((decode(entry.value)[1][0] for entry in group
                          if decode(entry.value)[1][0] != 0), 0)
            keys.append(KeyInfo(name.decode("utf-8"), grants, len(group) - grants, limit))
        next_cursor = 0
        if more:
            with self._lock:
                self._cursor_seq += 1
                next_cursor = self._cursor_seq
                self._cursors[next_cursor] = resume_at
                while len(self._cursors) > CURSORS_MAX:
                    self._cursors.popitem(last=False)
        return ("L", (keys, next_cursor))

    def info(self, deadline):
        """``I``: the answering member's status as ``name=value`` pairs."""
        try:
            _, value = self._read("/v3/maintenance/status", {}, deadline)
        except Fault as fault:
            return fault.result()
        header = _field(value, "header")
        return ("I", "backend=etcd version=%s members=%d member=%x leader=%x raft_term=%d "
                     "revision=%d db_size=%d" % (
                         value.get("version") if isinstance(value.get("version"), str) else "",
                         len(self.members.endpoints),
                         _int(header, "member_id") or 0, _int(value, "leader") or 0,
                         _int(value, "raftTerm") or 0, _int(header, "revision") or 0,
                         _int(value, "dbSize") or 0))

    def ping(self, deadline):
        """``P``: one status request's round trip."""
        try:
            sent_at, _ = self._read("/v3/maintenance/status", {}, deadline)
        except Fault as fault:
            return fault.result()
        return ("P", monotonic() - sent_at)


def cluster_for(addresses, connect_timeout, tls=None, credentials=None):
    """The :class:`Cluster` of ``addresses`` when they are etcd members
    (``resolve_servers`` never mixes them with kunci servers), else
    ``None``. ``tls``: the ``ssl.SSLContext`` for ``etcds://`` members;
    ``credentials``: ``(user, password)`` for etcd's authentication."""
    endpoints = [where for kind, where in addresses if kind in P.ETCD_KINDS]
    if not endpoints:
        return None
    layouts = set(getattr(where, "layout", "kunci") for where in endpoints)
    if len(layouts) > 1:
        raise InvalidArgument("the members of one etcd cluster have one layout: "
                              "give ?layout=etcd on every etcd:// address or on none")
    return Cluster(endpoints, connect_timeout, tls, credentials, layouts.pop())


def _check_etcd_layout(call):
    """In etcd's layout, what its recipe cannot express is refused before
    anything is sent: permits (a limit, a take, shared), listing keys (its
    keys are anywhere in etcd's key space), and the names where kunci's
    own layout keeps its entries."""
    if call.op == "A" and (call.limit or call.take):
        raise InvalidArgument(
            "etcd's layout (?layout=etcd) has exclusive locks only: no limit, take or shared")
    if call.op == "L":
        raise InvalidArgument(
            "etcd's layout (?layout=etcd) cannot list keys: its locks are anywhere in etcd's keys")
    if call.key == b"kunci" or call.key.startswith(b"kunci/"):
        # Their entries would lie among kunci's layout's (kunci/LEN:KEY/...):
        # a lock there would wait for, or be read as, the other layout's.
        raise InvalidArgument(
            "etcd's layout (?layout=etcd) refuses kunci and kunci/\u2026: kunci's own layout "
            "keeps its locks there")


def _key_state(found):
    """The ``KeyState`` of a key's entries (create-revision order): the
    first one's create revision, label and time held (from the grant time
    it stored, wall clock; ``None`` when it stored none); the lease left
    is not read (0)."""
    if not found:
        return KeyState(0, 0, 0, 0, 0, "")
    first, grants = found[0], holding(found)
    granted = granted_ms(first.value)
    held_ms = None if granted is None else max(0, int(time.time() * 1000) - granted)
    return KeyState(first.create_revision, 0, held_ms, min(grants, 0xFFFF), len(found) - grants,
                    decode_label(first.value))


class _Ends(Exception):
    """Ends a call early with ``result``."""

    def __init__(self, result):
        super().__init__()
        self.result = result


def _mismatch(limit):
    return ("X", P.ERROR_LIMIT_MISMATCH, "limit mismatch: key limit %d" % limit)
