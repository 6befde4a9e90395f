"""Spec §8, rule by rule, against a real server, for both clients (the
``make_client`` fixture runs each test with the sync and the asyncio
client)."""

import math
import os
import re
import socket
import struct
import tempfile
import threading
import time

import pytest

import kunci
from conftest import free_port, outcome, request_frames, wait_for


# ------------------------------------------------------------- results


def test_acquire_release_query_info_ping(server, make_client):
    client = make_client(server.address)
    before = time.monotonic()
    ticket = client.acquire("deploy", wait=0, lease=30)
    after = time.monotonic()
    assert ticket.key == "deploy"
    assert ticket.lease == 30
    # valid_until: the send instant + lease − (10 ms + lease/500).
    margin = kunci.drift_margin(30)
    assert margin == pytest.approx(0.070)
    assert before + 30 - margin <= ticket.valid_until <= after + 30 - margin
    assert ticket.is_valid() and not ticket.lost
    ticket.check()

    status = client.query("deploy")
    assert isinstance(status, kunci.KeyStatus)
    assert status.token == ticket.token
    assert status.waiters == 0
    assert 29000 < status.lease_ms <= 30000
    # The server cannot take it back before valid_until.
    assert ticket.valid_until <= time.monotonic() + status.lease_ms / 1000.0

    info = client.info()
    assert info["held"] == 1 and info["grants"] == 1
    assert isinstance(info["version"], str)
    round_trip = client.ping()
    assert 0 < round_trip < 1

    assert ticket.release() is None
    assert client.query("deploy") is None
    second = client.acquire("deploy")
    assert second.token > ticket.token
    second.release()
    assert client.info()["released"] == 2


def test_timeout_is_definitive(server, make_client):
    client = make_client(server.address)
    holder = client.acquire("k", lease=30)
    kind, elapsed, _ = outcome(client.acquire, "k", wait=0)
    assert kind is kunci.Timeout and elapsed < 1
    # A fractional wait goes on the wire rounded up (1 s), and the server
    # never answers T before the wait.
    kind, elapsed, _ = outcome(client.acquire, "k", wait=0.3)
    assert kind is kunci.Timeout
    assert 1.0 <= elapsed < 2.5
    info = client.info()
    assert info["timeouts"] == 2 and info["waiters"] == 0
    holder.release()


def test_waiter_gets_the_key_on_release(server, make_client):
    client = make_client(server.address)
    holder = client.acquire("k")
    # The lower bound counts from the timer's start: the release cannot
    # come earlier, but `outcome` starts its own clock a little later.
    released_from = time.monotonic()
    threading.Timer(0.3, holder.release).start()
    kind, elapsed, ticket = outcome(client.acquire, "k", wait=5)
    assert kind == "ok"
    assert time.monotonic() - released_from >= 0.3 and elapsed < 2
    assert ticket.token > holder.token
    ticket.release()


def test_busy_is_definitive(start_server, make_client):
    server = start_server("--max-keys", "1")
    client = make_client(server.address)
    held = client.acquire("a")
    kind, _, _ = outcome(client.acquire, "b", wait=2)
    assert kind is kunci.Busy
    assert client.query("b") is None
    held.release()


def test_not_held(server, make_client):
    client = make_client(server.address)
    ticket = client.acquire("k")
    with pytest.raises(kunci.NotHeld):
        client.release("k", ticket.token + 1)
    with pytest.raises(kunci.NotHeld):
        client.renew("k", ticket.token + 1, lease=5)
    assert client.query("k").token == ticket.token
    valid_until = client.renew("k", ticket.token, lease=5)
    assert valid_until <= time.monotonic() + 5
    client.release("k", ticket.token)
    with pytest.raises(kunci.NotHeld):
        client.release("k", ticket.token)


def test_renew_moves_valid_until_from_its_send_instant(server, make_client):
    client = make_client(server.address)
    ticket = client.acquire("k", lease=2)
    first = ticket.valid_until
    time.sleep(0.2)
    before = time.monotonic()
    ticket.renew(lease=3)
    after = time.monotonic()
    assert ticket.lease == 3
    margin = kunci.drift_margin(3)
    assert before + 3 - margin <= ticket.valid_until <= after + 3 - margin
    assert ticket.valid_until > first
    ticket.release()


def test_indeterminate_renewal_keeps_the_earlier_bound(server, make_proxy, make_client):
    proxy = make_proxy(server.port)
    client = make_client(proxy.address)
    ticket = client.acquire("k", lease=30)
    before = ticket.valid_until
    proxy.down = "drop"
    started = time.monotonic()
    with pytest.raises(kunci.Indeterminate):
        ticket.renew(lease=2)
    # The server may have applied the 2 s lease: the bound is now that
    # renewal's start (just after `started`) + 2 s − margin.
    bound = started + 2 - kunci.drift_margin(2)
    assert bound <= ticket.valid_until < bound + 0.5
    assert ticket.valid_until < before
    assert not ticket.lost


