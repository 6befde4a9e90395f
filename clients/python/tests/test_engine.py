"""The client's engine (``kunci._engine``), free of I/O: the courses both
clients drive, here on a scripted client (each request's result comes from
a script, the pauses are recorded, not slept), through the sync driver and
the asyncio one alike."""

import asyncio
import math
import time

import pytest

import kunci
import kunci.aio
from kunci import _common as C
from kunci import _engine as E
from kunci import _protocol as P


@pytest.fixture(autouse=True)
def no_jitter(monkeypatch):
    """The courses' pauses before their jitter (tested apart)."""
    monkeypatch.setattr(C, "RETRY_JITTER", 0.0)


class Scripted(object):
    """What a course needs of a client; ``_run`` answers each request with
    the next entry of ``script`` (a result tuple) and notes it in ``log``
    as ``op`` (``R`` and ``E`` with their token), pauses are noted, not
    slept."""

    _ticket_type = staticmethod(lambda client, key, key_bytes, token, *rest: ("ticket", token))

    def __init__(self, script, shutdowns=()):
        self.script = list(script)
        self.shutdowns_seen = list(shutdowns)
        self.log = []
        self.cleaned = []
        self.background = []
        self._closed = False
        self._transport = P.TRANSPORT_DEADLINE
        self._tickets = {}
        self._ids = C.OwnerIds()
        self._book = C.AddressBook([("tcp", ("127.0.0.1", 1))])

    def run(self, call):
        self.log.append(call.op + (" %d" % call.token if call.op in "REC" else "")
                        + (" %s" % call.label.decode() if call.op == "C" else ""))
        call.sent_at = time.monotonic()
        result = self.script.pop(0)
        if result[0] == "H" and result[1] == "own":
            # A grant of the attempt the clean-up is for (the last acquire).
            grant = C.Grant(9, self.last_owner, 0, 30.0, 0.0, "")
            result = ("H", C.Holders([grant], [], 0))
        if call.op == "A":
            self.last_owner = call.owner
        return result

    def pause(self, seconds):
        self.log.append("pause %g" % seconds)

    def shutdown_seen(self, notices):
        self.log.append("shut down?")
        return self.shutdowns_seen.pop(0)

    def _clean_up_after(self, call):
        self.cleaned.append(call.owner)

    def _release_background(self, key, token):
        self.background.append(token)


class SyncScripted(Scripted):
    def _run(self, call):
        return self.run(call)

    def _pause(self, seconds):
        self.pause(seconds)

    def _shutdown_seen(self, notices):
        return self.shutdown_seen(notices)

    def drive(self, course):
        return E.drive(course, self)


class AioScripted(Scripted):
    async def _run(self, call):
        await asyncio.sleep(0)
        return self.run(call)

    async def _pause(self, seconds):
        self.pause(seconds)

    async def _shutdown_seen(self, notices):
        return self.shutdown_seen(notices)

    def drive(self, course):
        return asyncio.run(kunci.aio.Client._drive(self, course))


FLAVOURS = [SyncScripted, AioScripted]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_wait_forever_course(flavour):
    # Indeterminate: the attempt's own grant is found and released before
    # the pause; Busy with a shutdown notice pauses longer; Timeout asks
    # again at once; the grant ends the course.
    client = flavour([("?",), ("H", "own"), ("R",), ("B",), ("T",), ("A", 42)], [True])
    ticket = client.drive(E.acquisition(client, "k", None, 30, None, None, False, None))
    assert ticket == ("ticket", 42)
    assert client.log == ["A", "H", "R 9", "pause 0.1", "A", "shut down?", "pause 0.2", "A",
                          "pause 0", "A"]
    assert client.cleaned == [] and client.background == []


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_wait_forever_ends_on_a_capacity_busy(flavour):
    client = flavour([("B",)], [False])
    with pytest.raises(kunci.Busy):
        client.drive(E.acquisition(client, "k", math.inf, 30, None, None, False, None))
    assert client.log == ["A", "shut down?"]


