"""Calls that fail or are interrupted (issue 37): a release that sent
nothing leaves its ticket as it was, ``close()`` at any moment leaks no
grant past the program's end, ``close()`` from a signal handler ends the
call it interrupted, a cancelled asyncio acquire never swallows its
cancellation, and each client's ``transport_timeout``."""

import asyncio
import os
import pickle
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import kunci
import kunci._protocol
import kunci.aio
from conftest import PACKAGE_ROOT, in_thread, joined, wait_for
from test_exit import oldest_and_newest


def unix_server(start_server, tmp_path, *args):
    """A server on a unix socket (the same address after a restart) that
    keeps its state in ``tmp_path/state``; and how to start it again."""
    path = str(tmp_path / "kunci.sock")
    state = str(tmp_path / "state")

    def start():
        return start_server("--state-dir", state, *args, listen=("unix:" + path,))
    return start(), start, "unix:" + path


def stop(server):
    """A clean stop: the server saves every held grant in its state dir."""
    server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(10) == 0


# ------------------------------------------------- 1. a release that sent nothing

def test_a_release_that_reached_no_server_leaves_the_ticket_as_it_was(
        start_server, make_client, tmp_path, monkeypatch):
    server, restart, address = unix_server(start_server, tmp_path)
    monkeypatch.setattr(kunci._protocol, "TRANSPORT_DEADLINE", 0.5)
    client = make_client(address)
    ticket = client.acquire("sent-nothing", lease=60)
    stop(server)
    with pytest.raises(kunci.Unavailable):
        ticket.release()
    assert not ticket.released and ticket.is_valid()
    ticket.check()
    restart()  # the grant is restored from the state dir
    observer = kunci.Client(address)
    assert observer.query("sent-nothing").token == ticket.token
    ticket.release()  # not LockLost "released already": the R goes out now
    assert ticket.released
    assert observer.query("sent-nothing") is None
    with pytest.raises(kunci.LockLost, match="released already"):
        ticket.release()
    observer.close()


def test_a_release_on_a_closed_client_leaves_the_ticket_to_the_flush_at_exit(
        server, make_client):
    client = make_client(server.address)
    ticket = client.acquire("closed-under", lease=60)
    client.close()
    with pytest.raises(kunci.Error, match="closed") as raised:
        ticket.release()
    assert type(raised.value) is kunci.Error
    assert not ticket.released and ticket.is_valid()
    # The flush at the program's end still finds and releases it.
    from kunci._sync import flush_client
    inner = getattr(client, "client", client)
    flush_client(inner, time.monotonic() + 1.0)
    with kunci.Client(server.address) as observer:
        assert observer.query("closed-under") is None


def test_an_indeterminate_release_may_be_released_again(
        server, make_client, make_proxy, monkeypatch):
    proxy = make_proxy(server.port)
    monkeypatch.setattr(kunci._protocol, "TRANSPORT_DEADLINE", 0.5)
    client = make_client(proxy.address)
    ticket = client.acquire("unsure", lease=60)
    proxy.down = "drop"  # the R is executed, its answer never comes
    with pytest.raises(kunci.Indeterminate) as raised:
        ticket.release()
    assert not ticket.released and not ticket.is_valid()
    assert str(raised.value).startswith(
        "indeterminate: the release of 'unsure' (token %d) may have reached the server, but "
        "no answer by the deadline" % ticket.token)
    with pytest.raises(kunci.LockLost, match="may be released"):
        ticket.check()
    proxy.down = "pass"
    # Again: the server answers N, as its first R released it.
    with pytest.raises(kunci.NotHeld):
        ticket.release()
    assert ticket.released
    with kunci.Client(server.address) as observer:
        assert observer.query("unsure") is None


def test_a_release_cancelled_before_its_write_leaves_the_ticket_as_it_was(
        start_server, tmp_path):
    server, restart, address = unix_server(start_server, tmp_path)

    async def main():
        client = kunci.aio.Client(address)
        ticket = await client.acquire("cancelled-release", lease=60)
        stop(server)
        await asyncio.sleep(0.2)  # the client sees its connection end
        # Cancelled while it looks for a server: its R reached no transport.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(ticket.release(), 0.3)
        assert not ticket.released and ticket.is_valid()
        restart()
        await ticket.release()
        assert ticket.released
        assert await client.query("cancelled-release") is None
        await client.close()
    asyncio.run(main())


# ---------------------------------------------- 2. close() racing calls, then exit

CLOSE_RACE = """
import random, sys, threading, time
sys.path.insert(0, %(root)r)
import kunci
random.seed(%(seed)d)
client = kunci.Client(%(address)r)
KEYS = ["race/%(seed)d/a", "race/%(seed)d/b", "race/%(seed)d/c"]

def work(index):
    n = index
    while True:
        try:
            ticket = client.acquire(KEYS[n %% 3], wait=2, lease=60)
            ticket.release()
        except kunci.Error:
            return
        n += 1

threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
for thread in threads:
    thread.start()
time.sleep(random.uniform(0.01, 0.2))
client.close()
for thread in threads:
    thread.join()
print("done", flush=True)
"""

