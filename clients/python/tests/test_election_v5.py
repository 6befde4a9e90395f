"""Elections as spec v5 §13.6 has them (issues 36 and 39): the unknown
leader of a crash grace, a bounded campaign, ``on_lost`` for a campaign,
and resigning a lead already lost, quietly. Both flavours."""

import signal
import struct
import threading
import time

import pytest

import kunci
from conftest import free_port, request_frames, wait_for
from test_election import Follower


def campaign(client, name, value, **kwargs):
    """``client.campaign(...)`` of either flavour, the ticket with a
    blocking ``release``."""
    if client.flavour == "sync":
        return client.campaign(name, value, **kwargs)
    inner = client.client

    async def run():
        return await inner.campaign(name, value, **kwargs)
    ticket = client._runner.run(run())

    class Blocking(object):
        def __getattr__(self, attribute):
            return getattr(ticket, attribute)

        def release(self):
            return client._runner.run(ticket.release())
    return Blocking()


def crashed_with_a_leader(start_server, make_client, tmp_path):
    """A server with a state dir whose leader of ``svc`` was kill -9'd with
    it, started again: in its crash grace (the lease + 5 s)."""
    path = str(tmp_path / "kunci.sock")
    state = str(tmp_path / "state")
    first = start_server("--state-dir", state, listen=("unix:" + path,))
    with kunci.Client("unix:" + path) as leader:
        leader.campaign("svc", "a", lease=20).detach()
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(5)
    start_server("--state-dir", state, listen=("unix:" + path,))
    return "unix:" + path


def test_leader_during_a_crash_grace_is_the_unknown_leader(start_server, make_client, tmp_path):
    address = crashed_with_a_leader(start_server, make_client, tmp_path)
    leader = make_client(address).leader("svc")
    assert leader == kunci.Leader(None, 0, None)
    assert not leader.known


def test_observe_reports_the_unknown_leader_not_none_during_a_grace(
        start_server, make_client, tmp_path):
    address = crashed_with_a_leader(start_server, make_client, tmp_path)
    follower = Follower(make_client(address), "svc")
    at, item = follower.wait_count(1)
    assert item == kunci.Leader(None, 0, None)
    time.sleep(1.0)
    assert len(follower.items) == 1 and follower.error is None


def test_a_campaign_with_a_wait_ends_timeout(server, make_client):
    leader = campaign(make_client(server.address), "bounded", "a")
    candidate = make_client(server.address)
    start = time.monotonic()
    with pytest.raises(kunci.Timeout, match="'bounded'"):
        campaign(candidate, "bounded", "b", wait=0.5)
    assert 0.5 <= time.monotonic() - start < 2.0
    assert candidate.holders("bounded").waiters == []
    leader.release()
    # The key free, a bounded campaign leads at once.
    ticket = campaign(candidate, "bounded", "b", wait=0.5)
    assert candidate.leader("bounded").term == ticket.token
    ticket.release()


def test_on_lost_of_a_campaign_runs_once_and_resigning_after_is_quiet(server, make_client):
    client = make_client(server.address)
    lost = []
    called = threading.Event()

    def on_lost(ticket):
        lost.append(ticket.token)
        called.set()
    ticket = campaign(client, "ousted", "a", lease=3, on_lost=on_lost)
    # Another process takes the lead from it: the next renewal is answered N.
    with kunci.Client(server.address) as other:
        other.release("ousted", ticket.token)
    assert called.wait(5)
    time.sleep(1.5)
    assert lost == [ticket.token] and ticket.lost
    ticket.release()  # quietly: the lead is lost already (no LockLost)


def test_resigning_a_lead_lost_unnoticed_is_quiet(server, make_client):
    client = make_client(server.address)
    ticket = campaign(client, "unnoticed", "a", lease=60)
    with kunci.Client(server.address) as other:
        other.release("unnoticed", ticket.token)
    ticket.release()  # answered N: quietly, as etcd's Resign
    # A plain lock's release after the same says NotHeld.
    plain = client.acquire("plain", lease=60)
    with kunci.Client(server.address) as other:
        other.release("plain", plain.token)
    with pytest.raises(kunci.NotHeld):
        plain.release()


