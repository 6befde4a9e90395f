"""Spec §8 rule 10: managed keep-alive, for both clients."""

import struct
import threading
import time

import pytest

import kunci
from conftest import Proxy, free_port, request_frames, wait_for


def test_keepalive_holds_the_lock_past_its_lease(server, make_client):
    client = make_client(server.address)
    lost = []
    with client.lock("k", lease=1, on_lost=lost.append) as ticket:
        time.sleep(2.5)
        ticket.check()
        assert ticket.is_valid() and not ticket.lost
        assert client.query("k").token == ticket.token
        # Renewed every lease/3: about 7 renewals in 2.5 s.
        assert client.info()["extended"] >= 5
    assert lost == []
    info = client.info()
    assert info["released"] == 1 and info["expired"] == 0 and info["held"] == 0


def test_lost_when_a_renewal_is_answered_not_held(server, make_client):
    client = make_client(server.address)
    other = make_client(server.address)
    lost = []
    with client.lock("k", lease=3, on_lost=lambda t: lost.append((time.monotonic(), t.token))) as ticket:
        # Someone releases the token (any holder of it may): the next
        # renewal, within lease/3, is answered N.
        other.release("k", ticket.token)
        released_at = time.monotonic()
        # on_lost runs after `lost` is set (on the event loop's thread for
        # kunci.aio): wait for the callback itself.
        wait_for(lambda: lost, 2)
        assert ticket.lost
        assert len(lost) == 1 and lost[0][1] == ticket.token
        assert lost[0][0] - released_at < 1.0 + 0.5
        assert not ticket.is_valid()
        with pytest.raises(kunci.LockLost):
            ticket.check()
        time.sleep(1.2)  # renewal stopped: no second N
    # Leaving the block after a loss raises nothing and sends nothing.
    assert len(lost) == 1
    info = client.info()
    assert info["not_held"] == 1 and info["released"] == 1
    with pytest.raises(kunci.LockLost):
        ticket.release()
    assert client.info()["not_held"] == 1


def test_lost_when_renewals_go_unanswered_until_valid_until(server, make_proxy, make_client):
    proxy = make_proxy(server.port)
    client = make_client(proxy.address)
    other = make_client(server.address)
    lost = []
    with client.lock("k", lease=1, on_lost=lambda t: lost.append(time.monotonic())) as ticket:
        time.sleep(0.5)
        proxy.up = "drop"
        proxy.down = "drop"
        bound = ticket.valid_until
        blackholed_at = time.monotonic()
        wait_for(lambda: lost, 3)
        assert ticket.lost
        # Never declared lost before valid_until, and at once after it.
        assert len(lost) == 1
        assert lost[0] >= bound
        assert lost[0] - blackholed_at < 1.0 + 1.0
        with pytest.raises(kunci.LockLost):
            ticket.check()
        # The server ends the lease and hands the key on.
        successor = other.acquire("k", wait=3)
        assert successor.token > ticket.token
        successor.release()
    assert len(lost) == 1


def test_unmanaged_ticket_check_follows_valid_until(server, make_client):
    client = make_client(server.address)
    ticket = client.acquire("k", lease=1)
    ticket.check()
    wait_for(lambda: not ticket.is_valid(), 2)
    assert time.monotonic() >= ticket.valid_until
    with pytest.raises(kunci.LockLost):
        ticket.check()
    assert ticket.lost


# ------------------------------------------- a grant that comes late (rule 10)


def test_a_late_grant_is_renewed_before_it_is_handed_over(server, make_client):
    # Issue 18: A holds the key past the whole lease of B's request, so B's
    # grant comes after the valid_until counted from B's send instant.
    # Before the fix, B entered the block with a lock already counted as
    # lost (is_valid() false, check() raising) and sent no release at the
    # end, so the key stayed held for another lease.
    holder = make_client(server.address)
    waiter = make_client(server.address)
    first = holder.acquire("late", lease=30)
    released = []

    def release_first():
        released.append(time.monotonic())
        first.release()

    # Read before the timer starts: the release comes 1.6 s after that.
    sent_before = time.monotonic()
    timer = threading.Timer(1.6, release_first)
    timer.start()
    try:
        with waiter.lock("late", wait=10, lease=1) as ticket:
            entered = time.monotonic()
            assert entered - sent_before >= 1.6
            # Handed over valid, renewed after the grant: the renewal was
            # sent after the first holder's release.
            assert ticket.is_valid() and not ticket.lost
            ticket.check()
            assert ticket.valid_until >= released[0] + 1 - kunci.drift_margin(1)
            assert ticket.token > first.token
            assert waiter.query("late").token == ticket.token
            assert waiter.info()["extended"] >= 1
    finally:
        timer.join()
    # Leaving the block released the key at once.
    assert waiter.query("late") is None
    info = waiter.info()
    assert info["released"] == 2 and info["not_held"] == 0 and info["expired"] == 0


