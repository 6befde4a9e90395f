"""The asyncio client inside real programs (issue 26): one client used by
a second ``asyncio.run`` (and under uvloop), and cancelled waiting
acquires, each in a real interpreter process, on every CPython 3.9+ the
machine has."""

import glob
import os
import subprocess
import sys
import textwrap
import time

import pytest

import kunci
from conftest import PACKAGE_ROOT, running_in_ci


def cpythons():
    """Every CPython >= 3.9 on the machine (pyenv's and PATH's), by real
    path, at least one (the one running the tests)."""
    found = {}
    candidates = glob.glob("/root/.pyenv/versions/*/bin/python3")
    candidates += glob.glob(os.path.expanduser("~/.pyenv/versions/*/bin/python3"))
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        candidates.append(os.path.join(directory, "python3"))
    candidates.append(sys.executable)
    for path in candidates:
        if not os.access(path, os.X_OK) or "shims" in path:
            continue
        try:
            out = subprocess.run(
                [path, "-c", "import sys; print(sys.implementation.name, "
                 "*sys.version_info[:2], sys.executable)"],
                capture_output=True, text=True, timeout=10).stdout.split()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if len(out) < 4 or out[0] != "cpython" or (int(out[1]), int(out[2])) < (3, 9):
            continue
        found.setdefault(os.path.realpath(out[3]), (int(out[1]), int(out[2])))
    assert found, "no CPython >= 3.9 found"
    return sorted(found, key=found.get)


PYTHONS = cpythons()


def run_script(python, source, *args, timeout=60):
    """Runs ``source`` in a fresh interpreter with this checkout's kunci;
    returns (exit status, stdout, stderr, seconds)."""
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT, PYTHONDEVMODE="",
               PYTHONWARNINGS="default")
    started = time.monotonic()
    proc = subprocess.run([python, "-c", textwrap.dedent(source)] + list(args),
                          capture_output=True, text=True, timeout=timeout, env=env)
    return proc.returncode, proc.stdout, proc.stderr, time.monotonic() - started


def have_uvloop():
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if running_in_ci():
            pytest.fail("uvloop is not installed (.ci/test installs it) and CI=true")
        pytest.skip("uvloop is not installed")


SECOND_RUN = """
    import asyncio, sys, time
    import kunci, kunci.aio

    address, flavour = sys.argv[1], sys.argv[2]
    if flavour == "uvloop":
        import uvloop
        uvloop.install()
    client = kunci.aio.Client(address)

    async def once(n):
        started = time.monotonic()
        ticket = await client.acquire("k", wait=2, lease=30)
        await ticket.release()
        assert await client.query("k") is None
        print("run", n, "%.3f" % (time.monotonic() - started), flush=True)

    async def hold():
        # A ticket held when the run ends, and a keep-alive running.
        return await client.acquire("held", lease=30)

    asyncio.run(once(1))
    held = asyncio.run(hold())
    asyncio.run(once(2))
    async def release_from_a_third_loop():
        await held.release()
        print("held released", flush=True)
    asyncio.run(release_from_a_third_loop())
    asyncio.run(once(4))
    asyncio.run(client.close())
"""


def _check_second_run(server, python, flavour):
    status, out, err, _ = run_script(python, SECOND_RUN, server.address, flavour)
    assert status == 0, err
    assert "Traceback" not in err and "Event loop is closed" not in err, err
    lines = out.split("\n")
    runs = [line.split() for line in lines if line.startswith("run ")]
    assert [r[1] for r in runs] == ["1", "2", "4"], out
    for r in runs:
        assert float(r[2]) < 1.0, out  # no 5 s hang
    assert "held released" in out
    with kunci.Client(server.address) as c:
        assert c.query("k") is None and c.query("held") is None
        info = c.info()
        assert info["grants"] == 4 and info["released"] == 4, info


@pytest.mark.parametrize("python", PYTHONS)
def test_one_client_in_several_asyncio_runs(server, python):
    _check_second_run(server, python, "asyncio")


def test_one_client_in_several_uvloop_runs(server):
    have_uvloop()
    _check_second_run(server, sys.executable, "uvloop")


