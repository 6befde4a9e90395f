"""Leader election on a kunci server (spec §13): the ``O``/``V`` codec byte
for byte, ``campaign``, ``leader`` and ``observe`` in the sync and asyncio
clients, and what a follower sees on a resignation, a lease's end and a
clean restart."""

import asyncio
import signal
import subprocess
import struct
import threading
import time

import pytest

import kunci
import kunci._common as C
import kunci._protocol as P
from conftest import free_port, in_thread, joined, kunci_bin, wait_for


# ---------------------------------------------------------------- the codec

def test_observe_request_is_encoded_byte_for_byte():
    frame = P.encode_observe(255, 0x0102030405060708, 0x1112131415161718, b"db-primary")
    assert frame == (b"O\xff" + bytes(range(1, 9)) + bytes(range(0x11, 0x19))
                     + b"db-primary\n")
    assert len(frame) == 1 + 17 + len(b"db-primary") + 1
    assert P.encode_observe(0, 1, 0, b"k") == (b"O\x00" + b"\x00" * 7 + b"\x01" + b"\x00" * 8
                                               + b"k\n")


def _v(ident, token, lease_ms, held_ms, grants, waiters, label):
    return b"V" + struct.pack(">QQIIHI", ident, token, lease_ms, held_ms, grants,
                              waiters) + label + b"\n"


def test_v_answer_is_decoded_byte_for_byte():
    frame = (b"V" + bytes(range(1, 9)) + b"\x00" * 7 + b"\x2a" + b"\x00\x00\x75\x30"
             + b"\x00\x00\x03\xe8" + b"\x00\x02" + b"\x00\x00\x00\x05" + b"host-a:5432\n")
    assert frame == _v(0x0102030405060708, 42, 30000, 1000, 2, 5, b"host-a:5432")
    buf = bytearray(frame + _v(7, 0, 0, 0, 0, 0, b""))
    assert P.decode_frames(buf) == [
        ("V", 0x0102030405060708, 42, 30000, 1000, 2, 5, "host-a:5432"),
        ("V", 7, 0, 0, 0, 0, 0, ""),
    ]
    assert buf == b""


def test_v_answer_split_anywhere_waits_for_the_rest():
    frame = _v(9, 3, 1, 2, 1, 0, "é".encode("utf-8"))
    for cut in range(len(frame)):
        buf = bytearray(frame[:cut])
        assert P.decode_frames(buf) == []
        buf += frame[cut:]
        assert P.decode_frames(buf) == [("V", 9, 3, 1, 2, 1, 0, "é")]


def test_x14_is_not_fatal_and_is_busy():
    assert P.ERROR_TOO_MANY_WATCHES in P.NON_FATAL_ERRORS
    assert P.ERROR_TEXT[14] == "too many watches"
    call = C.observe_call("k", 5, 255, 77, 100.0)
    with pytest.raises(kunci.Busy, match="X 14"):
        C.raise_for(call, ("X", 14, "too many watches"))
    assert call.error_id() == 77


def test_observe_call_deadline_and_correlation():
    call = C.observe_call("k", 5, 255, 77, 100.0)
    assert call.deadline == 100.0 + 255 + P.TRANSPORT_DEADLINE
    assert call.encode(100.0) == P.encode_observe(255, 77, 5, b"k")
    read = C.observe_call("k", 0, 0, 78, 100.0)
    assert read.deadline == 100.0 + P.TRANSPORT_DEADLINE
    pending = C.Pending()
    pending.add(call)
    pending.add(read)
    # Answers are matched by id, in any order.
    assert pending.correlate(("V", 78, 0, 0, 0, 0, 0, "")) is read
    assert pending.correlate(("X", 14, 77, "too many watches")) is call


