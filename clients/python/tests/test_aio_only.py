"""The asyncio client: cancellation, a late grant, many tasks, fork."""

import asyncio
import os
import time

import pytest

import kunci
import kunci.aio
from conftest import free_port


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 30))


async def until(predicate, timeout, interval=0.01):
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            pytest.fail("condition not met within %.1f s" % timeout)
        await asyncio.sleep(interval)


def test_cancelled_waiting_acquire_leaves_the_queue_at_once(server):
    async def main():
        async with kunci.aio.Client(server.address) as client:
            holder = await client.acquire("k")
            waiting = asyncio.ensure_future(client.acquire("k", wait=10))
            await until(lambda: _waiters(client, 1), 2)
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            # Its session ended: the server dropped the wait at once.
            await until(lambda: _waiters(client, 0), 0.5)
            await holder.release()
            await until(lambda: _is_free(client), 2)
            info = await client.info()
            assert info["grants"] == 1 and info["released"] == 1 and info["held"] == 0

    run(main())


async def _waiters(client, count, key="k"):
    status = await client.query(key)
    return status is not None and status.waiters == count


async def _connections_at_most(client, count):
    return (await client.info())["connections"] <= count


async def _is_free(client):
    return await client.query("k") is None


def test_cancelled_acquire_whose_grant_is_arriving_releases_it(server):
    async def main():
        async with kunci.aio.Client(server.address) as client:
            await client.ping()
            task = asyncio.ensure_future(client.acquire("k"))
            await asyncio.sleep(0)  # the request is written
            time.sleep(0.05)  # the grant arrives, unread
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await until(lambda: _is_free(client), 2)
            info = await client.info()
            assert info["grants"] == 1 and info["released"] == 1

    run(main())


def test_cancelled_waiting_acquires_whose_answers_came_keep_no_connection(server):
    # The answer (a grant) has arrived when the task is cancelled: the
    # grant is released and the acquire's own session is kept for the next
    # waiting acquire, or closed; never left open and unused.
    async def main():
        async with kunci.aio.Client(server.address) as client:
            other = await client.acquire("other")
            # It waits on the shared session: the others get their own.
            bystander = asyncio.ensure_future(client.acquire("other", wait=30))
            await until(lambda: _waiters(client, 1, "other"), 2)
            cancelled = 0
            for _ in range(20):
                task = asyncio.ensure_future(client.acquire("k", wait=5))
                while not any(s.pending.calls() for s in client._private):
                    await asyncio.sleep(0)  # until written
                time.sleep(0.02)  # the grant arrives, unread
                task.cancel()
                try:
                    await (await task).release()
                except asyncio.CancelledError:
                    cancelled += 1
                await until(lambda: _is_free(client), 2)
            assert cancelled > 0
            await until(lambda: _connections_at_most(client, 1 + kunci.aio._IDLE_PRIVATE_MAX), 2)
            await other.release()
            await (await bystander).release()

    run(main())


def test_cancelled_before_sending_sends_nothing(server):
    async def main():
        # Nothing listens at the first address: the call is still
        # connecting when it is cancelled.
        client = kunci.aio.Client(["127.0.0.1:%d" % free_port()])
        task = asyncio.ensure_future(client.acquire("k"))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await client.close()

    run(main())
    assert kunci.Client(server.address).info()["grants"] == 0


def test_grant_noticed_after_the_deadline_is_released(server):
    # The event loop is blocked while the grant arrives; when it runs again
    # D has passed: the grant is not handed over but released (rule 7),
    # and the session stays open.
    async def main():
        async with kunci.aio.Client(server.address) as client:
            await client.ping()
            task = asyncio.ensure_future(client.acquire("k", wait=0))
            await asyncio.sleep(0)
            time.sleep(kunci.TRANSPORT_DEADLINE + 0.2)
            with pytest.raises(kunci.Indeterminate):
                await task
            await until(lambda: _is_free(client), 2)
            info = await client.info()
            assert info["grants"] == 1 and info["released"] == 1
            assert info["connections"] == 1

    run(main())


def test_timeout_noticed_after_the_deadline_is_still_timeout(server):
    async def main():
        async with kunci.aio.Client(server.address) as client:
            holder = await client.acquire("k")
            task = asyncio.ensure_future(client.acquire("k", wait=0))
            await asyncio.sleep(0)
            time.sleep(kunci.TRANSPORT_DEADLINE + 0.2)
            with pytest.raises(kunci.Timeout):
                await task
            assert (await client.query("k")).token == holder.token
            await holder.release()

    run(main())


def test_many_tasks_one_key(server):
    async def main():
        async with kunci.aio.Client(server.address) as client:
            inside = []
            overlaps = []
            tokens = []

            async def worker(n):
                for _ in range(10):
                    async with client.lock("hot", wait=10, lease=5) as ticket:
                        inside.append(n)
                        if len(inside) > 1:
                            overlaps.append(list(inside))
                        await asyncio.sleep(0.001)
                        inside.remove(n)
                        tokens.append(ticket.token)

            await asyncio.gather(*[worker(n) for n in range(30)])
            assert overlaps == []
            assert len(set(tokens)) == 300
            assert tokens == sorted(tokens)
            info = await client.info()
            assert info["released"] == 300
            # One session for every call that does not wait, and the idle
            # sessions of waiting acquires that the client keeps.
            await until(lambda: _connections_at_most(client, 1 + kunci.aio._IDLE_PRIVATE_MAX), 2)

    run(main())


def test_forked_child_never_touches_the_parents_lock(server):
    client = kunci.aio.Client(server.address)

    async def hold():
        ticket = await client.acquire("k", lease=5)
        return ticket

    loop = asyncio.new_event_loop()
    ticket = loop.run_until_complete(hold())
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            async def child():
                report = [ticket.lost]
                try:
                    await ticket.release()
                    report.append("released")
                except kunci.Error as error:
                    report.append(type(error).__name__)
                report.append((await client.query("k")).token == ticket.token)
                return report

            report = asyncio.run(child())
            status = 0 if report == [True, "Error", True] else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    loop.run_until_complete(ticket.release())
    info = loop.run_until_complete(client.info())
    assert info["released"] == 1 and info["not_held"] == 0
    loop.run_until_complete(client.close())
    loop.close()


def test_cancelled_wait_on_the_shared_session_lets_its_other_calls_finish(server, make_proxy):
    # A query is under way on the shared session when the acquire waiting
    # there is cancelled: the query gets its answer, new calls go to a new
    # session, and the wait leaves the queue once the query is answered.
    proxy = make_proxy(server.port)

    async def main():
        async with kunci.aio.Client(proxy.address) as client:
            holder = kunci.Client(server.address)
            held = holder.acquire("k", lease=30)
            waiting = asyncio.ensure_future(client.acquire("k", wait=30))
            await until(lambda: _waiters(client, 1), 2)
            proxy.down_delay = 0.3
            query = asyncio.ensure_future(client.query("k"))
            await asyncio.sleep(0.05)  # the query is written
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            assert (await query).token == held.token  # answered, not Indeterminate
            proxy.down_delay = 0.0
            started = time.monotonic()
            while holder.query("k").waiters != 0:
                assert time.monotonic() - started < 1.0
                await asyncio.sleep(0.01)
            await client.ping()
            assert proxy.accepted == 2
            held.release()
            holder.close()

    run(main())