LEFT_IN_FLIGHT = """
    import asyncio, sys, time
    import kunci, kunci.aio

    address, flavour = sys.argv[1], sys.argv[2]
    if flavour == "uvloop":
        import uvloop
        uvloop.install()
    client = kunci.aio.Client(address)

    async def leave_an_acquire_behind():
        await client.ping()
        asyncio.ensure_future(client.acquire("k", lease=60))
        await asyncio.sleep(0)   # written; the run ends before its answer

    async def later():
        started = time.monotonic()
        while await client.query("k") is not None:
            assert time.monotonic() - started < 2, "the unseen grant still holds the key"
            await asyncio.sleep(0.01)
        print("free", flush=True)
        await client.close()

    asyncio.run(leave_an_acquire_behind())
    time.sleep(0.1)   # the grant is on the dead loop's connection, unread
    asyncio.run(later())
"""


@pytest.mark.parametrize("flavour", ["asyncio", "uvloop"])
def test_an_acquire_left_in_flight_by_a_finished_run_holds_nothing(server, flavour):
    if flavour == "uvloop":
        have_uvloop()
    status, out, err, _ = run_script(sys.executable, LEFT_IN_FLIGHT, server.address, flavour)
    assert status == 0, err
    assert out.split() == ["free"], out + err
    assert "Traceback" not in err, err
    with kunci.Client(server.address) as c:
        info = c.info()
        assert info["grants"] == 1 and info["released"] == 1 and info["held"] == 0, info


CANCELLED_WAITS = """
    import asyncio, sys, time
    import kunci, kunci.aio

    address, count, company = sys.argv[1], int(sys.argv[2]), sys.argv[3]

    async def main():
        async with kunci.aio.Client(address) as client:
            holder = await client.acquire("k", lease=60)
            other = await client.acquire("other", lease=60)
            # Another task's wait on the same client, first: it waits on
            # the shared session, the cancelled ones on sessions of their
            # own. Alone, they wait on the shared session. Either way the
            # bystander is never disturbed.
            bystander = asyncio.ensure_future(client.acquire("other", wait=30))
            if company == "alone":
                await other.release()
                await (await bystander).release()
                bystander = None
            for _ in range(count):
                waiting = asyncio.ensure_future(client.acquire("k", wait=60))
                while True:
                    status = await client.query("k")
                    if status.waiters == 1:
                        break
                    await asyncio.sleep(0.001)
                waiting.cancel()
                try:
                    await waiting
                except asyncio.CancelledError:
                    pass
                # The wait left the server's queue at once.
                started = time.monotonic()
                while (await client.query("k")).waiters != 0:
                    assert time.monotonic() - started < 0.5, "still queued"
                    await asyncio.sleep(0.001)
            # Queued acquires still work, on this key and on another.
            late = asyncio.ensure_future(client.acquire("k", wait=10))
            await asyncio.sleep(0.05)
            await holder.release()
            ticket = await late
            await ticket.release()
            if bystander is not None:
                await other.release()
                ticket = await bystander
                await ticket.release()
            info = await client.info()
            print("ok", info["waiters"], info["held"], flush=True)

    asyncio.run(main())
"""


@pytest.mark.parametrize("python", PYTHONS)
def test_cancelled_waits_leave_the_queue_at_once(start_server, python):
    # A server that allows 8 queued waits per connection: 20 cancelled
    # waits would have used them all.
    server = start_server("--max-waits-per-conn", "8")
    status, out, err, _ = run_script(python, CANCELLED_WAITS, server.address, "20", "bystander")
    assert status == 0, err
    assert out.split() == ["ok", "0", "0"], out + err
    assert "Traceback" not in err, err


def test_cancelled_waits_alone_leave_the_queue_at_once(start_server):
    server = start_server("--max-waits-per-conn", "8")
    status, out, err, _ = run_script(sys.executable, CANCELLED_WAITS, server.address, "20",
                                     "alone")
    assert status == 0, err
    assert out.split() == ["ok", "0", "0"], out + err
    assert "Traceback" not in err, err


def test_4096_cancelled_waits_then_acquires_still_work(server):
    status, out, err, took = run_script(sys.executable, CANCELLED_WAITS, server.address,
                                        "4100", "alone", timeout=120)
    assert status == 0, err
    assert out.split() == ["ok", "0", "0"], out + err