def test_invalid_input_sends_nothing(server, make_proxy, make_client):
    proxy = make_proxy(server.port)
    client = make_client(proxy.address)
    bad_calls = [
        lambda: client.acquire(""),
        lambda: client.acquire("x" * 256),
        lambda: client.acquire("é" * 128),  # 256 bytes
        lambda: client.acquire("a\nb"),
        lambda: client.acquire("k", lease=0),
        lambda: client.acquire("k", lease=256),
        lambda: client.acquire("k", lease=1.5),
        lambda: client.acquire("k", lease=True),
        lambda: client.acquire("k", wait=-1),
        lambda: client.acquire("k", wait=255.001),
        lambda: client.acquire("k", wait=float("nan")),
        lambda: client.acquire("k", wait="1"),
        lambda: client.acquire("\ud800"),
        lambda: client.renew("k", 1, lease=0),
        lambda: client.release("k", -1),
        lambda: client.query(""),
    ]
    for bad in bad_calls:
        with pytest.raises(kunci.InvalidArgument) as caught:
            bad()
        assert isinstance(caught.value, ValueError)
    assert proxy.accepted == 0
    # The limits themselves are valid.
    ticket = client.acquire("x" * 255, wait=255, lease=255)
    ticket.release()
    client.acquire("k", wait=0.001, lease=1.0).release()


def test_server_error_reply_is_invalid_argument(server, make_proxy, make_client):
    # A non-fatal X (codes 3-6) correlated by id means the client's checks
    # let something through: InvalidArgument, and the session goes on.
    proxy = make_proxy(server.port)
    proxy.accept = "respond"

    def responder(data):
        if data[:1] == b"A":
            owner = struct.unpack(">Q", data[3:11])[0]
            return b"X" + struct.pack(">BQ", 5, owner) + b"lease 0\n"
        if data[:1] == b"P":
            return b"P" + data[1:9] + b"\n"
        return b""

    proxy.responder = responder
    client = make_client(proxy.address)
    with pytest.raises(kunci.InvalidArgument, match="lease 0"):
        client.acquire("k")
    client.ping()
    assert proxy.accepted == 1


# ------------------------------------------------ rules 2-4: deadlines, moves


def test_unavailable_at_the_deadline_when_nothing_listens(make_client):
    client = make_client("127.0.0.1:%d" % free_port())
    kind, elapsed, error = outcome(client.acquire, "k", wait=0)
    assert kind is kunci.Unavailable
    assert kunci.TRANSPORT_DEADLINE <= elapsed < kunci.TRANSPORT_DEADLINE + 1
    assert "cannot connect" in error.reason


def test_not_sent_request_moves_to_the_next_address(server, make_proxy, make_client):
    refusing = make_proxy(server.port)
    refusing.accept = "x7"
    # The X 7 comes after the client wrote its request on that session.
    refusing.accept_delay = 0.1
    client = make_client(["127.0.0.1:%d" % free_port(), refusing.address, server.address])
    kind, elapsed, ticket = outcome(client.acquire, "k", wait=0)
    assert kind == "ok" and elapsed < 1
    # The refused session's request was never executed: one grant only.
    info = client.info()
    assert info["grants"] == 1
    assert refusing.accepted == 1
    assert [op for op, _, _ in request_frames(refusing.upstream_bytes())] == [b"A"]
    ticket.release()


def test_connection_limit_is_unavailable_with_the_reason(start_server, make_client):
    server = start_server("--max-connections", "1")
    occupant = socket.create_connection(("127.0.0.1", server.port))
    try:
        occupant.sendall(b"P" + struct.pack(">Q", 7) + b"\n")
        assert occupant.recv(10)[:1] == b"P"
        client = make_client(server.address)
        kind, elapsed, error = outcome(client.acquire, "k", wait=0)
        assert kind is kunci.Unavailable
        assert "connection limit" in error.reason
        assert kunci.TRANSPORT_DEADLINE <= elapsed < kunci.TRANSPORT_DEADLINE + 1
    finally:
        occupant.close()
    time.sleep(0.2)  # the occupant's close reaches the server first
    assert server.info()["grants"] == 0


def test_not_allowed_is_unavailable_at_once(server, make_proxy, make_client):
    refusing = make_proxy(server.port)
    refusing.accept = "x9"
    client = make_client(refusing.address)
    kind, elapsed, error = outcome(client.acquire, "k", wait=3)
    assert kind is kunci.Unavailable
    assert "not allowed" in error.reason
    # Every address refused this peer: retrying cannot help, so the call
    # does not wait for its deadline.
    assert elapsed < 1
    assert server.info()["grants"] == 0


