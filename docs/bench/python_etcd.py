#!/usr/bin/env python3
"""Python on etcd: `kunci.Client` / `kunci.aio.Client` on `etcd://` vs
etcd3gw's `Lock` (pure Python over the same JSON gateway) vs the Rust
client (`kunci bench`), on one 3-member loopback etcd cluster, in one run.

Workloads (each for DURATION seconds per side, RUNS times, sides
interleaved; the medians are printed):

  pairs 1      one thread: acquire (no wait) + release on one key, in a loop
               etcd3gw: lock = client.lock(key, ttl=30); lock.acquire(); lock.release()
               kunci:   client.acquire(key, wait=0, lease=30).release()
               Rust:    kunci bench pairs --connections 1
  pairs 100    100 at once, each on its own key
               kunci:   100 asyncio tasks on one kunci.aio.Client
               etcd3gw: 100 threads (it has no asyncio API)
               Rust:    kunci bench pairs --connections 100 (a thread each)
  hot          50 threads on ONE key, each: take it (waiting), hold 1 ms, let
               go; for HOT_DURATION seconds. Hand-overs/s, p99 wait, fewest
               and most acquisitions of one thread.
               kunci:   with client.lock("hot", wait=60, lease=30)
               etcd3gw: a fresh client.lock("hot", ttl=30) polled with
                        acquire() every S seconds (it has no blocking
                        acquire), S = 0.1 and S = 0.001

Needs etcd on PATH, the release binary (KUNCI_BIN, else target/release/kunci)
and etcd3gw in the running Python, e.g.

    python3 -m venv /tmp/venv && /tmp/venv/bin/pip install etcd3gw
    /tmp/venv/bin/python docs/bench/python_etcd.py   # RUNS=3 DURATION=5 HOT_DURATION=10
"""

import asyncio
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import kunci  # noqa: E402
import kunci.aio  # noqa: E402
from etcd3gw.client import Etcd3Client  # noqa: E402

RUNS = int(os.environ.get("RUNS", "3"))
DURATION = float(os.environ.get("DURATION", "5"))
HOT_DURATION = float(os.environ.get("HOT_DURATION", "10"))
TASKS = 100
HOT_THREADS = 50
HOLD = 0.001
KUNCI_BIN = os.environ.get("KUNCI_BIN") or os.path.join(ROOT, "target", "release", "kunci")


