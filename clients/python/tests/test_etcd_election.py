"""Leader election on etcd (spec §13.6, docs/ETCD.md): ``leader`` and
``observe`` on a real etcd, in the sync and asyncio clients: the leader is
the key's earliest entry, its term the create revision, ``held_for`` the
time since the grant time the holder wrote; ``observe`` follows an etcd
watch through resignations, lease ends and an etcd restart; and the Rust
CLI (``kunci leader``, ``kunci elect``) and Python reading each other's
leaders, grant time included."""

import os
import re
import subprocess
import threading
import time
import urllib.request

import pytest

import kunci
from conftest import EtcdCluster, free_port, kunci_bin, require_tool, wait_for
from test_election import Follower, campaign, in_thread, joined


def test_leader_none_then_the_campaigner_on_etcd(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    name = "db-%s" % client.flavour
    assert client.leader(name) is None
    ticket = campaign(client, name, "host-a:5432", lease=10)
    time.sleep(0.3)
    leader = client.leader(name)
    assert (leader.value, leader.term) == ("host-a:5432", ticket.token)
    assert isinstance(leader.held_for, float)
    assert 0.29 <= leader.held_for < 3.0  # wall clock, one machine here
    ticket.release()
    assert client.leader(name) is None


def test_held_for_counts_from_a_late_grant_not_from_the_enqueue(etcd_cluster, make_client):
    first, second = make_client(etcd_cluster.address), make_client(etcd_cluster.address)
    name = "late-%s" % first.flavour
    leading = campaign(first, name, "a", lease=10)
    box = in_thread(campaign, second, name, "b", lease=10)
    time.sleep(1.5)
    assert first.leader(name).value == "a"
    leading.release()
    follower = joined(box, 5)
    leader = first.leader(name)
    assert (leader.value, leader.term) == ("b", follower.token)
    assert leader.held_for is not None and leader.held_for < 1.0
    follower.release()


def test_a_leader_without_a_stored_time_has_held_for_none(etcd_cluster, make_client):
    # A lock (labelled or not) writes the value every version wrote: no
    # grant time; only a campaign stores one.
    client = make_client(etcd_cluster.address)
    name = "plain-%s" % client.flavour
    for label, value in ((None, ""), ("ops", "ops")):
        ticket = client.acquire(name, wait=0, lease=10, label=label)
        leader = client.leader(name)
        assert (leader.value, leader.term, leader.held_for) == (value, ticket.token, None)
        client.release(name, ticket.token)


def test_rust_cli_and_python_read_each_other_s_leader_and_held_for(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    name = "cross-%s" % client.flavour
    env = dict(os.environ, KUNCI_SERVER=etcd_cluster.address)
    env.pop("RUST_LOG", None)
    # A Python campaign, as `kunci leader` shows it.
    ticket = campaign(client, name, "py host:1", lease=10)
    time.sleep(1.1)
    shown = subprocess.run([kunci_bin(), "leader", name], env=env, capture_output=True,
                           text=True, timeout=20)
    assert shown.returncode == 0, shown.stderr
    match = re.fullmatch(r"py host:1 term=([0-9]+) held_for=([0-9]+\.[0-9]{3})\n", shown.stdout)
    assert match, shown.stdout
    assert int(match.group(1)) == ticket.token
    assert 1.1 <= float(match.group(2)) < 4.0
    shown = subprocess.run([kunci_bin(), "leader", name, "--json"], env=env,
                           capture_output=True, text=True, timeout=20)
    assert shown.stdout.startswith(
        '{"value": "py host:1", "term": "%d", "held_for": 1.' % ticket.token), shown.stdout
    # A `kunci elect` queued behind it stores its grant time when granted.
    elect = subprocess.Popen(
        [kunci_bin(), "elect", name, "rust host", "--lease", "5", "--",
         "sh", "-c", 'echo "$KUNCI_TOKEN"; exec sleep 60'],
        env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(1.0)
        assert client.leader(name).value == "py host:1"
        ticket.release()
        term = int(elect.stdout.readline())
        time.sleep(0.5)
        leader = client.leader(name)
        assert (leader.value, leader.term) == ("rust host", term)
        assert leader.held_for is not None and 0.5 <= leader.held_for < 2.0
    finally:
        elect.terminate()
        assert elect.wait(10) == 128 + 15
    assert client.leader(name) is None


def test_observe_on_etcd_sees_the_takeover_when_the_leader_resigns(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    name = "resign-%s" % client.flavour
    follower = Follower(make_client(etcd_cluster.address), name)
    follower.wait_count(1)
    leading = campaign(client, name, "a", lease=5)
    follower.wait_count(2)
    box = in_thread(campaign, make_client(etcd_cluster.address), name, "b", lease=5)
    time.sleep(0.5)
    resigned = time.monotonic()
    leading.release()
    taking = joined(box, 5)
    at, item = follower.wait_count(3)
    assert at - resigned < 1.0
    # The new leader's time in office may come after its grant (its
    # campaign stamps it then): reported then, as one more item.
    wait_for(lambda: follower.leaders()[-1].held_for is not None, 3)
    time.sleep(0.3)  # nothing spurious after
    shown = [(x.value, x.term) if x else None for x in follower.leaders()]
    assert shown in ([None, ("a", leading.token), ("b", taking.token)],
                     [None, ("a", leading.token), ("b", taking.token), ("b", taking.token)])
    assert follower.leaders()[-1].held_for is not None
    assert follower.error is None
    count = len(shown)
    taking.release()
    follower.wait_count(count + 1)
    assert follower.leaders()[count] is None


def test_observe_on_etcd_sees_the_lease_end_of_a_dead_leader(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    name = "dead-%s" % client.flavour
    # A leader nobody keeps alive: its lease ends as a dead host's does.
    dead = client.acquire(name, wait=0, lease=2, label="dead")
    dead_token = dead.token
    follower = Follower(make_client(etcd_cluster.address), name)
    follower.wait_count(1)
    box = in_thread(campaign, make_client(etcd_cluster.address), name, "next", lease=5)
    started = time.monotonic()
    at, item = follower.wait_count(2, timeout=8)
    taking = joined(box, 5)
    assert (item.value, item.term) == ("next", taking.token)
    assert 1.0 <= at - started < 6.0  # the lease's end (etcd rounds its TTL)
    # Its time in office, stamped after its grant, may come as one more item.
    wait_for(lambda: follower.leaders()[-1].held_for is not None, 3)
    shown = [(x.value, x.term) for x in follower.leaders()]
    assert shown in ([("dead", dead_token), ("next", taking.token)],
                     [("dead", dead_token), ("next", taking.token), ("next", taking.token)])
    taking.release()


def test_observe_on_etcd_ends_when_its_client_is_closed(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    name = "closed-%s" % client.flavour
    leading = campaign(client, name, "a", lease=30)
    watching = make_client(etcd_cluster.address)
    follower = Follower(watching, name)
    follower.wait_count(1)
    time.sleep(0.5)  # in its watch now

    def calls_on_etcd():
        return [t for t in threading.enumerate() if t.name == "kunci-etcd-call" and t.is_alive()]
    if client.flavour == "sync":
        watching.close()
        assert wait_for(lambda: follower.error is not None, 1.0)
        assert isinstance(follower.error, kunci.Error)
    else:
        # The follow's call, once the campaign's own calls (its grant
        # time's stamp) have ended.
        assert wait_for(lambda: len(calls_on_etcd()) == 1, 3.0)
        watching.close()  # cancels the follow, then closes
        # Within its watch's check (0.2 s); 3 s for a loaded machine, far
        # below the follow's own wait.
        assert wait_for(lambda: calls_on_etcd() == [], 3.0)
    leading.release()


def test_observe_on_etcd_refuses_an_invalid_name_at_once(make_client):
    client = make_client("etcd://127.0.0.1:%d" % free_port())
    observe = client.observe if client.flavour == "sync" else client.client.observe
    with pytest.raises(kunci.InvalidArgument):
        observe("a\nb")
    with pytest.raises(kunci.InvalidArgument):
        client.leader("")


def ranges_served(cluster):
    """How many ``Range`` requests the members have started (their metrics)."""
    total = 0
    for member in cluster.members:
        with urllib.request.urlopen("http://%s/metrics" % member["client"], timeout=2) as answer:
            text = answer.read().decode()
        for line in text.splitlines():
            if line.startswith("grpc_server_started_total") and 'grpc_method="Range"' in line:
                total += int(float(re.split(r"\s+", line)[-1]))
    return total


def test_observe_on_etcd_across_an_etcd_restart(make_client, tmp_path):
    etcd = require_tool("etcd", "etcd-server")
    cluster = EtcdCluster(etcd, tmp_path, size=1)
    try:
        client = make_client(cluster.address)
        name = "restart-%s" % client.flavour
        leading = campaign(client, name, "a", lease=30)
        follower = Follower(make_client(cluster.address), name)
        follower.wait_count(1)
        # A follower of a steady leader waits on a watch: it does not poll.
        before = ranges_served(cluster)
        time.sleep(1.5)
        assert ranges_served(cluster) == before
        cluster.kill(0)
        time.sleep(2.5)  # longer than the longest pause between attempts
        cluster.restart(0)
        cluster.wait_ready()
        time.sleep(0.5)
        assert len(follower.items) == 1 and follower.error is None  # nothing spurious
        leading.release()
        at, item = follower.wait_count(2, timeout=5)
        assert item is None
        taking = campaign(client, name, "b", lease=30)
        follower.wait_count(3)
        assert [(x.value, x.term) if x else None for x in follower.leaders()] == [
            ("a", leading.token), None, ("b", taking.token)]
        assert follower.error is None
        taking.release()
        assert wait_for(lambda: len(follower.items) == 4, 5)
    finally:
        cluster.stop()