def test_follow_decisions(monkeypatch):
    monkeypatch.setattr(C, "RETRY_JITTER", 0.0)  # the pauses before their jitter
    follow = C.Follow("e")
    first = follow.call(1, 0.0)
    assert (first.wait_s, first.token) == (0, 0)
    state = C.KeyState(10, 900, 100, 1, 0, "a")
    assert follow.answered(state) == kunci.Leader("a", 10, 0.1)
    again = follow.call(2, 0.0)
    assert (again.wait_s, again.token) == (255, 10)
    # Unchanged (a wait's end, a restart): nothing reported.
    assert follow.answered(C.KeyState(10, 500, 500, 1, 0, "a")) is C.Follow.NOTHING
    # An older term is never reported.
    assert follow.answered(C.KeyState(9, 500, 500, 1, 0, "b")) is C.Follow.NOTHING
    assert follow.answered(C.KeyState(0, 0, 0, 0, 0, "")) is None
    assert follow.answered(C.KeyState(0, 0, 0, 0, 0, "")) is C.Follow.NOTHING
    assert follow.answered(C.KeyState(11, 500, 0, 1, 0, "b")) == kunci.Leader("b", 11, 0.0)
    pauses = [follow.failed(kunci.Unavailable("down")) for _ in range(7)]
    assert pauses == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    follow.answered(C.KeyState(11, 500, 0, 1, 0, "b"))
    assert follow.failed(kunci.Busy("X 14")) == 0.1
    for error in (kunci.InvalidArgument("x"), kunci.PermissionDenied("y")):
        with pytest.raises(type(error)):
            follow.failed(error)


# ------------------------------------------------- both clients, one API

def sync_client(address):
    client = kunci.Client(address)
    client.flavour = "sync"
    return client


def campaign(client, name, value, lease=30):
    if client.flavour == "sync":
        return client.campaign(name, value, lease=lease)
    inner = client.client

    async def run():
        return await inner.campaign(name, value, lease=lease)
    return C_AioTicket(client, client._runner.run(run()))


class C_AioTicket(object):
    def __init__(self, client, ticket):
        self._client = client
        self.ticket = ticket

    def __getattr__(self, name):
        return getattr(self.ticket, name)

    def release(self):
        return self._client._runner.run(self.ticket.release())


class Follower(object):
    """Runs ``observe(name)`` in the background; ``items`` gets each item
    with the monotonic time it came."""

    def __init__(self, client, name):
        self.items = []
        self.error = None
        if client.flavour == "sync":
            iterator = client.observe(name)

            def run():
                try:
                    for item in iterator:
                        self.items.append((time.monotonic(), item))
                except Exception as error:
                    self.error = error
            threading.Thread(target=run, daemon=True).start()
        else:
            iterator = client.client.observe(name)

            async def run():
                try:
                    async for item in iterator:
                        self.items.append((time.monotonic(), item))
                except Exception as error:
                    self.error = error
            task = asyncio.run_coroutine_threadsafe(run(), client._runner.loop)
            close = client.close

            def stop_then_close():
                # Ends the follow before the test's loop ends under it.
                task.cancel()
                try:
                    task.result(2)
                except BaseException:  # noqa: B902 (cancelled)
                    pass
                close()
            client.close = stop_then_close

    def leaders(self):
        return [item for _, item in self.items]

    def wait_count(self, count, timeout=5):
        assert wait_for(lambda: len(self.items) >= count, timeout), (self.items, self.error)
        return self.items[count - 1]


# -------------------------------------------------------- on a real server

def test_leader_none_then_the_campaigner(server, make_client):
    client = make_client(server.address)
    assert client.leader("db") is None
    ticket = campaign(client, "db", "host-a:5432", lease=10)
    time.sleep(0.3)
    leader = client.leader("db")
    assert leader.value == "host-a:5432"
    assert leader.term == ticket.token > 0
    assert isinstance(leader.held_for, float)
    assert 0.29 <= leader.held_for < 3.0  # the server's clock ticks in ms
    ticket.release()
    assert client.leader("db") is None


def test_campaign_blocks_until_the_leader_resigns(server, make_client):
    first = make_client(server.address)
    second = make_client(server.address)
    leading = campaign(first, "svc", "a")
    box = in_thread(campaign, second, "svc", "b")
    time.sleep(1.0)
    assert "at" not in box
    assert first.leader("svc").value == "a"
    resigned = time.monotonic()
    leading.release()
    follower = joined(box, 5)
    assert box["at"] - resigned < 1.0
    assert follower.token > leading.token
    now = first.leader("svc")
    assert (now.value, now.term) == ("b", follower.token)
    follower.release()


def test_campaign_keeps_its_lease_alive(server, make_client):
    client = make_client(server.address)
    ticket = campaign(client, "svc", "a", lease=1)
    time.sleep(2.5)
    assert client.leader("svc").term == ticket.token
    assert not ticket.lost
    ticket.release()