def test_a_grant_that_comes_early_is_handed_over_without_a_renewal(server, make_client):
    client = make_client(server.address)
    with client.lock("soon", wait=10, lease=30) as ticket:
        ticket.check()
        assert client.info()["extended"] == 0


def late_grant_server(make_proxy, renewal_answer, delay):
    """A fake server that grants every acquire (token 77) ``delay`` seconds
    after it came, answers each renewal with ``renewal_answer(frame)``
    (bytes, or ``Proxy.CLOSE``) and each release with ``R``."""
    proxy = make_proxy(free_port())
    proxy.accept = "respond"

    def respond(data):
        answer = b""
        for op, header, _ in request_frames(data):
            if op == b"A":
                time.sleep(delay)
                answer += b"A" + header[2:10] + struct.pack(">Q", 77) + b"\n"
            elif op == b"E":
                renewal = renewal_answer(header)
                if renewal is Proxy.CLOSE:
                    return renewal
                answer += renewal
            elif op == b"R":
                answer += b"R" + header + b"\n"
        return answer

    proxy.responder = respond
    return proxy


def sent_ops(proxy):
    return [(op, header) for op, header, _ in request_frames(proxy.upstream_bytes())]


def test_a_late_grant_whose_renewal_is_answered_not_held_is_not_handed_over(
        make_proxy, make_client):
    # Granted 1.2 s after a request with a 1 s lease; the renewal finds the
    # grant gone.
    proxy = late_grant_server(make_proxy, lambda header: b"N" + header[1:9] + b"\n", 1.2)
    client = make_client(proxy.address)
    entered = []
    lost = []
    with pytest.raises(kunci.LockLost, match="answered N"):
        with client.lock("late", wait=5, lease=1, on_lost=lost.append):
            entered.append(True)
    assert entered == [] and lost == []
    time.sleep(0.3)
    # An acquire, one renewal of token 77, and no release (N: nothing held).
    ops = sent_ops(proxy)
    assert [op for op, _ in ops] == [b"A", b"E"]
    assert ops[1][1] == bytes([1]) + struct.pack(">Q", 77)


def test_a_late_grant_whose_renewal_has_no_outcome_is_released_not_handed_over(
        make_proxy, make_client):
    # The renewal's connection dies (Indeterminate) and valid_until has
    # passed: the lock counts as lost, nothing is handed over, and the
    # grant (which the server may still hold) is released.
    proxy = late_grant_server(make_proxy, lambda header: Proxy.CLOSE, 1.2)
    client = make_client(proxy.address)
    with pytest.raises(kunci.LockLost, match="could not be renewed"):
        with client.lock("late", wait=5, lease=1):
            pytest.fail("a lost lock was handed over")
    wait_for(lambda: len(sent_ops(proxy)) == 3, 3)
    ops = sent_ops(proxy)
    assert [op for op, _ in ops] == [b"A", b"E", b"R"]
    assert ops[2][1] == struct.pack(">Q", 77)


def test_a_late_grant_still_valid_is_handed_over_when_its_renewal_has_no_outcome(
        make_proxy, make_client):
    # Lease 3 s, granted 1.2 s late: 1.8 s left (< 2/3), so it is renewed
    # first. That renewal's connection dies, but valid_until is ahead: the
    # lock is handed over and the keep-alive renews it again at once.
    answers = []

    def renewal(header):
        answers.append(header)
        if len(answers) == 1:
            return Proxy.CLOSE
        return b"E" + header[1:9] + b"\n"

    proxy = late_grant_server(make_proxy, renewal, 1.2)
    client = make_client(proxy.address)
    start = time.monotonic()
    with client.lock("late", wait=5, lease=3) as ticket:
        assert ticket.is_valid()
        wait_for(lambda: len(answers) == 2, 2)
        # The second renewal was sent after the grant (1.2 s in).
        wait_for(lambda: ticket.valid_until > start + 1.2 + 3 - kunci.drift_margin(3), 2)
    ops = [op for op, _ in sent_ops(proxy)]
    assert ops[:3] == [b"A", b"E", b"E"] and ops[-1] == b"R"
