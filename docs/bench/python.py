#!/usr/bin/env python3
"""What Python users run today against kunci's Python client, one run:
redis-py's `Lock` on Redis vs `kunci.Client` on kunci, same machine.

Workloads (each for DURATION seconds, per side):

  pairs        one thread: acquire (no wait) + release on one key, in a loop
               redis:  r.lock(key, timeout=30).acquire(blocking=False); release()
               kunci:  client.acquire(key, wait=0, lease=30).release()
  tasks        100 asyncio tasks, each on its own key, the same loop
               redis:  redis.asyncio (a connection per concurrent task)
               kunci:  kunci.aio.Client (one connection, pipelined)
  hot          50 threads on ONE key, each: take it (waiting), hold 1 ms, let
               go; for HOT_DURATION seconds. Reports hand-overs/s, the p99
               wait, and the fewest/most acquisitions of one thread.
               kunci:  with client.lock("hot", wait=60, lease=30)
               redis:  with r.lock("hot", timeout=30, blocking=True,
                                   blocking_timeout=60, sleep=S)
                       for S = 0.1 (redis-py's default) and S = 0.001

Starts `kunci serve` (KUNCI_BIN, else target/release/kunci) and
`redis-server` (no persistence) on free loopback ports and stops both.
Needs `pip install redis` and redis-server on PATH.

    python3 docs/bench/python.py            # DURATION=5 HOT_DURATION=20
"""

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "clients", "python"))

import kunci  # noqa: E402
import kunci.aio  # noqa: E402
import redis  # noqa: E402
import redis.asyncio  # noqa: E402

DURATION = float(os.environ.get("DURATION", "5"))
HOT_DURATION = float(os.environ.get("HOT_DURATION", "20"))
TASKS = 100
HOT_THREADS = 50
HOLD = 0.001


def free_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def start_kunci():
    binary = os.environ.get("KUNCI_BIN") or os.path.join(ROOT, "target", "release", "kunci")
    proc = subprocess.Popen([binary, "serve", "--no-state-dir", "--listen", "127.0.0.1:0"], stderr=subprocess.PIPE)
    while True:
        line = proc.stderr.readline().decode()
        if not line:
            raise SystemExit("kunci serve did not start")
        found = re.search(r"listening on (\S+);", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, found.group(1)


def start_redis():
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--loglevel", "warning"],
        stdout=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.02)
    raise SystemExit("redis-server did not start")


# ------------------------------------------------------------------ pairs


def pairs_redis(port):
    r = redis.Redis(port=port)
    done = 0
    end = time.monotonic() + DURATION
    while time.monotonic() < end:
        lock = r.lock("pair", timeout=30)
        if not lock.acquire(blocking=False):
            raise SystemExit("redis lock not acquired")
        lock.release()
        done += 1
    return done / DURATION


def pairs_kunci(address):
    client = kunci.Client(address)
    done = 0
    end = time.monotonic() + DURATION
    while time.monotonic() < end:
        client.acquire("pair", wait=0, lease=30).release()
        done += 1
    client.close()
    return done / DURATION


# ------------------------------------------------------------------ tasks


async def tasks_redis(port):
    r = redis.asyncio.Redis(port=port)
    counts = [0] * TASKS
    end = time.monotonic() + DURATION

    async def task(n):
        key = "task-%d" % n
        while time.monotonic() < end:
            lock = r.lock(key, timeout=30)
            if not await lock.acquire(blocking=False):
                raise SystemExit("redis lock not acquired")
            await lock.release()
            counts[n] += 1

    await asyncio.gather(*[task(n) for n in range(TASKS)])
    await r.aclose()
    return sum(counts) / DURATION


async def tasks_kunci(address):
    client = kunci.aio.Client(address)
    counts = [0] * TASKS
    end = time.monotonic() + DURATION

    async def task(n):
        key = "task-%d" % n
        while time.monotonic() < end:
            ticket = await client.acquire(key, wait=0, lease=30)
            await ticket.release()
            counts[n] += 1

    await asyncio.gather(*[task(n) for n in range(TASKS)])
    await client.close()
    return sum(counts) / DURATION


# -------------------------------------------------------------------- hot


def hot(take):
    """``take()`` returns a context manager that holds the hot key."""
    waits = [[] for _ in range(HOT_THREADS)]
    start_gate = threading.Event()
    end = [0.0]

    def worker(n):
        start_gate.wait()
        mine = waits[n]
        while True:
            asked = time.monotonic()
            if asked >= end[0]:
                return
            with take():
                mine.append(time.monotonic() - asked)
                time.sleep(HOLD)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(HOT_THREADS)]
    for thread in threads:
        thread.start()
    end[0] = time.monotonic() + HOT_DURATION
    start_gate.set()
    for thread in threads:
        thread.join()
    elapsed = HOT_DURATION
    every = sorted(w for mine in waits for w in mine)
    counts = [len(mine) for mine in waits]
    p99 = every[min(len(every) - 1, int(len(every) * 0.99))] if every else float("nan")
    return {
        "handovers_per_s": len(every) / elapsed,
        "p99_wait_ms": p99 * 1000,
        "min_per_thread": min(counts),
        "max_per_thread": max(counts),
    }


def hot_kunci(address):
    client = kunci.Client(address)
    result = hot(lambda: client.lock("hot", wait=60, lease=30))
    client.close()
    return result


def hot_redis(port, sleep):
    r = redis.Redis(port=port, max_connections=HOT_THREADS + 10)
    return hot(lambda: r.lock("hot", timeout=30, blocking=True, blocking_timeout=60, sleep=sleep))


def main():
    kunci_proc, kunci_address = start_kunci()
    redis_proc, redis_port = start_redis()
    print("# python %s, kunci client %s, redis-py %s, %s" % (
        sys.version.split()[0], kunci.__version__, redis.__version__,
        subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]))
    print("# DURATION=%gs HOT_DURATION=%gs, %d CPUs" % (DURATION, HOT_DURATION, os.cpu_count()))
    try:
        rows = []
        r = pairs_redis(redis_port)
        k = pairs_kunci(kunci_address)
        rows.append(("pairs/s, 1 thread", r, k))
        r = asyncio.run(tasks_redis(redis_port))
        k = asyncio.run(tasks_kunci(kunci_address))
        rows.append(("pairs/s, %d asyncio tasks" % TASKS, r, k))
        print("| workload | redis-py Lock | kunci | kunci / redis |")
        print("|---|---:|---:|---:|")
        for name, r, k in rows:
            print("| %s | %.0f | %.0f | %.2f× |" % (name, r, k, k / r))
        print()
        results = [("kunci `client.lock`", hot_kunci(kunci_address))]
        for sleep in (0.1, 0.001):
            results.append(("redis-py `Lock` sleep=%g" % sleep, hot_redis(redis_port, sleep)))
        print("| hot key, %d threads, hold 1 ms, %gs | hand-overs/s | p99 wait | min / max acquisitions per thread |"
              % (HOT_THREADS, HOT_DURATION))
        print("|---|---:|---:|---:|")
        for name, result in results:
            print("| %s | %.0f | %.0f ms | %d / %d |" % (
                name, result["handovers_per_s"], result["p99_wait_ms"],
                result["min_per_thread"], result["max_per_thread"]))
    finally:
        for proc in (kunci_proc, redis_proc):
            proc.terminate()
            proc.wait(10)


if __name__ == "__main__":
    main()
