"""The sync client: threads sharing one client, fork, a paused process."""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import kunci
from conftest import PACKAGE_ROOT, wait_for


def test_threads_share_one_client_and_one_connection(server):
    client = kunci.Client(server.address)
    inside = []
    overlaps = []
    tokens = []
    handed = queue.Queue()
    errors = []

    def worker(n):
        try:
            for i in range(25):
                with client.lock("shared", wait=10, lease=5) as ticket:
                    inside.append(n)
                    if len(inside) > 1:
                        overlaps.append(list(inside))
                    time.sleep(0.0005)
                    inside.remove(n)
                    tokens.append(ticket.token)
                # A ticket is not thread-local: another thread releases it.
                handed.put(client.acquire("own-%d-%d" % (n, i)))
        except Exception as error:  # reported below
            errors.append(error)

    def releaser():
        while True:
            ticket = handed.get()
            if ticket is None:
                return
            ticket.release()

    release_thread = threading.Thread(target=releaser)
    release_thread.start()
    threads = [threading.Thread(target=worker, args=(n,)) for n in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    handed.put(None)
    release_thread.join(10)
    assert errors == []
    assert overlaps == []
    assert len(tokens) == 300 and len(set(tokens)) == 300
    info = client.info()
    assert info["held"] == 0 and info["released"] == 600
    # Pipelined over one connection.
    assert info["connections"] == 1
    client.close()


def test_calls_after_close_raise(server):
    client = kunci.Client(server.address)
    client.ping()
    client.close()
    with pytest.raises(kunci.Error):
        client.ping()


def test_forked_child_never_touches_the_parents_lock(server):
    client = kunci.Client(server.address)
    with client.lock("k", lease=1) as ticket:
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report through the pipe, then _exit
            status = 1
            try:
                report = []
                report.append(ticket.lost)
                try:
                    ticket.check()
                    report.append("check passed")
                except kunci.LockLost:
                    report.append("LockLost")
                try:
                    ticket.release()
                    report.append("released")
                except kunci.LockLost:
                    report.append("release LockLost")
                except kunci.Error:
                    report.append("release refused")
                # The child gets connections of its own.
                report.append(client.ping() > 0)
                report.append(client.query("k").token == ticket.token)
                os.write(write_end, repr(report).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write_end)
        _, status = os.waitpid(pid, 0)
        report = os.read(read_end, 4096).decode()
        os.close(read_end)
        assert os.waitstatus_to_exitcode(status) == 0
        assert report == repr([True, "LockLost", "release refused", True, True])
        # The parent still holds and renews it over its own connection.
        time.sleep(1.2)
        ticket.check()
        assert client.query("k").token == ticket.token
    info = client.info()
    assert info["released"] == 1 and info["not_held"] == 0 and info["expired"] == 0
    client.close()


def test_forked_child_leaving_a_lock_block_releases_nothing(server):
    client = kunci.Client(server.address)
    with client.lock("k", lease=5) as ticket:
        pid = os.fork()
        if pid == 0:
            try:
                # The child leaves the block (and drops the ticket).
                pass
            finally:
                pass
    if pid == 0:
        del ticket
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    info = client.info()
    # Exactly one release: the parent's.
    assert info["released"] == 1 and info["not_held"] == 0
    client.close()


PAUSED_CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, %(root)r)
    import kunci
    client = kunci.Client(%(address)r)
    client.ping()
    print("ready", flush=True)
    sys.stdin.readline()
    start = time.monotonic()
    try:
        client.acquire("k", wait=0, lease=30)
        print("ticket", flush=True)
    except kunci.Error as error:
        print(type(error).__name__, round(time.monotonic() - start, 1), flush=True)
    time.sleep(0.5)  # the compensating release goes out