def test_refusal_by_closing_without_x_is_never_a_ticket(start_server, make_client):
    # A server that closes an accepted connection without a word (what
    # `--allow` did before it sent X 9): a request the socket took is
    # possibly sent, so the outcome is Indeterminate; one it did not take
    # moves until D and ends Unavailable.
    server = start_server("--allow", "10.255.255.0/24")
    client = make_client(server.address)
    kind, elapsed, _ = outcome(client.acquire, "k", wait=0)
    assert kind in (kunci.Indeterminate, kunci.Unavailable)
    assert elapsed < kunci.TRANSPORT_DEADLINE + 1


def test_wire_wait_is_computed_at_send(server, make_proxy, make_client):
    # The first address answers X 7 only after 1.2 s; the request then
    # moves and is written again with the wait left, rounded up.
    slow_refusal = make_proxy(server.port)
    slow_refusal.accept = "x7"
    slow_refusal.accept_delay = 1.2
    recorder = make_proxy(server.port)
    client = make_client([slow_refusal.address, recorder.address])
    start = time.monotonic()
    ticket = client.acquire("k", wait=10)
    [(op, header, key)] = request_frames(recorder.upstream_bytes())
    assert op == b"A" and key == b"k"
    arrived = recorder.received[0][0]
    # w = ceil(10 − (send − start)), and 1.2 s ≤ send − start ≤ arrived − start.
    assert math.ceil(10 - (arrived - start)) <= header[0] <= math.ceil(10 - 1.2)
    ticket.release()

    # Once Dw has passed the wire wait is 0; an original 0 stays 0.
    slow_refusal.accept_delay = 1.2
    recorder.received.clear()
    client2 = make_client([slow_refusal.address, recorder.address])
    ticket = client2.acquire("k", wait=1)
    assert recorder.upstream_bytes()[1] == 0
    ticket.release()
    recorder.received.clear()
    client2.acquire("k", wait=0).release()
    assert recorder.upstream_bytes()[1] == 0


# -------------------------------------------- rules 5-7: possibly sent


def test_no_answer_by_the_deadline_is_indeterminate(server, make_proxy, make_client):
    proxy = make_proxy(server.port)
    client = make_client(proxy.address)
    client.ping()
    proxy.down = "drop"  # the server executes, its answers never arrive
    kind, elapsed, _ = outcome(client.acquire, "k", wait=0, lease=30)
    assert kind is kunci.Indeterminate
    assert kunci.TRANSPORT_DEADLINE <= elapsed < kunci.TRANSPORT_DEADLINE + 1
    # The grant exists and is nobody's: the lease will end it.
    assert server.info()["held"] == 1
    # Exactly that session was closed; the next call opens a new one.
    wait_for(lambda: proxy.closed_by_client == 1, 2)
    proxy.down = "pass"
    assert client.ping() > 0
    assert proxy.accepted == 2
    # The request was sent once: never again on the new session. (The
    # clean-up of rule 11 may come too, an `H` and, once answers pass
    # again, the `R` of the grant it found; neither is an acquire.)
    ops = [op for op, _, _ in request_frames(proxy.upstream_bytes())]
    assert [op for op in ops if op not in (b"H", b"R")] == [b"P", b"A", b"P"]
    assert ops.count(b"H") <= 1 and ops.count(b"R") <= ops.count(b"H")


def test_connection_that_died_while_idle_is_not_used(server, make_proxy, make_client):
    # The server ended the connection while nobody was reading it: the next
    # request must notice before writing and go to a new connection (it is
    # still certainly not sent), not end Indeterminate.
    proxy = make_proxy(server.port)
    client = make_client(proxy.address)
    client.ping()
    proxy.cut_all()
    time.sleep(0.2)
    ticket = client.acquire("k")
    assert proxy.accepted == 2
    ticket.release()


def test_session_dying_after_the_request_is_indeterminate_at_once(server, make_proxy, make_client):
    proxy = make_proxy(server.port)
    client = make_client(proxy.address)
    client.ping()
    # The ping (10 bytes), then the whole acquire frame (13) reach the
    # server; its answer does not come back, and the connection dies.
    proxy.cut_up_after = 10 + 13
    proxy.down = "drop"
    kind, elapsed, _ = outcome(client.acquire, "k", wait=0, lease=30)
    assert kind is kunci.Indeterminate
    assert elapsed < 1
    assert server.info()["grants"] == 1
    proxy.cut_up_after = None
    proxy.down = "pass"
    assert client.query("k").token > 0