def free_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def start_etcd(directory, size=3):
    """``size`` members on loopback with etcd's default timing."""
    peers = [("m%d" % i, free_port(), free_port()) for i in range(size)]
    initial = ",".join("%s=http://127.0.0.1:%d" % (n, p) for n, _, p in peers)
    processes = []
    for name, client, peer in peers:
        processes.append(subprocess.Popen(
            ["etcd", "--name", name, "--data-dir", os.path.join(directory, name),
             "--listen-client-urls", "http://127.0.0.1:%d" % client,
             "--advertise-client-urls", "http://127.0.0.1:%d" % client,
             "--listen-peer-urls", "http://127.0.0.1:%d" % peer,
             "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer,
             "--initial-cluster", initial, "--initial-cluster-state", "new"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    endpoints = ["127.0.0.1:%d" % client for _, client, _ in peers]
    address = "etcd://" + ",".join(endpoints)
    client = kunci.Client(address)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.acquire("warm-up", lease=2).release()
            break
        except kunci.Error:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    client.close()
    return processes, endpoints, address


def timed_loop(step, duration):
    count = 0
    end = time.monotonic() + duration
    while time.monotonic() < end:
        step()
        count += 1
    return count / duration


def threaded(count, step, duration):
    totals = [0] * count

    def run(index):
        end = time.monotonic() + duration
        while time.monotonic() < end:
            step(index)
            totals[index] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(totals) / duration


def kunci_pairs(address):
    client = kunci.Client(address)
    rate = timed_loop(lambda: client.acquire("pair", wait=0, lease=30).release(), DURATION)
    client.close()
    return rate


def kunci_tasks(address):
    async def main():
        client = kunci.aio.Client(address)
        done = [0]
        end = time.monotonic() + DURATION

        async def task(index):
            key = "task-%d" % index
            while time.monotonic() < end:
                ticket = await client.acquire(key, wait=0, lease=30)
                await ticket.release()
                done[0] += 1

        await asyncio.gather(*(task(i) for i in range(TASKS)))
        await client.close()
        return done[0] / DURATION

    return asyncio.run(main())


def gw_client(endpoints, index=0):
    host, port = endpoints[index % len(endpoints)].rsplit(":", 1)
    return Etcd3Client(host=host, port=int(port), api_path="/v3/")


def gw_pairs(endpoints):
    client = gw_client(endpoints)

    def step():
        lock = client.lock("gw-pair", ttl=30)
        if not lock.acquire():
            raise RuntimeError("etcd3gw: the free key was not acquired")
        lock.release()

    return timed_loop(step, DURATION)


def gw_threads(endpoints):
    clients = [gw_client(endpoints) for _ in range(TASKS)]

    def step(index):
        lock = clients[index].lock("gw-task-%d" % index, ttl=30)
        if lock.acquire():
            lock.release()

    return threaded(TASKS, step, DURATION)


def rust_pairs(address, connections):
    done = subprocess.run(
        [KUNCI_BIN, "bench", "pairs", "--server", address, "--connections", str(connections),
         "--duration", str(DURATION), "--warmup", "1"],
        capture_output=True, text=True, timeout=DURATION + 120)
    found = re.search(r"^\s*pairs\s+\d+\s+([0-9.]+) /s", done.stdout, re.M)
    if found is None:
        raise RuntimeError("kunci bench said:\n%s%s" % (done.stdout, done.stderr))
    return float(found.group(1))


def hot(take_and_release):
    """50 threads on one key: ``take_and_release(thread, hold)`` calls
    ``hold()`` while it holds the key and says whether it got it."""
    counts = [0] * HOT_THREADS
    waits = []
    lock = threading.Lock()
    end = time.monotonic() + HOT_DURATION

    def run(index):
        while time.monotonic() < end:
            started = time.monotonic()

            def hold():
                with lock:
                    waits.append(time.monotonic() - started)
                time.sleep(HOLD)

            if take_and_release(index, hold):
                counts[index] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(HOT_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    waits.sort()
    p99 = waits[int(len(waits) * 0.99)] if waits else float("nan")
    return sum(counts) / HOT_DURATION, p99 * 1000, min(counts), max(counts)


def kunci_hot(address):
    client = kunci.Client(address)

    def take(_, hold):
        with client.lock("hot", wait=60, lease=30):
            hold()
        return True

    try:
        return hot(take)
    finally:
        client.close()


def gw_hot(endpoints, sleep):
    clients = [gw_client(endpoints, i) for i in range(HOT_THREADS)]

    def take(index, hold):
        lock = clients[index].lock("gw-hot", ttl=30)
        give_up = time.monotonic() + 60
        while not lock.acquire():
            if time.monotonic() > give_up:
                return False
            time.sleep(sleep)
        try:
            hold()
        finally:
            lock.release()
        return True

    return hot(take)


def median(values):
    values = sorted(values)
    return values[len(values) // 2]


def main():
    if shutil.which("etcd") is None:
        sys.exit("etcd is not on PATH")
    directory = tempfile.mkdtemp(prefix="kunci-bench-etcd-")
    processes, endpoints, address = start_etcd(directory)
    pairs = {}
    hots = {}
    try:
        for run in range(RUNS):
            for name, measure in [
                ("etcd3gw Lock, 1 thread", lambda: gw_pairs(endpoints)),
                ("kunci.Client, 1 thread", lambda: kunci_pairs(address)),
                ("Rust client, 1 thread", lambda: rust_pairs(address, 1)),
                ("etcd3gw Lock, 100 threads", lambda: gw_threads(endpoints)),
                ("kunci.aio.Client, 100 tasks", lambda: kunci_tasks(address)),
                ("Rust client, 100 threads", lambda: rust_pairs(address, TASKS)),
            ]:
                rate = measure()
                pairs.setdefault(name, []).append(rate)
                print("run %d  %-30s %8.0f pairs/s" % (run + 1, name, rate), flush=True)
            for name, measure in [
                ("kunci client.lock", lambda: kunci_hot(address)),
                ("etcd3gw Lock, poll 0.1 s", lambda: gw_hot(endpoints, 0.1)),
                ("etcd3gw Lock, poll 0.001 s", lambda: gw_hot(endpoints, 0.001)),
            ]:
                result = measure()
                hots.setdefault(name, []).append(result)
                print("run %d  hot %-26s %6.1f/s  p99 %7.0f ms  min %d max %d"
                      % ((run + 1, name) + result), flush=True)
                time.sleep(1)
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)
    print("\nmedians of %d runs (pairs: %g s each; hot key: %g s each)" % (
        RUNS, DURATION, HOT_DURATION))
    print("| workload | pairs/s |\n|---|---:|")
    for name, rates in pairs.items():
        print("| %s | %s |" % (name, format(round(median(rates)), ",")))
    print("\n| hot key: 50 threads, hold 1 ms | hand-overs/s | p99 wait | "
          "acquisitions per thread, min / max |\n|---|---:|---:|---:|")
    for name, results in hots.items():
        print("| %s | %.0f | %s ms | %d / %d |" % (
            name, median([r[0] for r in results]),
            format(round(median([r[1] for r in results])), ","),
            median([r[2] for r in results]), median([r[3] for r in results])))


if __name__ == "__main__":
    main()
