"""``acquire(wait=None)`` (and ``math.inf``) waits as ``kunci acquire
--wait inf`` does (spec §9): queues again each time a wait runs out, waits
through an outage and a restart, ends on a capacity ``Busy``, and after
``Indeterminate`` releases its own unseen grant before asking again.
Sync and asyncio alike."""

import math
import os
import signal
import threading
import time

import pytest

import kunci
import kunci._common
from conftest import Server, in_thread, joined, request_frames, wait_for


@pytest.fixture
def short_slices(monkeypatch):
    # Each attempt queues 1 s instead of 255 s.
    monkeypatch.setattr(kunci._common, "WAIT_FOREVER_SLICE", 1.0)


@pytest.mark.parametrize("forever", [None, math.inf])
def test_wait_forever_queues_again_each_time_a_wait_runs_out(
        server, make_proxy, make_client, short_slices, forever):
    proxy = make_proxy(server.port)
    holder = kunci.Client(server.address)
    held = holder.acquire("k", lease=30)
    client = make_client(proxy.address)
    box = in_thread(client.acquire, "k", wait=forever, lease=7)
    time.sleep(2.6)
    assert "took" not in box
    held.release()
    ticket = joined(box, 2)
    assert ticket.token > held.token and ticket.lease == 7
    assert 2.6 <= box["took"] < 3.5
    acquires = [(op, header) for op, header, _ in request_frames(proxy.upstream_bytes())
                if op == b"A"]
    # Three attempts of 1 s each (the third granted), each a new owner.
    assert len(acquires) >= 3
    assert all(header[0] == 1 and header[1] == 7 for _, header in acquires)
    owners = [header[2:10] for _, header in acquires]
    assert len(set(owners)) == len(owners)
    ticket.release()
    holder.close()


def test_lock_waits_forever_too(server, make_client, short_slices):
    holder = kunci.Client(server.address)
    held = holder.acquire("k", lease=30)
    client = make_client(server.address)
    timer = threading.Timer(1.5, held.release)
    timer.start()
    with client.lock("k", wait=None, lease=5) as ticket:
        assert ticket.token > held.token
    timer.join()
    assert holder.query("k") is None
    holder.close()


def test_wait_forever_waits_through_an_outage(start_server, make_client, tmp_path):
    path = str(tmp_path / "kunci.sock")
    client = make_client("unix:" + path)
    box = in_thread(client.acquire, "k", wait=None)
    time.sleep(1.5)
    assert "took" not in box
    started = time.monotonic()
    start_server(listen=("unix:" + path,))
    ticket = joined(box, 5)
    # Pauses double from 0.1 s up to 2 s: the next attempt comes within 2 s.
    assert time.monotonic() - started < 2.5
    ticket.release()


def test_wait_forever_waits_through_a_restart(start_server, make_client, tmp_path):
    path = str(tmp_path / "kunci.sock")
    first = start_server(listen=("unix:" + path,))
    holder = kunci.Client("unix:" + path)
    held = holder.acquire("k", lease=60)
    client = make_client("unix:" + path)
    box = in_thread(client.acquire, "k", wait=None)
    assert wait_for(lambda: holder.query("k").waiters == 1, 2)
    # The server shuts down: the waiter gets B, then X 8.
    first.proc.send_signal(signal.SIGTERM)
    first.proc.wait(5)
    holder.close()
    assert "took" not in box
    start_server(listen=("unix:" + path,))
    ticket = joined(box, 5)
    assert ticket.token > 0
    ticket.release()
    del held


def test_wait_forever_ends_on_busy_at_a_capacity_limit(start_server, make_client):
    server = start_server("--max-waiters-per-key", "1")
    holder = kunci.Client(server.address)
    held = holder.acquire("k", lease=30)
    other = in_thread(kunci.Client(server.address).acquire, "k", wait=30)
    assert wait_for(lambda: holder.query("k").waiters == 1, 2)
    client = make_client(server.address)
    started = time.monotonic()
    with pytest.raises(kunci.Busy):
        client.acquire("k", wait=None)
    assert time.monotonic() - started < 1.0
    held.release()
    joined(other, 5).release()
    holder.close()


def test_wait_forever_releases_its_unseen_grant_after_indeterminate(
        server, make_proxy, make_client, short_slices):
    proxy = make_proxy(server.port)
    client = make_client(proxy.address)
    client.ping()
    proxy.down = "drop"  # the grant is made, its answer never comes
    box = in_thread(client.acquire, "k", wait=None, lease=60)
    assert wait_for(lambda: kunci.Client(server.address).query("k") is not None, 2)
    unseen = kunci.Client(server.address).query("k").token
    # The attempt ends Indeterminate at its D (1 s + 5 s); the client then
    # asks who holds the key until the server answers.
    time.sleep(6.5)
    assert "took" not in box
    proxy.down = "pass"
    ticket = joined(box, 10)
    assert ticket.token > unseen
    with kunci.Client(server.address) as observer:
        info = observer.info()
        assert info["released"] == 1 and info["held"] == 1
        assert observer.query("k").token == ticket.token
    ticket.release()


def test_invalid_input_is_refused_before_anything_is_sent(make_client):
    client = make_client("127.0.0.1:1")
    for bad in (dict(lease=0), dict(key=""), dict(limit=2, shared=True)):
        args = dict(key="k", wait=None, lease=30)
        args.update(bad)
        key = args.pop("key")
        with pytest.raises(kunci.InvalidArgument):
            client.acquire(key, **args)
    with pytest.raises(kunci.InvalidArgument):
        client.acquire("k", wait=-math.inf)
    assert os.environ.get("KUNCI_NEVER_SET") is None


def test_wait_forever_decisions(monkeypatch):
    monkeypatch.setattr(kunci._common, "RETRY_JITTER", 0.0)  # the pauses before their jitter
    # The policy alone, without I/O: pauses double from 0.1 s to 2 s, a
    # Timeout asks again at once and starts the pauses over.
    forever = kunci._common.WaitForever("k", 30)
    down = kunci.Unavailable("cannot connect to 127.0.0.1:1: refused")
    pauses = [forever.after(down, False) for _ in range(7)]
    assert pauses == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert forever.after(kunci.Timeout("timeout"), False) == 0.0
    assert forever.after(kunci.Indeterminate("?"), False) == 0.1
    assert forever.after(kunci.Busy("busy"), True) == 0.2
    # Outcomes that waiting cannot change end the call.
    assert forever.after(kunci.Busy("busy"), False) is None
    assert forever.after(kunci.PermissionDenied("no"), False) is None
    assert forever.after(kunci.LimitMismatch("limit", 3), False) is None
    untrusted = kunci.Unavailable(
        "cannot connect to tls://h:1: the server's certificate is not trusted: x")
    assert forever.after(untrusted, False) is None
    # Each attempt: the longest wire wait, the caller's lease and owner.
    call = forever.call(7, 100.0)
    assert (call.op, call.owner, call.lease, call.wait_until) == ("A", 7, 30, 100.0 + 255)
    assert call.deadline == 100.0 + 255 + kunci.TRANSPORT_DEADLINE