CLOSE_RACE_AIO = """
import asyncio, random, sys, time
sys.path.insert(0, %(root)r)
import kunci, kunci.aio
random.seed(%(seed)d)
KEYS = ["race/%(seed)d/a", "race/%(seed)d/b", "race/%(seed)d/c"]

async def work(client, index):
    n = index
    while True:
        try:
            ticket = await client.acquire(KEYS[n %% 3], wait=2, lease=60)
            await ticket.release()
        except kunci.Error:
            return
        n += 1

async def main():
    client = kunci.aio.Client(%(address)r)
    tasks = [asyncio.ensure_future(work(client, i)) for i in range(4)]
    await asyncio.sleep(random.uniform(0.01, 0.2))
    await client.close()
    await asyncio.gather(*tasks, return_exceptions=True)

asyncio.run(main())
print("done", flush=True)
"""


@pytest.mark.parametrize("script", [CLOSE_RACE, CLOSE_RACE_AIO], ids=["sync", "aio"])
def test_close_racing_calls_leaves_no_grant_after_the_program_ends(server, script):
    observer = kunci.Client(server.address)
    run = 0
    for python in oldest_and_newest():
        for _ in range(6):
            run += 1
            source = script % {"root": PACKAGE_ROOT, "address": server.address, "seed": run}
            done = subprocess.run([python, "-c", source], capture_output=True, timeout=60)
            assert done.stdout == b"done\n", done.stderr.decode()
            held = [key for key in ("a", "b", "c")
                    if observer.query("race/%d/%s" % (run, key)) is not None]
            # Leases are 60 s: only a release frees a key this soon.
            assert held == [], (python, run, done.stderr.decode())
    observer.close()


def test_an_indeterminate_acquire_on_a_closed_client_is_cleaned_up_at_exit(server, make_proxy):
    # Rule 11's clean-up after an acquire that close() cut short: the
    # client is closed, so only the flush at exit can look for the grant.
    script = textwrap.dedent("""
        import sys, threading
        sys.path.insert(0, %(root)r)
        import kunci
        client = kunci.Client(%(address)r)
        def close_when_told():
            sys.stdin.readline()
            client.close()
        threading.Thread(target=close_when_told).start()
        try:
            client.acquire("cut-short", wait=5, lease=60)
        except kunci.Indeterminate as error:
            print("indeterminate:", error, flush=True)
        """)
    observer = kunci.Client(server.address)
    for python in oldest_and_newest():
        proxy = make_proxy(server.port)
        proxy.down = "drop"  # the grant is made, its answer never comes
        child = subprocess.Popen(
            [python, "-c", script % {"root": PACKAGE_ROOT, "address": proxy.address}],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: observer.query("cut-short") is not None, 5)
            # The grant's answer (A owner token, 18 bytes) is thrown away
            # before the proxy passes answers again.
            wait_for(lambda: proxy.dropped_down >= 18, 5)
            proxy.down = "pass"
            out, err = child.communicate(b"close\n", timeout=30)
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        assert observer.query("cut-short") is None, err.decode()
        assert out.decode().startswith(
            "indeterminate: indeterminate: the acquire of 'cut-short' may have reached the "
            "server, but the client was closed"), (out, err)
    observer.close()


# ------------------------------------------------ 3. close() from a signal handler

SIGNAL_CLOSE = """
import signal, sys, time
sys.path.insert(0, %(root)r)
import kunci
client = kunci.Client(%(address)r)
signal.signal(signal.SIGTERM, lambda *_: client.close())
print("waiting", flush=True)
start = time.monotonic()
try:
    client.acquire("signalled", wait=8)
    print("granted", flush=True)
except kunci.Error as error:
    print("%%.3f %%s: %%s" %% (time.monotonic() - start, type(error).__name__, error), flush=True)
"""


