"""The client inside real programs (issue 26): Ctrl-C during a wait, a
release from a signal handler, descriptors, one lock() object shared by
threads, slow callbacks, released tickets, and a library that prints
nothing by itself. Where the behaviour depends on processes, signals or
the interpreter, each runs a real interpreter process (every CPython >= 3.9
on this machine)."""

import contextlib
import logging
import signal
import subprocess
import textwrap
import threading
import time

import pytest

import kunci
from conftest import PACKAGE_ROOT, wait_for
from test_exit import interpreters, oldest_and_newest

PRELUDE = """
import asyncio, gc, os, signal, sys, threading, time
sys.path.insert(0, %(root)r)
import kunci, kunci.aio
ADDRESS, KEY = %(address)r, %(key)r
# Ctrl-C raises KeyboardInterrupt, as in a program started from a terminal,
# even when the suite itself runs in the background of a script (bash starts
# such a job with SIGINT ignored, and Python then leaves it ignored).
signal.signal(signal.SIGINT, signal.default_int_handler)
"""


def start(python, body, address, key):
    script = PRELUDE % {"root": PACKAGE_ROOT, "address": address, "key": key}
    return subprocess.Popen([python, "-c", script + textwrap.dedent(body)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def stop(child):
    if child.poll() is None:
        child.kill()
    child.wait()
    return child.stderr.read().decode()


# ------------------------------------------------------ Ctrl-C (26.1)

CTRL_C = {
    "sync": """
        client = kunci.Client(ADDRESS)
        client.ping()
        print("ready", flush=True)
        try:
            client.acquire(KEY, wait=30, lease=30)
            print("granted", flush=True)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        time.sleep(30)   # the program goes on, and reads nothing
    """,
    # The program catches the interrupt around asyncio.run and goes on
    # without an event loop: the loop that had the connection is closed.
    "aio": """
        client = kunci.aio.Client(ADDRESS)
        async def main():
            await client.ping()
            print("ready", flush=True)
            t = await client.acquire(KEY, wait=30, lease=30)
            print("granted", flush=True)
            await asyncio.sleep(30)
        try:
            asyncio.run(main())
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        time.sleep(30)   # the program goes on, and reads nothing
    """,
}


@contextlib.contextmanager
def waiting_behind_a_holder(observer, python, body, address, key):
    """Starts `body` in `python` once `observer` holds `key`, and yields
    (child, holder) when the child waits for the key; after the block the
    child is stopped and must have printed no traceback."""
    holder = observer.acquire(key, lease=30)
    child = start(python, body, address, key)
    try:
        assert child.stdout.readline() == b"ready\n"
        wait_for(lambda: observer.query(key).waiters == 1, 5)
        yield child, holder
    finally:
        stderr = stop(child)
    assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("flavour", sorted(CTRL_C))
def test_ctrl_c_during_a_waiting_acquire_leaves_no_grant_to_nobody(server, flavour):
    observer = kunci.Client(server.address)
    for python in interpreters():
        key = "ctrl-c/" + python
        with waiting_behind_a_holder(observer, python, CTRL_C[flavour], server.address,
                                     key) as (child, holder):
            child.send_signal(signal.SIGINT)
            assert child.stdout.readline() == b"interrupted\n"
            # The wait is withdrawn: the key goes on when released, long
            # before the 30 s lease a grant to the child would hold it
            # (5 s: a generous bound on a loaded machine).
            holder.release()
            wait_for(lambda: observer.query(key) is None, 5)
            assert child.poll() is None  # still running, reading nothing
    observer.close()


@pytest.mark.parametrize("flavour", sorted(CTRL_C))
def test_ctrl_c_when_the_grant_is_already_sent_releases_it(server, flavour):
    # The grant is on its way (the child is stopped while the server grants)
    # when Ctrl-C comes: whichever the program sees first, the grant is
    # released at once, although the program goes on and reads nothing.
    observer = kunci.Client(server.address)
    for python in oldest_and_newest():
        key = "ctrl-c-late/" + python
        with waiting_behind_a_holder(observer, python, CTRL_C[flavour], server.address,
                                     key) as (child, holder):
            child.send_signal(signal.SIGSTOP)
            holder.release()
            wait_for(lambda: observer.query(key) is not None
                     and observer.query(key).waiters == 0, 2)
            child.send_signal(signal.SIGINT)
            child.send_signal(signal.SIGCONT)
            line = child.stdout.readline()
            if line == b"granted\n":
                child.send_signal(signal.SIGINT)
                line = child.stdout.readline()
            assert line == b"interrupted\n"
            wait_for(lambda: observer.query(key) is None, 5)  # the lease is 30 s
            assert child.poll() is None  # still running, reading nothing
    observer.close()


# ------------------------------------------ release in a signal handler (26.6)

# Holds KEY/held and releases it from its SIGTERM handler, saying how long
# the release took; what follows it says what the main thread is doing.
RELEASE_ON_SIGTERM = """
        client = kunci.Client(ADDRESS)
        t = client.acquire(KEY + "/held", lease=30)
        def on_term(signum, frame):
            start = time.monotonic()
            t.release()
            print("released %.3f" % (time.monotonic() - start), flush=True)
            sys.exit(0)
        signal.signal(signal.SIGTERM, on_term)
"""

SIGTERM_RELEASE = {
    "blocked in an acquire": RELEASE_ON_SIGTERM + """\
        print("ready", flush=True)
        client.acquire(KEY + "/busy", wait=30)
    """,
    "busy with calls": RELEASE_ON_SIGTERM + """\
        print("ready", flush=True)
        while True:
            client.query(KEY + "/busy")
    """,
}


def release_from_a_signal_handler(observer, python, doing, body, address, key,
                                  queue_left_within, watchdog=None):
    """Runs `body` (one of SIGTERM_RELEASE's programs, `doing` what its name
    says) in `python` with `key + "/busy"` held by `observer`, sends it
    SIGTERM, and checks that its handler released `key + "/held"` at once
    and that the interrupted acquire left the queue within
    `queue_left_within` s. A child still running `watchdog` s after its start
    (deadlocked: it never answers) is killed, so the test fails instead of
    hanging."""
    busy = observer.acquire(key + "/busy", lease=30)
    child = start(python, body, address, key)
    timer = None if watchdog is None else threading.Timer(watchdog, child.kill)
    if timer is not None:
        timer.start()
    try:
        assert child.stdout.readline() == b"ready\n"
        if doing == "blocked in an acquire":
            wait_for(lambda: observer.query(key + "/busy").waiters == 1, 5)
        else:
            time.sleep(0.3)
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        line = child.stdout.readline().decode().split()
        took = time.monotonic() - sent
        assert child.wait(5) == 0
    finally:
        if timer is not None:
            timer.cancel()
        stderr = stop(child)
    assert line and line[0] == "released", stderr
    assert float(line[1]) < 1.0 and took < 2.0, (line, took, stderr)
    assert observer.query(key + "/held") is None
    # The interrupted acquire left the queue as the program ended.
    wait_for(lambda: observer.query(key + "/busy").waiters == 0, queue_left_within)
    busy.release()


@pytest.mark.parametrize("doing", sorted(SIGTERM_RELEASE))
def test_release_from_a_signal_handler_while_inside_a_call(server, doing):
    observer = kunci.Client(server.address)
    for python in oldest_and_newest():
        release_from_a_signal_handler(observer, python, doing, SIGTERM_RELEASE[doing],
                                      server.address, "sigterm/" + python,
                                      queue_left_within=2)
    observer.close()


# ---------------------------------------------------- descriptors (26.3)

DESCRIPTORS = """
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
import kunci._sync
kunci._sync._MAINTENANCE_IDLE_EXIT = 0.05
def fds():
    return len(os.listdir("/proc/self/fd"))
def settled():
    deadline = time.monotonic() + 5
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    return fds()
before = fds()
for n in range(80):
    with kunci.Client(ADDRESS) as client:
        with client.lock(KEY, lease=5):
            pass
after_closed = settled()
for n in range(80):
    client = kunci.Client(ADDRESS)
    client.ping()
    client.acquire(KEY + str(n))   # dropped: released in the background
    del client
    if n % 10 == 0:
        settled()
after_dropped = settled()
print(before, after_closed, after_dropped, flush=True)
"""


def test_clients_leave_no_descriptors_behind(server):
    for python in oldest_and_newest():
        out = subprocess.run(
            [python, "-c", PRELUDE % {"root": PACKAGE_ROOT, "address": server.address,
                                      "key": "fds"} + DESCRIPTORS],
            capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (python, out.stderr[-3000:])
        before, after_closed, after_dropped = map(int, out.stdout.split())
        assert after_closed - before <= 2, (python, out.stdout)
        assert after_dropped - before <= 2, (python, out.stdout)
    with kunci.Client(server.address) as observer:
        wait_for(lambda: observer.info()["held"] == 0, 2)


# ------------------------------------------- the library prints nothing (26.9)

QUIET = """
client = kunci.Client(ADDRESS)
t = client.acquire(KEY, lease=1)
t.release()
try:
    t.release()
except kunci.Error as error:
    print(type(error).__name__, flush=True)
u = client.acquire(KEY + "/2", lease=1)
time.sleep(1.1)
try:
    u.check()
except kunci.LockLost:
    print("LockLost", flush=True)
try:
    client.release(KEY + "/2", u.token)
except kunci.NotHeld:
    print("NotHeld", flush=True)
"""


def test_the_library_prints_nothing_on_stderr(server):
    python = interpreters()[-1]
    out = subprocess.run(
        [python, "-c", PRELUDE % {"root": PACKAGE_ROOT, "address": server.address,
                                  "key": "quiet"} + QUIET],
        capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["LockLost", "LockLost", "NotHeld"]
    assert out.stderr == ""
    assert any(isinstance(handler, logging.NullHandler)
               for handler in logging.getLogger("kunci").handlers)


# ------------------------------------ one lock() object, two threads (26.4)


def test_one_lock_object_entered_by_two_threads_takes_two_tickets(server):
    client = kunci.Client(server.address)
    block = client.lock("sem", wait=5, lease=2, limit=2)
    inside = threading.Barrier(2)
    first_left = threading.Event()
    tokens = {}

    def worker(name):
        with block as ticket:
            tokens[name] = ticket.token
            inside.wait(5)
            if name == "second":
                first_left.wait(5)
                # The first thread's exit released its own ticket only.
                held = [grant.token for grant in client.holders("sem").grants]
                tokens["held after first left"] = held
                ticket.check()
        if name == "first":
            first_left.set()

    threads = [threading.Thread(target=worker, args=(name,)) for name in ("first", "second")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert tokens["first"] != tokens["second"]
    assert tokens["held after first left"] == [tokens["second"]]
    assert client.holders("sem").grants == []
    extended = client.info()["extended"]
    time.sleep(1.0)  # nothing is renewed any more
    info = client.info()
    assert info["extended"] == extended and info["released"] == 2 and info["not_held"] == 0
    client.close()


# ------------------------------- callbacks never on the timer thread (26.5)


def test_a_slow_on_lost_does_not_stop_other_renewals(server):
    client = kunci.Client(server.address)
    called = []

    def slow(ticket):
        called.append(threading.current_thread().name)
        time.sleep(3)

    with client.lock("other", lease=1) as other:
        with client.lock("doomed", lease=1, on_lost=slow) as doomed:
            # Its renewals stop (as in an outage): its loss is declared by
            # the timer at valid_until.
            doomed._keepalive._renew_until_done = lambda: False
            wait_for(lambda: called, 3)
            extended = client.info()["extended"]
            time.sleep(2.5)
            # Meanwhile the other lock went on renewing every lease/3.
            assert client.info()["extended"] - extended >= 4
            other.check()
            assert client.query("other").token == other.token
    assert called and called[0] != "kunci-maintenance"
    client.close()


# ------------------------------------- a released ticket is not valid (26.8)


def test_a_released_ticket_is_not_valid_and_never_reported_lost(server, make_client, caplog):
    client = make_client(server.address)
    lost = []
    with client.lock("k", lease=1, on_lost=lost.append) as managed:
        pass
    plain = client.acquire("p", lease=1)
    plain.release()
    for ticket in (managed, plain):
        assert ticket.released and not ticket.is_valid() and not ticket.lost
        with pytest.raises(kunci.LockLost, match="released"):
            ticket.check()
    time.sleep(1.2)  # past valid_until
    for ticket in (managed, plain):
        with pytest.raises(kunci.LockLost, match="released"):
            ticket.check()
        with pytest.raises(kunci.LockLost, match="released"):
            ticket.renew()
        assert not ticket.lost
    assert lost == []
    assert not [r for r in caplog.records if r.name == "kunci" and r.levelno >= logging.WARNING]
    assert client.info()["released"] == 2


def test_one_aio_lock_object_entered_by_two_tasks_takes_two_tickets(server):
    import asyncio

    import kunci.aio

    async def main():
        client = kunci.aio.Client(server.address)
        block = client.lock("sem", wait=5, lease=2, limit=2)
        both_inside = asyncio.Event()
        first_left = asyncio.Event()
        entered = []
        seen = {}

        async def worker(name):
            async with block as ticket:
                entered.append(ticket.token)
                if len(entered) == 2:
                    both_inside.set()
                await both_inside.wait()
                if name == "second":
                    await first_left.wait()
                    seen["held"] = [g.token for g in (await client.holders("sem")).grants]
                    seen["second"] = ticket.token
                    ticket.check()
            if name == "first":
                first_left.set()

        await asyncio.wait_for(asyncio.gather(worker("first"), worker("second")), 10)
        assert len(set(entered)) == 2
        assert seen["held"] == [seen["second"]]
        assert (await client.holders("sem")).grants == []
        info = await client.info()
        assert info["released"] == 2 and info["not_held"] == 0
        await client.close()

    asyncio.run(main())