def test_campaign_arguments_are_checked(make_client):
    client = make_client("127.0.0.1:1")
    with pytest.raises(kunci.InvalidArgument, match="on_lost"):
        campaign(client, "e", "v", on_lost=3)
    with pytest.raises(kunci.InvalidArgument, match="wait"):
        campaign(client, "e", "v", wait=-1)


def test_observers_never_make_a_campaign_busy(start_server, make_client):
    # Held watches go on connections of their own: on one that carries a
    # waiting acquire they would count toward --max-waits-per-conn.
    server = start_server("--max-waits-per-conn", "3")
    leader = campaign(make_client(server.address), "watched", "a")
    client = make_client(server.address)
    followers = [Follower(client, "watched-%d" % i) for i in range(3)]
    for follower in followers:
        assert follower.wait_count(1)[1] is None
    time.sleep(0.5)  # each holds its watch
    releaser = threading.Timer(1.0, leader.release)
    releaser.start()
    ticket = campaign(client, "watched", "b")  # waits behind the leader, not Busy
    releaser.join()
    assert client.leader("watched").term == ticket.token
    assert all(follower.error is None for follower in followers)
    ticket.release()


def test_proclaim_sends_c_and_an_n_is_a_lost_lock(make_client, make_proxy):
    # Against a scripted server: the bytes of C (spec §13.4a) and what
    # each answer does.
    proxy = make_proxy(free_port())
    proxy.accept = "respond"
    proclaimed = [b"C"]

    def responder(data):
        out = b""
        for op, header, _ in request_frames(data):
            if op == b"A":
                owner = struct.unpack(">BBQ", header)[2]
                out += b"A" + struct.pack(">QQ", owner, 77) + b"\n"
            elif op == b"C":
                token = struct.unpack(">QB", header)[0]
                out += proclaimed[0] + struct.pack(">Q", token) + b"\n"
        return out
    proxy.responder = responder
    client = make_client(proxy.address)
    ticket = client.acquire("svc", lease=60)
    assert ticket.token == 77
    before = len(proxy.upstream_bytes())
    if client.flavour == "sync":
        proclaim = ticket.proclaim
    else:
        def proclaim(value):
            return client._runner.run(ticket.ticket.proclaim(value))
    proclaim("host-b:5432")
    assert proxy.upstream_bytes()[before:] == (
        b"C" + struct.pack(">QB", 77, 3) + b"svc" + b"host-b:5432\n")
    assert not ticket.lost
    with pytest.raises(kunci.InvalidArgument, match="value"):
        proclaim("two\nlines")
    proclaimed[0] = b"N"
    with pytest.raises(kunci.LockLost, match="proclaim was answered N"):
        proclaim("host-c:5432")
    assert ticket.lost
    sent = len(proxy.upstream_bytes())
    with pytest.raises(kunci.LockLost):
        proclaim("host-d:5432")  # nothing sent after a known loss
    assert len(proxy.upstream_bytes()) == sent


@pytest.mark.parametrize("layout", ["", "?layout=etcd"])
def test_proclaim_on_etcd_puts_the_leaders_own_entry(etcd_cluster, make_client, layout):
    client = make_client(etcd_cluster.address + layout)
    name = "proclaimed" + layout.replace("?layout=", "-")
    follower = Follower(make_client(etcd_cluster.address + layout), name)
    assert follower.wait_count(1)[1] is None
    ticket = campaign(client, name, "host-a", lease=10)
    assert follower.wait_count(2)[1].value == "host-a"
    if client.flavour == "sync":
        ticket.proclaim("host-b")
    else:
        client._runner.run(ticket.proclaim("host-b"))
    leader = client.leader(name)
    assert (leader.value, leader.term) == ("host-b", ticket.token)  # the same term
    at, item = follower.wait_count(3)
    assert (item.value, item.term) == ("host-b", ticket.token)
    ticket.release()