def test_an_acquire_that_may_end_is_one_call_and_is_cleaned_up_after_indeterminate():
    client = SyncScripted([("?",)])
    call = E.acquisition(client, "k", 1.0, 30, None, None, False, None)
    assert isinstance(call, C.Call) and call.op == "A" and call.wait_until is not None
    with pytest.raises(kunci.Indeterminate):
        E.granted(client, call, client._run(call))
    assert client.log == ["A"] and client.cleaned == [call.owner]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_observe_course_reports_changes_only(flavour):
    state = lambda token, label: C.KeyState(token, 30000, 1500, int(token > 0), 0, label)
    client = flavour([("O", state(0, "")), ("?",), ("O", state(0, "")), ("O", state(5, "a")),
                      ("O", state(5, "a")), ("O", state(7, "b"))])
    course = E.observe(client, "db")
    items = []
    if flavour is SyncScripted:
        for item in E.drive_items(course, client):
            items.append(item)
            if len(items) == 3:
                break
    else:
        async def follow():
            async for item in kunci.aio.Client._follow(client, course):
                items.append(item)
                if len(items) == 3:
                    break
        asyncio.run(follow())
    assert items == [None, kunci.Leader("a", 5, 1.5), kunci.Leader("b", 7, 1.5)]
    # The failure (Indeterminate) asked again after the first pause.
    assert client.log == ["O", "O", "pause 0.1", "O", "O", "O", "O"]


class FakeTicket(C.TicketBase):
    def _declare_lost(self, why):
        self._lost = True
        self.why = why

    def _stop_keepalive(self):
        pass


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_keepalive_round_retries_an_unknown_outcome_then_succeeds(flavour):
    client = flavour([("?",), ("?",), ("E",)])
    ticket = FakeTicket(client, "k", b"k", 3, 30, time.monotonic())
    keepalive = E.KeepAlive(ticket)
    assert keepalive.due_at() == ticket._lease_sent_at + 10.0
    assert client.drive(keepalive.round()) is True
    assert client.log == ["E 3", "pause 0.05", "E 3", "pause 0.05", "E 3"]
    assert not ticket.lost
    # The renewal moved the lease to its own send instant.
    assert ticket.valid_until == P.valid_until(ticket._lease_sent_at, 30)


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_keepalive_round_declares_the_loss_past_valid_until(flavour):
    client = flavour([("?",)])
    ticket = FakeTicket(client, "k", b"k", 3, 1, time.monotonic() - 5)
    keepalive = E.KeepAlive(ticket)
    assert client.drive(keepalive.round()) is False
    assert client.log == ["E 3"]
    assert ticket.lost and "no successful renewal before valid_until" in ticket.why
    assert keepalive.check() is None


def test_keepalive_retry_and_check_decisions():
    client = SyncScripted([])
    now = time.monotonic()
    ticket = FakeTicket(client, "k", b"k", 3, 30, now)
    keepalive = E.KeepAlive(ticket)
    assert keepalive.retry_in(kunci.Unavailable("down"), now) == E.RENEW_RETRY
    # Less than the retry pause left: the retry comes at valid_until.
    left = keepalive.retry_in(kunci.Indeterminate("?"), ticket.valid_until - 0.01)
    assert left == pytest.approx(0.01)
    assert keepalive.check() == ticket.valid_until
    assert keepalive.retry_in(kunci.NotHeld("N"), now) is None and not ticket.lost
    assert keepalive.retry_in(kunci.PermissionDenied("X 13"), now) is None
    assert ticket.lost and ticket.why.startswith("renewal failed")
    keepalive.stopped = True
    assert keepalive.check() is None


def test_lock_context_entries():
    # Each exit releases its entrant's latest entry; an exit by an entrant
    # that made no entry takes the one entry there is (entered on one task
    # and left on another).
    context = E.LockContextBase(None, (), {}, None)
    context._entered("a", 1)
    context._entered("b", 2)
    context._entered("a", 3)
    assert context._leaving("a") == 3
    assert context._leaving("b") == 2
    assert context._leaving("c") == 1
    assert context._entries == {}
    # With no entry, or entries of several others, an exit cannot be told
    # apart: it is refused and releases nobody's.
    with pytest.raises(RuntimeError, match="not entered by the thread or task"):
        context._leaving("a")
    context._entered("a", 4)
    context._entered("b", 5)
    with pytest.raises(RuntimeError, match="not entered by the thread or task"):
        context._leaving("c")
    assert context._entries == {"a": [4], "b": [5]}


