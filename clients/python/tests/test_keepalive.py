"""Spec §8 rule 10: managed keep-alive, for both clients."""

import time

import pytest

import kunci
from conftest import wait_for


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
        wait_for(lambda: ticket.lost, 2)
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
        wait_for(lambda: ticket.lost, 3)
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