def test_follow_reports_a_time_in_office_that_becomes_known():
    # On etcd a new leader stamps its grant time after its grant: an
    # observer that saw the hand-over first reports the time once it comes.
    import kunci._common as C
    follow = C.Follow("svc")
    assert follow.answered(C.KeyState(7, 0, None, 1, 0, "b")) == kunci.Leader("b", 7, None)
    assert follow.answered(C.KeyState(7, 0, None, 1, 0, "b")) is C.Follow.NOTHING
    assert follow.answered(C.KeyState(7, 0, 250, 1, 0, "b")) == kunci.Leader("b", 7, 0.25)
    assert follow.answered(C.KeyState(7, 0, 900, 1, 0, "b")) is C.Follow.NOTHING


def test_an_observer_on_etcd_reports_the_stamp_that_comes_after_the_grant(
        etcd_cluster, make_client):
    # The stamp is written through a sync client's etcd connection; the
    # observer is of either flavour.
    client = kunci.Client(etcd_cluster.address)
    import base64
    name = "stamped-late"
    ticket = client.acquire(name, lease=10, label="b")  # a lock: no grant time
    follower = Follower(make_client(etcd_cluster.address), name)
    assert follower.wait_count(1)[1] == kunci.Leader("b", ticket.token, None)
    # What a campaign does right after its grant: its entry again, stamped.
    cluster = client._etcd
    entry = cluster._held_by(name.encode(), ticket.token, time.monotonic() + 5)
    stamped = entry.value + b"\ngranted_ms=%d" % int(time.time() * 1000)
    key = base64.b64encode(entry.name).decode()
    cluster._write("/v3/kv/txn", {
        "compare": [{"key": key, "target": "CREATE", "result": "EQUAL",
                     "create_revision": str(ticket.token)}],
        "success": [{"request_put": {"key": key, "value": base64.b64encode(stamped).decode(),
                                     "ignore_lease": True}}]}, time.monotonic() + 5)
    at, item = follower.wait_count(2)
    assert (item.value, item.term) == ("b", ticket.token) and item.held_for is not None
    ticket.release()
    client.close()


# ---------------------------------------------- against a server with C

def test_proclaim_on_a_server_changes_the_value_and_keeps_the_term(server, make_client):
    client = make_client(server.address)
    follower = Follower(make_client(server.address), "proclaimed")
    assert follower.wait_count(1)[1] is None
    ticket = campaign(client, "proclaimed", "host-a", lease=10)
    assert follower.wait_count(2)[1].value == "host-a"
    if client.flavour == "sync":
        ticket.proclaim("host-b")
    else:
        client._runner.run(ticket.proclaim("host-b"))
    leader = client.leader("proclaimed")
    assert (leader.value, leader.term) == ("host-b", ticket.token)
    at, item = follower.wait_count(3)
    assert (item.value, item.term) == ("host-b", ticket.token)
    ticket.release()


def test_a_campaign_proclaims_its_value_again_after_a_crash(start_server, make_client, tmp_path):
    path = str(tmp_path / "kunci.sock")
    state = str(tmp_path / "state")
    first = start_server("--state-dir", state, listen=("unix:" + path,))
    client = make_client("unix:" + path)
    ticket = campaign(client, "crashed", "host-a", lease=6)
    first.proc.send_signal(signal.SIGKILL)
    first.proc.wait(5)
    start_server("--state-dir", state, listen=("unix:" + path,))
    with kunci.Client("unix:" + path) as observer:
        # The keep-alive's renewal adopts the grant (no label after a
        # crash), then the campaign proclaims its value again.
        leader = wait_for(lambda: (lambda found: found if found is not None and found.known
                                   and found.value == "host-a" else None)(
                                       observer.leader("crashed")), 10)
        assert leader.term == ticket.token
    assert not ticket.lost
    ticket.release()
