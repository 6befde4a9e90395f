"""Permits (spec §10) end to end: both Python clients against a real
`kunci serve`: a semaphore's limit, counted takes, `LimitMismatch` with the
key's limit, shared holders and a writer queued between readers (strict
FIFO), one keep-alive per shared grant, a label on an exclusive lock."""

import threading
import time

import pytest

import kunci
from conftest import outcome, wait_for


def test_a_semaphore_grants_up_to_its_limit(server, make_client):
    client = make_client(server.address)
    first = client.acquire("backups", limit=2, label="backup 1")
    second = client.acquire("backups", limit=2, label="backup 2")
    assert (first.take, first.limit) == (1, 2)
    assert second.token > first.token
    kind, elapsed, _ = outcome(client.acquire, "backups", limit=2)
    assert kind is kunci.Timeout and elapsed < 1
    # A waiter is granted when a permit is freed.
    released_from = time.monotonic()
    threading.Timer(0.3, first.release).start()
    kind, elapsed, third = outcome(client.acquire, "backups", wait=5, limit=2)
    assert kind == "ok" and elapsed < 2
    assert time.monotonic() - released_from >= 0.3
    assert third.token > second.token
    assert client.info()["grants_held"] == 2
    second.release()
    third.release()
    assert client.query("backups") is None


def test_take_counts_permits(server, make_client):
    client = make_client(server.address)
    big = client.acquire("pool", limit=5, take=3)
    small = client.acquire("pool", limit=5, take=2)
    kind, _, _ = outcome(client.acquire, "pool", limit=5, take=1)
    assert kind is kunci.Timeout
    big.release()
    kind, _, again = outcome(client.acquire, "pool", limit=5, take=3)
    assert kind == "ok"
    small.release()
    again.release()


def test_a_different_limit_is_a_limit_mismatch_and_queues_nothing(server, make_client):
    client = make_client(server.address)
    holder = client.acquire("backups", limit=3)
    kind, elapsed, error = outcome(client.acquire, "backups", wait=10, limit=4)
    assert kind is kunci.LimitMismatch and elapsed < 1
    assert error.limit == 3
    assert client.query("backups").waiters == 0
    # An exclusive request names no limit: it never mismatches, it waits.
    kind, elapsed, _ = outcome(client.acquire, "backups", wait=1)
    assert kind is kunci.Timeout and elapsed >= 1
    holder.release()


def test_shared_holders_overlap_and_a_queued_writer_goes_before_later_readers(
        server, make_client):
    client = make_client(server.address)
    reader_1 = client.acquire("catalog", shared=True)
    reader_2 = client.acquire("catalog", shared=True)
    assert (reader_2.take, reader_2.limit) == (1, 65535)
    order = []

    def writer():
        ticket = client.acquire("catalog", wait=10)
        order.append(("writer", ticket.token))
        time.sleep(0.2)
        ticket.release()

    def late_reader():
        ticket = client.acquire("catalog", wait=10, shared=True)
        order.append(("reader", ticket.token))
        ticket.release()

    threads = [threading.Thread(target=writer)]
    threads[0].start()
    wait_for(lambda: client.query("catalog").waiters == 1, 2)
    threads.append(threading.Thread(target=late_reader))
    threads[1].start()
    wait_for(lambda: client.query("catalog").waiters == 2, 2)
    # Readers after a queued writer do not overtake it.
    kind, _, _ = outcome(client.acquire, "catalog", shared=True)
    assert kind is kunci.Timeout
    reader_1.release()
    time.sleep(0.2)
    assert order == []
    reader_2.release()
    for thread in threads:
        thread.join(10)
    assert [who for who, _ in order] == ["writer", "reader"]
    assert order[0][1] < order[1][1]
    assert order[0][1] > reader_2.token


def test_each_shared_lock_is_kept_alive_on_its_own(server, make_client):
    client = make_client(server.address)
    with client.lock("catalog", lease=1, shared=True) as first:
        with client.lock("catalog", lease=1, shared=True, label="second") as second:
            time.sleep(2.5)
            first.check()
            second.check()
            assert client.info()["grants_held"] == 2
    info = client.info()
    assert info["released"] == 2 and info["expired"] == 0


def test_a_label_is_accepted_with_an_exclusive_lock(server, make_client):
    client = make_client(server.address)
    ticket = client.acquire("deploy", label="ci job 42 on runner-7")
    assert (ticket.take, ticket.limit) == (0, None)
    assert client.query("deploy").token == ticket.token
    ticket.release()