def test_sync_campaign_resigns_at_the_end_of_its_with_block(server):
    with kunci.Client(server.address) as client:
        with client.campaign("svc", "a") as ticket:
            assert client.leader("svc").term == ticket.token
        assert client.leader("svc") is None


def test_aio_campaign_as_async_with_and_await(server):
    async def main():
        async with kunci.aio.Client(server.address) as client:
            async with client.campaign("svc", "a") as ticket:
                assert (await client.leader("svc")).term == ticket.token
            assert await client.leader("svc") is None
            ticket = await client.campaign("svc", "b")
            assert (await client.leader("svc")).value == "b"
            await ticket.release()
            assert await client.leader("svc") is None
    asyncio.run(main())


@pytest.mark.parametrize("value", ["", "x" * 129, "a\nb", b"\xff", 5])
def test_invalid_value_is_refused_before_anything_is_sent(make_client, value):
    client = make_client("127.0.0.1:%d" % free_port())
    started = time.monotonic()
    with pytest.raises(kunci.InvalidArgument):
        campaign(client, "svc", value)
    assert time.monotonic() - started < 0.5


def test_a_value_of_128_bytes_is_accepted(server, make_client):
    client = make_client(server.address)
    ticket = campaign(client, "svc", "é" * 64)
    assert client.leader("svc").value == "é" * 64
    ticket.release()


def test_observe_sees_the_takeover_when_the_leader_resigns(server, make_client):
    client = make_client(server.address)
    other = make_client(server.address)
    follower = Follower(client, "svc")
    assert follower.wait_count(1)[1] is None
    first = campaign(other, "svc", "a")
    follower.wait_count(2)
    second = in_thread(campaign, sync_client(server.address), "svc", "b")
    assert wait_for(lambda: other.query("svc").waiters == 1, 3)
    resigned = time.monotonic()
    first.release()
    at, item = follower.wait_count(3)
    assert at - resigned < 1.0
    won = joined(second, 5)
    seen = follower.leaders()
    assert seen == [None, kunci.Leader("a", first.token, seen[1].held_for),
                    kunci.Leader("b", won.token, item.held_for)]
    assert won.token > first.token
    won.release()
    assert follower.wait_count(4)[1] is None
    time.sleep(0.3)
    assert len(follower.items) == 4 and follower.error is None


def test_observe_sees_the_lease_end_of_a_dead_leader(server, make_client):
    client = make_client(server.address)
    follower = Follower(client, "svc")
    assert follower.wait_count(1)[1] is None
    # A leader whose host died: nobody renews its lease of 1 s.
    dead = kunci.Client(server.address)
    granted = time.monotonic()
    held = dead.acquire("svc", lease=1, label="a")
    held.detach()
    assert follower.wait_count(2)[1].term == held.token
    at, item = follower.wait_count(3)
    assert item is None
    assert 1.0 <= at - granted < 3.0  # never before the lease's end
    dead.close()


def test_observe_goes_from_a_dead_leader_straight_to_the_next(server, make_client):
    client = make_client(server.address)
    dead = kunci.Client(server.address)
    granted = time.monotonic()
    held = dead.acquire("svc", lease=1, label="a")
    held.detach()
    follower = Follower(client, "svc")
    assert follower.wait_count(1)[1].value == "a"
    box = in_thread(campaign, sync_client(server.address), "svc", "b")
    at, item = follower.wait_count(2)
    assert item.value == "b" and item.term > held.token
    assert at - granted >= 1.0
    joined(box, 5).release()
    assert follower.wait_count(3)[1] is None
    assert [i is None for i in follower.leaders()] == [False, False, True]
    dead.close()


def test_observe_through_a_clean_restart_reports_nothing_spurious(
        start_server, make_client, tmp_path):
    path = str(tmp_path / "kunci.sock")
    state = str(tmp_path / "state")
    first = start_server("--state-dir", state, listen=("unix:" + path,))
    leader_client = make_client("unix:" + path)
    ticket = campaign(leader_client, "svc", "a", lease=10)
    follower = Follower(make_client("unix:" + path), "svc")
    assert follower.wait_count(1)[1].value == "a"
    time.sleep(0.2)
    first.proc.send_signal(signal.SIGTERM)
    assert first.proc.wait(5) == 0
    time.sleep(0.5)
    start_server("--state-dir", state, listen=("unix:" + path,))
    # The follower is back and waiting: the same leader is not news.
    time.sleep(3.0)
    assert len(follower.items) == 1 and follower.error is None
    assert leader_client.leader("svc").term == ticket.token
    resigned = time.monotonic()
    ticket.release()
    at, item = follower.wait_count(2)
    assert item is None
    assert at - resigned < 1.5
    assert follower.error is None