def test_retry_pauses_are_jittered_by_a_quarter(monkeypatch):
    monkeypatch.undo()  # with the jitter
    forever = C.WaitForever("k", 30)
    follow = C.Follow("k")
    firsts = [C.WaitForever("k", 30).after(kunci.Unavailable("down"), False) for _ in range(200)]
    firsts += [C.Follow("k").failed(kunci.Unavailable("down")) for _ in range(200)]
    assert all(0.075 <= pause <= 0.125 for pause in firsts)
    assert len(set(firsts)) > 100  # not one instant for every client
    assert min(firsts) < 0.085 and max(firsts) > 0.115
    capped = [forever.after(kunci.Unavailable("down"), False) for _ in range(12)][6:]
    capped += [follow.failed(kunci.Unavailable("down")) for _ in range(12)][6:]
    assert all(1.5 <= pause <= 2.5 for pause in capped)


def test_a_bounded_campaign_wait_ends_with_its_last_outcome(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(C.time, "monotonic", lambda: now[0])
    forever = C.WaitForever("k", 30, wait=3)
    assert forever.call(1, 100.0).wait_until == 103.0
    assert forever.after(kunci.Timeout("held"), False) == 0.0
    now[0] = 102.95
    assert forever.call(2, 102.95).wait_until == 103.0  # what is left, not 255 s
    assert forever.after(kunci.Unavailable("down"), False) == pytest.approx(0.05)
    now[0] = 103.0
    assert forever.after(kunci.Timeout("held"), False) is None


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_renewal_after_an_outage_proclaims_the_label_again(flavour):
    # The renewal that comes through after an outage may have adopted the
    # grant on a restarted server, which keeps no label (spec §7.5).
    adopted = C.KeyState(3, 30000, 0, 1, 0, "")
    client = flavour([("?",), ("E",), ("O", adopted), ("C",)])
    ticket = FakeTicket(client, "k", b"k", 3, 30, time.monotonic(), 0, 0, b"host-a")
    assert client.drive(E.KeepAlive(ticket).round()) is True
    assert client.log == ["E 3", "pause 0.05", "E 3", "O", "C 3 host-a"]
    # The label kept (a clean restart), or another grant: no C, which a
    # server without it would answer by ending the connection.
    for state in (adopted._replace(label="host-a"), adopted._replace(token=4)):
        client = flavour([("?",), ("E",), ("O", state)])
        ticket = FakeTicket(client, "k", b"k", 3, 30, time.monotonic(), 0, 0, b"host-a")
        assert client.drive(E.KeepAlive(ticket).round()) is True
        assert client.log == ["E 3", "pause 0.05", "E 3", "O"]
    # Without an outage, or without a label, nothing is proclaimed.
    client = flavour([("E",)])
    ticket = FakeTicket(client, "k", b"k", 3, 30, time.monotonic(), 0, 0, b"host-a")
    assert client.drive(E.KeepAlive(ticket).round()) is True
    assert client.log == ["E 3"]
    client = flavour([("?",), ("E",)])
    ticket = FakeTicket(client, "k", b"k", 3, 30, time.monotonic())
    assert client.drive(E.KeepAlive(ticket).round()) is True
    assert client.log == ["E 3", "pause 0.05", "E 3"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_a_renewal_after_a_reconnect_looks_for_its_label(flavour):
    # The renewal went through at once, but on a new connection: the
    # server may have restarted (and adopted the grant without its label).
    adopted = C.KeyState(3, 30000, 0, 1, 0, "")
    client = flavour([("E",), ("O", adopted), ("C",)])
    ticket = FakeTicket(client, "k", b"k", 3, 30, time.monotonic(), 0, 0, b"host-a")
    keepalive = E.KeepAlive(ticket)
    client._book.ended += 1  # a session of the client ended
    assert client.drive(keepalive.round()) is True
    assert client.log == ["E 3", "O", "C 3 host-a"]
    client.script = [("E",)]
    assert client.drive(keepalive.round()) is True  # no news: no read
    assert client.log == ["E 3", "O", "C 3 host-a", "E 3"]
