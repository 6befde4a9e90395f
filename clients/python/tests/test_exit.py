"""A program that ends while it holds tickets (spec §8 rule 9, issue 25):
real interpreter processes, every CPython >= 3.9 on this machine, both
flavours. Each must end within a few seconds, and its keys must be free
right after (released in one bounded flush); a detached ticket stays
held, and a forked child never releases its parent's."""

import concurrent.futures
import functools
import glob
import os
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

import kunci
from conftest import PACKAGE_ROOT, wait_for

# How long a program that ends may take, start to end (it starts an
# interpreter and imports kunci), and from its last statement on.
PROGRAM_LIMIT = 5.0
END_LIMIT = 1.5


@functools.lru_cache(maxsize=None)
def interpreters():
    """Every CPython >= 3.9 on this machine, one path per version, oldest
    first (a tuple)."""
    candidates = sorted(glob.glob("/root/.pyenv/versions/3.*/bin/python3"))
    candidates += glob.glob("/usr/bin/python3") + glob.glob("/usr/local/bin/python3")
    for name in ("python3", "python"):
        found = shutil.which(name)
        if found:
            candidates.append(found)
    candidates.append(sys.executable)
    found = {}
    for path in candidates:
        try:
            out = subprocess.run(
                [path, "-c", "import sys, platform; print(platform.python_implementation(), "
                             "'%d.%d.%d' % sys.version_info[:3])"],
                capture_output=True, text=True, timeout=20).stdout.split()
        except (OSError, subprocess.SubprocessError):
            continue
        if len(out) != 2 or out[0] != "CPython":
            continue
        version = tuple(int(part) for part in out[1].split("."))
        if version >= (3, 9) and version not in found:
            found[version] = path
    return tuple(found[version] for version in sorted(found))


def oldest_and_newest():
    """For behaviour that does not differ by version: two interpreters."""
    found = interpreters()
    return tuple(sorted(set([found[0], found[-1]]), key=found.index))


PRELUDE = """
import asyncio, os, sys, time
sys.path.insert(0, %(root)r)
import kunci, kunci.aio
ADDRESS, KEY = %(address)r, %(key)r
def end():
    print("end", flush=True)
"""

# What each program does; it prints "end" right before its last statement.
PROGRAMS = {
    "last line": """
        client = kunci.Client(ADDRESS)
        end()
        t = client.acquire(KEY, lease=60)
    """,
    "uncaught exception": """
        t = kunci.Client(ADDRESS).acquire(KEY, lease=60)
        end()
        raise RuntimeError("the program fails")
    """,
    "sys.exit with a thread pool": """
        import concurrent.futures
        client = kunci.Client(ADDRESS)
        pool = concurrent.futures.ThreadPoolExecutor(2)
        held = [pool.submit(client.acquire, KEY + "/" + str(n), lease=60).result()
                for n in range(2)]
        held.append(pool.submit(client.acquire, KEY, lease=60).result())
        end()
        sys.exit(3)
    """,
    "lock left open": """
        client = kunci.Client(ADDRESS)
        block = client.lock(KEY, lease=3)
        t = block.__enter__()
        time.sleep(1.2)   # the keep-alive renews it
        end()
    """,
    "dropped ticket": """
        client = kunci.Client(ADDRESS)
        end()
        client.acquire(KEY, lease=60)
    """,
    "aio after asyncio.run": """
        client = kunci.aio.Client(ADDRESS)
        async def main():
            return await client.acquire(KEY, lease=60)
        t = asyncio.run(main())
        end()
    """,
    "aio lock left open": """
        async def main():
            client = kunci.aio.Client(ADDRESS)
            block = client.lock(KEY, lease=3)
            return await block.__aenter__()
        t = asyncio.run(main())
        end()
    """,
    "aio uncaught exception": """
        async def main():
            client = kunci.aio.Client(ADDRESS)
            t = await client.acquire(KEY, lease=60)
            end()
            raise RuntimeError("the program fails")
        asyncio.run(main())
    """,
}