""")


@pytest.mark.parametrize("held", [False, True], ids=["grant", "timeout"])
def test_answer_noticed_after_the_deadline(server, make_proxy, held):
    # The client process is paused (as by a GC pause or a stopped VM) while
    # the answer is on its way, and notices it only after D. A grant must
    # not be handed over but released, exactly that token (rule 7); a T
    # stays a definitive Timeout whenever it is noticed (rule 6).
    proxy = make_proxy(server.port)
    # Long enough that the answer is still in the proxy when the child stops.
    proxy.down_delay = 1.5
    script = PAUSED_CHILD % {"root": PACKAGE_ROOT, "address": proxy.address}
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE)
    try:
        assert child.stdout.readline() == b"ready\n"
        with kunci.Client(server.address) as observer:
            holder = observer.acquire("k") if held else None
            child.stdin.write(b"go\n")
            child.stdin.flush()
            if held:
                answered = lambda: observer.info()["timeouts"] == 1
            else:
                answered = lambda: observer.query("k") is not None
            wait_for(answered, 2, interval=0.001)
            child.send_signal(signal.SIGSTOP)
            time.sleep(kunci.TRANSPORT_DEADLINE + 0.5)
            child.send_signal(signal.SIGCONT)
            line = child.stdout.readline().decode().split()
            if held:
                assert line[0] == "Timeout"
                assert observer.query("k").token == holder.token
                holder.release()
            else:
                assert line[0] == "Indeterminate"
                wait_for(lambda: observer.query("k") is None, 2)
                assert observer.info()["released"] == 1
        assert child.wait(5) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_waiting_threads_deadline_is_kept_while_another_thread_reads(server, make_proxy):
    # Thread A reads the connection for its long acquire; thread B's ping
    # has a much earlier deadline and gets no answer. B must end at its
    # own D: the reading thread is woken to keep it, and closing that
    # session ends A's call too (rule 5: exactly that session).
    proxy = make_proxy(server.port)
    client = kunci.Client(proxy.address)
    holder = kunci.Client(server.address)
    held = holder.acquire("k")
    client.ping()
    results = {}

    def long_acquire():
        results["a"] = _timed(lambda: client.acquire("k", wait=100))

    reader = threading.Thread(target=long_acquire)
    reader.start()
    wait_for(lambda: holder.query("k").waiters == 1, 2)
    proxy.down = "drop"
    results["b"] = _timed(client.ping)
    reader.join(10)
    kind, elapsed = results["b"]
    assert kind is kunci.Indeterminate
    assert kunci.TRANSPORT_DEADLINE <= elapsed < kunci.TRANSPORT_DEADLINE + 1
    assert results["a"][0] is kunci.Indeterminate
    # Closing the session removed A's waiter from the server's queue.
    wait_for(lambda: holder.query("k").waiters == 0, 2)
    held.release()
    client.close()
    holder.close()


def _timed(function):
    start = time.monotonic()
    try:
        function()
        kind = "ok"
    except kunci.Error as error:
        kind = type(error)
    return kind, time.monotonic() - start


def test_interrupted_acquire_withdraws_its_wait(server):
    # A KeyboardInterrupt (here: an exception from a signal handler) while
    # the acquire is queued: the call is abandoned and its wait withdrawn
    # (its connection, which nothing else used, is closed), so no grant
    # goes to nobody. test_exit.py runs it with a real Ctrl-C.
    client = kunci.Client(server.address)
    holder = client.acquire("k")

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted()

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            client.acquire("k", wait=10)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    wait_for(lambda: client.query("k").waiters == 0, 2)
    holder.release()
    wait_for(lambda: client.query("k") is None, 2)
    info = client.info()
    assert info["grants"] == 1 and info["released"] == 1
    client.close()


def test_maintenance_thread_ends_when_idle_and_comes_back(server, monkeypatch):
    import gc

    import kunci._sync

    monkeypatch.setattr(kunci._sync, "_MAINTENANCE_IDLE_EXIT", 0.2)
    client = kunci.Client(server.address)
    for round_ in (1, 2):
        ticket = client.acquire("k")
        del ticket  # a dropped ticket is released by the maintenance thread
        gc.collect()
        wait_for(lambda: client.query("k") is None, 2)
        assert client.info()["released"] == round_
        wait_for(lambda: client._maint_thread is None, 2)
    client.close()