def test_observe_through_an_outage(start_server, make_client, tmp_path):
    path = str(tmp_path / "kunci.sock")
    first = start_server(listen=("unix:" + path,))
    follower = Follower(make_client("unix:" + path), "svc")
    assert follower.wait_count(1)[1] is None
    first.proc.kill()
    first.proc.wait(5)
    time.sleep(2.5)
    assert len(follower.items) == 1 and follower.error is None
    start_server(listen=("unix:" + path,))
    ticket = campaign(make_client("unix:" + path), "svc", "a")
    # The follower's pause is at most 2 s.
    at, item = follower.wait_count(2, timeout=4)
    assert item.term == ticket.token
    ticket.release()


def test_x14_ends_one_observe_busy_and_observe_retries_quietly(start_server, make_client):
    server = start_server("--max-watches", "1")
    watcher = make_client(server.address)
    holding = Follower(watcher, "first")
    assert holding.wait_count(1)[1] is None
    assert wait_for(lambda: server.info().get("watches") == 1, 3)
    client = make_client(server.address)
    # One O that would be held over --max-watches: X 14, Busy, nothing held.
    if client.flavour == "sync":
        call = C.observe_call("second", 0, 255, 99, time.monotonic())
        with pytest.raises(kunci.Busy, match="X 14"):
            C.outcome_of(call, client._run(call))
    # The session is still good.
    assert client.leader("second") is None
    follower = Follower(client, "second")
    assert follower.wait_count(1)[1] is None
    time.sleep(0.5)
    assert len(follower.items) == 1 and follower.error is None
    ticket = campaign(make_client(server.address), "second", "b")
    # Refused watches, but a changed token is answered at once: seen
    # within the capped pause.
    at, item = follower.wait_count(2, timeout=4)
    assert item.value == "b"
    ticket.release()


def test_observe_raises_permission_denied(start_server, make_client, tmp_path):
    lines = subprocess.check_output([kunci_bin(), "secret", "team", "lock:team/"]).decode()
    secret, line = lines.splitlines()
    auth = tmp_path / "auth"
    auth.write_text(line + "\n")
    server = start_server("--auth", str(auth))
    client = make_client(server.address, secret=secret)
    with pytest.raises(kunci.PermissionDenied):
        client.leader("svc")
    follower = Follower(client, "svc")
    assert wait_for(lambda: follower.error is not None, 3)
    assert isinstance(follower.error, kunci.PermissionDenied)
    assert follower.items == []


def test_invalid_name_is_refused_at_once(make_client):
    client = make_client("127.0.0.1:%d" % free_port())
    with pytest.raises(kunci.InvalidArgument):
        client.leader("")
    observe = client.observe if client.flavour == "sync" else client.client.observe
    with pytest.raises(kunci.InvalidArgument):
        observe("a\nb")


def test_campaign_on_etcd_blocks_until_the_leader_resigns(etcd_cluster, make_client):
    # campaign is an acquire with wait=None and a label: etcd has it already.
    first = make_client(etcd_cluster.address)
    second = make_client(etcd_cluster.address)
    name = "svc-%s" % first.flavour
    leading = campaign(first, name, "a", lease=2)
    box = in_thread(campaign, second, name, "b", lease=2)
    time.sleep(3.0)  # longer than the lease: the keep-alive holds it
    assert "at" not in box
    grants = first.holders(name).grants
    assert [(g.token, g.label) for g in grants] == [(leading.token, "a")]
    resigned = time.monotonic()
    leading.release()
    follower = joined(box, 5)
    assert box["at"] - resigned < 1.5
    assert follower.token > leading.token
    assert [g.label for g in first.holders(name).grants] == ["b"]
    follower.release()
    with pytest.raises(kunci.InvalidArgument):
        campaign(first, name, "x" * 129)