EXIT_CODES = {"uncaught exception": 1, "sys.exit with a thread pool": 3,
              "aio uncaught exception": 1}

KEYS_OF = {"sys.exit with a thread pool": ["/0", "/1", ""]}


def run_program(python, body, address, key, timeout=20):
    script = PRELUDE % {"root": PACKAGE_ROOT, "address": address, "key": key}
    script += textwrap.dedent(body)
    start = time.monotonic()
    child = subprocess.Popen([python, "-c", script], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    ended_at = None
    line = child.stdout.readline()
    if line == b"end\n":
        ended_at = time.monotonic()
    try:
        child.wait(timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
        return None, None, child.returncode, child.stderr.read().decode()
    done = time.monotonic()
    took_end = None if ended_at is None else done - ended_at
    return done - start, took_end, child.returncode, child.stderr.read().decode()


def test_interpreters_are_found():
    found = interpreters()
    assert found, "no CPython >= 3.9 found"


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_a_program_that_ends_holding_tickets_ends_and_frees_them(server, program):
    pythons = interpreters()
    assert pythons, "no CPython >= 3.9 found"
    observer = kunci.Client(server.address)

    def run(python):
        key = "exit/%s/%s" % (program.replace(" ", "-"), os.path.basename(
            os.path.dirname(os.path.dirname(python))) + str(hash(python) & 0xffff))
        took, took_end, code, stderr = run_program(python, PROGRAMS[program], server.address, key)
        held = [observer.query(key + suffix) for suffix in KEYS_OF.get(program, [""])]
        return python, key, took, took_end, code, stderr, held

    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        results = list(pool.map(run, pythons))
    for python, key, took, took_end, code, stderr, held in results:
        where = "%s (%s): %s" % (python, program, stderr[-2000:])
        assert took is not None, "did not end within 20 s: " + where
        assert code == EXIT_CODES.get(program, 0), where
        assert took < PROGRAM_LIMIT, "took %.2f s: %s" % (took, where)
        assert took_end is not None and took_end < END_LIMIT, \
            "took %r s after its last statement: %s" % (took_end, where)
        # Right after the end: free (the flush released them).
        assert held == [None] * len(held), where
        assert "Traceback" not in stderr or code == 1, where
    observer.close()


def test_the_flush_is_bounded_when_the_server_does_not_answer(make_proxy, server):
    # A server that takes the bytes and never answers: the program still
    # ends within the flush's 0.5 s (plus the interpreter's own end).
    proxy = make_proxy(server.port)
    body = """
        client = kunci.Client(ADDRESS)
        held = [client.acquire(KEY + str(n), lease=60) for n in range(3)]
        end()
        sys.stdin.readline()
    """
    for python in oldest_and_newest():
        proxy.down = "pass"
        script = PRELUDE % {"root": PACKAGE_ROOT, "address": proxy.address, "key": "exit/bh"}
        child = subprocess.Popen([python, "-c", script + textwrap.dedent(body)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        try:
            assert child.stdout.readline() == b"end\n"
            proxy.down = "drop"
            start = time.monotonic()
            child.stdin.write(b"\n")
            child.stdin.flush()
            child.wait(10)
            took = time.monotonic() - start
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert child.returncode == 0
        assert kunci._common.EXIT_FLUSH <= took < kunci._common.EXIT_FLUSH + 0.5, python


def test_a_detached_ticket_stays_held_after_the_program_ends(server):
    observer = kunci.Client(server.address)
    for python in oldest_and_newest():
        key = "exit/detached/" + python
        body = """
            t = kunci.Client(ADDRESS).acquire(KEY, lease=60)
            print(t.detach(), flush=True)
            end()
        """
        script = PRELUDE % {"root": PACKAGE_ROOT, "address": server.address, "key": key}
        out = subprocess.run([python, "-c", script + textwrap.dedent(body)],
                             capture_output=True, text=True, timeout=20)
        assert out.returncode == 0, out.stderr
        token = int(out.stdout.split()[0])
        status = observer.query(key)
        assert status is not None and status.token == token
        observer.release(key, token)
    observer.close()


FORK = """
    client = kunci.Client(ADDRESS) if %(sync)r else None
    if client is not None:
        t = client.acquire(KEY, lease=60)
    else:
        async def main():
            return await kunci.aio.Client(ADDRESS).acquire(KEY, lease=60)
        t = asyncio.run(main())
    pid = os.fork()
    if pid == 0:
        sys.exit(0)   # the child ends normally: its at-exit flush runs
    os.waitpid(pid, 0)
    with kunci.Client(ADDRESS) as look:
        print(look.query(KEY).token == t.token, flush=True)
    end()
"""


@pytest.mark.parametrize("sync", [True, False], ids=["sync", "aio"])
def test_a_forked_child_that_ends_never_releases_its_parents_tickets(server, sync):
    python = interpreters()[-1]
    key = "exit/fork/%s" % sync
    script = PRELUDE % {"root": PACKAGE_ROOT, "address": server.address, "key": key}
    out = subprocess.run([python, "-c", script + textwrap.dedent(FORK % {"sync": sync})],
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "end"]
    with kunci.Client(server.address) as observer:
        assert observer.query(key) is None
        info = observer.info()
    # Released once, by the parent; the child sent nothing.
    assert info["released"] == 1 and info["not_held"] == 0


def test_the_flush_does_the_clean_up_of_an_indeterminate_acquire(server):
    # An acquire that ended Indeterminate (or was interrupted) leaves a
    # clean-up to do (rule 11); when the program ends before it is done,
    # the flush finds the grant of that owner and releases it.
    import kunci._sync
    client = kunci.Client(server.address)
    observer = kunci.Client(server.address)
    ticket = client.acquire("k", lease=60)
    owner = observer.holders("k").grants[0].owner
    ticket.detach()
    client._cleanups[owner] = b"k"
    start = time.monotonic()
    kunci._sync.flush_client(client, start + kunci._common.EXIT_FLUSH)
    assert time.monotonic() - start < kunci._common.EXIT_FLUSH
    assert observer.query("k") is None
    client.close()
    observer.close()


LATE_CLEAN_UP = """
import atexit, sys, time
def late():
    # Runs after the flush at exit (registered before kunci's own handler).
    client = kunci.Client(ADDRESS)
    print("acquiring", flush=True)
    try:
        client.acquire(KEY, lease=60)
        print("granted", flush=True)
    except kunci.Indeterminate:
        print("indeterminate", flush=True)
atexit.register(late)
sys.path.insert(0, %(root)r)
import kunci, kunci._protocol
kunci._protocol.TRANSPORT_DEADLINE = 1.0
ADDRESS, KEY = %(address)r, %(key)r
"""


def test_late_clean_up_of_an_indeterminate_acquire_at_the_end_starts_no_thread(
        server, make_proxy):
    # The clean-up of rule 11 after an acquire that ended Indeterminate
    # while the program ends (here: in an atexit handler that runs after
    # the flush) starts no thread (3.10 and 3.11 hang on one, 3.12+ raise
    # RuntimeError): it is done at once, bounded as the flush is.
    observer = kunci.Client(server.address)
    for python in interpreters():
        key = "late-clean-up/" + python
        proxy = make_proxy(server.port)
        proxy.down = "drop"  # the grant is made, its answer never comes
        script = LATE_CLEAN_UP % {"root": PACKAGE_ROOT, "address": proxy.address, "key": key}
        child = subprocess.Popen([python, "-c", script], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE)
        try:
            assert child.stdout.readline() == b"acquiring\n"
            wait_for(lambda: observer.query(key) is not None, 5)
            # The grant's answer (A owner token, 18 bytes) is thrown away
            # before the proxy passes answers again.
            wait_for(lambda: proxy.dropped_down >= 18, 5)
            proxy.down = "pass"
            assert child.stdout.readline() == b"indeterminate\n"
            assert child.wait(5) == 0
            # Freed before the program ended, not when the 60 s lease ends.
            assert observer.query(key) is None
        finally:
            if child.poll() is None:
                child.kill()
            child.wait()
            stderr = child.stderr.read().decode()
        assert "Traceback" not in stderr and "RuntimeError" not in stderr, stderr
    observer.close()


LATE_AIO_ON_ETCD = """
import asyncio, atexit, sys
def late():
    # Runs after the flush at exit (registered before kunci's own handler).
    async def main():
        try:
            await kunci.aio.Client(ADDRESS).query(KEY)
            print("answered", flush=True)
        except kunci.Error as error:
            print("refused %%s" %% type(error).__name__, flush=True)
    asyncio.run(main())
atexit.register(late)
sys.path.insert(0, %(root)r)
import kunci, kunci.aio
ADDRESS, KEY = %(address)r, %(key)r
"""


def test_an_aio_call_on_etcd_while_the_program_ends_starts_no_thread(etcd_cluster):
    # kunci.aio runs each etcd call on a thread: while the program ends
    # none starts (3.10 and 3.11 would hang, 3.12+ raise RuntimeError); the
    # call ends Unavailable (nothing was sent).
    for python in interpreters():
        script = LATE_AIO_ON_ETCD % {"root": PACKAGE_ROOT, "address": etcd_cluster.address,
                                     "key": "late-aio"}
        child = subprocess.run([python, "-c", script], capture_output=True, timeout=20)
        stderr = child.stderr.decode()
        assert child.returncode == 0, stderr
        assert child.stdout == b"refused Unavailable\n", (python, child.stdout, stderr)
        assert "Traceback" not in stderr, stderr


@pytest.mark.parametrize("program", ["last line", "aio after asyncio.run"])
def test_on_etcd_a_program_that_ends_holding_tickets_frees_them(etcd_cluster, program):
    observer = kunci.Client(etcd_cluster.address)
    for python in oldest_and_newest():
        key = "exit-%s-%d" % (program.replace(" ", "-"), hash(python) & 0xffff)
        took, took_end, code, stderr = run_program(python, PROGRAMS[program],
                                                   etcd_cluster.address, key)
        where = "%s (%s): %s" % (python, program, stderr[-2000:])
        assert took is not None and code == 0, where
        assert took_end is not None and took_end < END_LIMIT, (took_end, where)
        assert observer.query(key) is None, where
    observer.close()


MULTIPROCESSING = """
import multiprocessing
def work(key):
    client = kunci.Client(ADDRESS)
    global held   # kept past the task: the process ends holding it
    held = client.acquire(key, lease=60)
    return held.token
if __name__ == "__main__":
    context = multiprocessing.get_context("fork")
    child = context.Process(target=work, args=(KEY + "/process",))
    child.start()
    child.join(20)
    with context.Pool(1) as pool:
        print(pool.apply(work, (KEY + "/pool",)), flush=True)
        pool.close()
        pool.join()
    end()
"""


def test_multiprocessing_children_that_end_release_their_tickets(server):
    # A multiprocessing child ends with os._exit() (no atexit), after its
    # finalizers: the flush runs among them.
    observer = kunci.Client(server.address)
    for python in oldest_and_newest():
        key = "mp/%d" % (hash(python) & 0xffff)
        script = PRELUDE % {"root": PACKAGE_ROOT, "address": server.address, "key": key}
        out = subprocess.run([python, "-c", script + textwrap.dedent(MULTIPROCESSING)],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[-1] == "end"
        assert observer.query(key + "/process") is None, python
        assert observer.query(key + "/pool") is None, python
    info = observer.info()
    assert info["released"] == info["grants"] == 2 * len(oldest_and_newest())
    observer.close()