def test_uncorrelated_answer_ends_the_session(server, make_proxy, make_client):
    proxy = make_proxy(server.port)
    proxy.accept = "respond"
    # Answers every request with a T for an owner nobody used.
    proxy.responder = lambda data: b"T" + struct.pack(">Q", 12345) + b"\n"
    client = make_client(proxy.address)
    kind, elapsed, _ = outcome(client.acquire, "k", wait=0)
    assert kind is kunci.Indeterminate and elapsed < 1
    # The session closes; the clean-up's `H` (rule 11) may open and close
    # another one, which this responder answers no better.
    wait_for(lambda: proxy.closed_by_client >= 1, 2)


def test_garbage_from_the_server_ends_the_session(server, make_proxy, make_client):
    proxy = make_proxy(server.port)
    proxy.accept = "respond"
    proxy.responder = lambda data: b"Z\n"
    client = make_client(proxy.address)
    kind, _, _ = outcome(client.query, "k")
    assert kind is kunci.Indeterminate
    wait_for(lambda: proxy.closed_by_client == 1, 2)


def test_shutdown_answers_waiters_busy(start_server, make_client):
    server = start_server()
    client = make_client(server.address)
    holder = client.acquire("k")
    results = []
    waiter = threading.Thread(target=lambda: results.append(outcome(client.acquire, "k", wait=10)))
    waiter.start()
    wait_for(lambda: server.info()["waiters"] == 1, 3)
    server.stop()
    waiter.join(10)
    assert results[0][0] is kunci.Busy
    assert results[0][1] < 5
    # The session ended with X 8: the next call cannot reach anyone.
    del holder


# ------------------------------------------------------ addresses, drops


def test_unix_socket_and_kunci_server_variable(start_server, make_client, monkeypatch):
    path = os.path.join(tempfile.mkdtemp(), "kunci.sock")
    server = start_server(listen=("unix:" + path,))
    assert server.address == "unix:" + path
    monkeypatch.setenv("KUNCI_SERVER", "127.0.0.1:%d,unix:%s" % (free_port(), path))
    client = make_client()
    ticket = client.acquire("k")
    assert client.query("k").token == ticket.token
    ticket.release()


@pytest.mark.parametrize("servers, problem", [
    (["127.0.0.1:5862", "etcd://127.0.0.1:2379"], "cannot be mixed with kunci servers"),
    ("etcd://127.0.0.1:2379,unix:/x", "etcd member 'unix:/x': bad port"),
    ("etcd://127.0.0.1:2379,b", "etcd member 'b': no port"),
    ("etcd://", "an etcd member is empty"),
    ("ETCDS://127.0.0.1:2379", "etcd[s]://HOST:PORT"),
    ("etcds://127.0.0.1:2379,", "an etcd member is empty"),
])
def test_bad_etcd_addresses_are_refused_at_construction(make_client, servers, problem):
    # Refused at once, before any connection: never a DNS error after 5 s.
    start = time.monotonic()
    with pytest.raises(kunci.InvalidArgument, match=re.escape(problem)):
        make_client(servers)
    assert time.monotonic() - start < 2.0  # generous; a DNS error takes 5 s


def test_etcd_in_kunci_server_names_the_variable_when_refused(make_client, monkeypatch):
    monkeypatch.setenv("KUNCI_SERVER", "etcd://127.0.0.1:2379,127.0.0.1:5862,x")
    with pytest.raises(kunci.InvalidArgument, match="^KUNCI_SERVER: .*etcd member 'x': no port"):
        make_client()


def test_etcd_members_may_be_listed_in_one_address_or_several():
    one = kunci._protocol.resolve_servers("etcd://a:1,[::1]:2")
    several = kunci._protocol.resolve_servers(["etcd://a:1", "etcd://[::1]:2"])
    assert one == several == [("etcd", ("a", 1)), ("etcd", ("::1", 2))]
    assert kunci._protocol.resolve_servers("etcds://a:1,b:2") == [
        ("etcds", ("a", 1)), ("etcds", ("b", 2))]


def test_other_schemes_are_refused_at_construction(make_client):
    with pytest.raises(kunci.InvalidArgument,
                       match=r"takes HOST:PORT, tls://HOST:PORT, unix:PATH or etcd\[s\]:"):
        make_client("tcp://127.0.0.1:5862")


def test_dropped_ticket_is_released(server, make_client):
    import gc

    client = make_client(server.address)
    ticket = client.acquire("k")
    token = ticket.ticket.token if hasattr(ticket, "ticket") else ticket.token
    del ticket
    gc.collect()
    wait_for(lambda: client.query("k") is None, 3)
    assert server.info()["released"] == 1
    # A detached ticket keeps the lock.
    kept = client.acquire("k")
    token = kept.detach()
    del kept
    gc.collect()
    time.sleep(0.2)
    assert client.query("k").token == token