def test_close_from_a_signal_handler_ends_the_call_it_interrupted(server):
    holder = kunci.Client(server.address)
    ticket = holder.acquire("signalled", lease=60)
    for python in oldest_and_newest():
        child = subprocess.Popen(
            [python, "-c", SIGNAL_CLOSE % {"root": PACKAGE_ROOT, "address": server.address}],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert child.stdout.readline() == b"waiting\n"
            wait_for(lambda: holder.holders("signalled").waiters, 5)
            time.sleep(0.2)
            child.send_signal(signal.SIGTERM)
            line = child.stdout.readline().decode()
            assert child.wait(10) == 0
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
        took, rest = line.split(" ", 1)
        assert 0.2 <= float(took) < 1.5, (line, child.stderr.read().decode())
        assert rest.startswith("Indeterminate: indeterminate: the acquire of 'signalled' may "
                               "have reached the server, but the client was closed"), line
        assert holder.holders("signalled").waiters == []
    ticket.release()
    holder.close()


# --------------------------------------- 4. a cancelled acquire stays cancelled

def test_cancelled_acquires_never_swallow_their_cancellation(server):
    holder = kunci.Client(server.address)
    ticket = holder.acquire("cancelled", lease=255)

    async def main():
        client = kunci.aio.Client(server.address)
        slowest = 0.0
        outcomes = set()
        for _ in range(4100):
            start = time.monotonic()
            try:
                # The outer bound only keeps a failing run short.
                await asyncio.wait_for(
                    asyncio.wait_for(client.acquire("cancelled", wait=60), 0.001), 5)
                outcomes.add("granted")
            except asyncio.TimeoutError:
                outcomes.add("timed out")
            slowest = max(slowest, time.monotonic() - start)
        await client.close()
        return slowest, outcomes
    slowest, outcomes = asyncio.run(main())
    assert outcomes == {"timed out"}
    assert slowest < 1.0, slowest
    # Every cancelled wait was withdrawn: nobody queues for the key.
    wait_for(lambda: holder.holders("cancelled").waiters == [], 10)
    ticket.release()
    holder.close()


# ------------------------------------------------------- 7. transport_timeout

@pytest.fixture
def hung_server():
    """A port whose connections are accepted (by the kernel) and never
    answered."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    yield "127.0.0.1:%d" % listener.getsockname()[1]
    listener.close()


def test_transport_timeout_bounds_each_call_past_its_wait(make_client, hung_server):
    # A client per call: an acquire's clean-up (rule 11) would share the
    # next call's connection, which its own deadline closes.
    for call, args, took in (("query", ("k",), 0.5), ("ping", (), 0.5),
                             ("acquire", ("k",), 0.5), ("acquire", ("k", 0.3), 0.8)):
        client = make_client(hung_server, transport_timeout=0.5)
        start = time.monotonic()
        with pytest.raises(kunci.Indeterminate, match="no answer by the deadline"):
            getattr(client, call)(*args)
        assert took <= time.monotonic() - start < took + 1, (call, args)


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "5", True, 3601])
def test_transport_timeout_is_checked(bad):
    with pytest.raises(kunci.InvalidArgument, match="transport_timeout"):
        kunci.Client(transport_timeout=bad)
    with pytest.raises(kunci.InvalidArgument, match="transport_timeout"):
        kunci.aio.Client(transport_timeout=bad)


# ------------------------------------------------------------ 6. smaller items

def test_exceptions_survive_pickle():
    error = pickle.loads(pickle.dumps(kunci.Unavailable("no route")))
    assert str(error) == "unavailable: no route; nothing was sent"
    assert error.reason == "no route"
    error = pickle.loads(pickle.dumps(kunci.LimitMismatch("limit mismatch: x", 3)))
    assert (str(error), error.limit) == ("limit mismatch: x", 3)


def test_invalid_argument_does_not_chain_the_internal_error(make_client):
    client = make_client("127.0.0.1:1")
    with pytest.raises(kunci.InvalidArgument) as raised:
        client.acquire("k", lease=0)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert str(raised.value) == "lease must be a whole number of seconds from 1 to 255"
    with pytest.raises(kunci.InvalidArgument, match="^limit must be a whole number from 1 to "
                                                    "65535, got 0$"):
        client.acquire("k", limit=0)


def test_a_campaign_value_is_called_value(make_client):
    client = make_client("127.0.0.1:1")
    with pytest.raises(kunci.InvalidArgument) as raised:
        client.campaign("e", b"\xff")
    assert "value" in str(raised.value) and "label" not in str(raised.value)


def test_timeout_names_the_key(server, make_client):
    holder = kunci.Client(server.address)
    ticket = holder.acquire("named", lease=60)
    client = make_client(server.address)
    with pytest.raises(kunci.Timeout) as raised:
        client.acquire("named")
    assert str(raised.value) == ("timeout: key 'named' was held at the one attempt (wait 0); "
                                 "nothing was acquired")
    with pytest.raises(kunci.Timeout) as raised:
        client.acquire("named", wait=0.2)
    assert str(raised.value) == ("timeout: key 'named' stayed held for the whole wait; nothing "
                                 "was acquired")
    ticket.release()
    holder.close()


def test_observe_after_close_raises_the_closed_client_error(server):
    client = kunci.Client(server.address)
    following = client.observe("followed")
    assert next(following) is None
    box = in_thread(next, following)  # waits in a 255 s O
    time.sleep(0.3)
    client.close()
    with pytest.raises(kunci.Error) as raised:
        joined(box, 5)
    assert type(raised.value) is kunci.Error and "closed" in str(raised.value)


def test_tls_to_a_plain_port_says_so(server, make_client):
    client = make_client("tls://" + server.address)
    start = time.monotonic()
    with pytest.raises(kunci.Unavailable) as raised:
        client.ping()
    # Not retried until the deadline: a port does not start speaking TLS.
    assert time.monotonic() - start < 2
    assert ("the server does not speak TLS on that port (a plain kunci port?): address it "
            "without tls://") in raised.value.reason
