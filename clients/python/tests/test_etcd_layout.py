"""etcd's own layout on etcd (``?layout=etcd``, docs/ETCD.md): the Python
client's exclusive locks and elections share etcd's
``client/v3/concurrency`` recipe with the real ``etcdctl lock`` and
``etcdctl elect`` (Debian's etcd-client), sync and asyncio."""

import base64
import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

import kunci
import kunci._protocol as P
from conftest import free_port, require_tool, wait_for
from test_election import Follower, campaign


def layout(cluster):
    return cluster.address + "?layout=etcd"


def etcdctl(cluster, *args, **kwargs):
    """``etcdctl`` on the cluster's members (a ``Popen``)."""
    program = require_tool("etcdctl", "etcd-client")
    kwargs.setdefault("env", dict(os.environ, ETCDCTL_API="3"))
    return subprocess.Popen([program, "--endpoints", ",".join(cluster.endpoints)] + list(args),
                            **kwargs)


def entries(cluster, name):
    """``[(key, create_revision, value)]`` under ``NAME/``, by create
    revision, read through the gateway."""
    prefix = name.encode() + b"/"
    body = json.dumps({"key": base64.b64encode(prefix).decode(),
                       "range_end": base64.b64encode(prefix[:-1] + b"0").decode(),
                       "sort_target": "CREATE", "sort_order": "ASCEND"}).encode()
    request = urllib.request.Request("http://%s/v3/kv/range" % cluster.endpoints[0], data=body,
                                     method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        kvs = json.loads(answer.read()).get("kvs", [])
    return [(base64.b64decode(kv["key"]).decode(), int(kv["create_revision"]),
             base64.b64decode(kv.get("value", "")).decode()) for kv in kvs]


# ------------------------------------------------------- the address option

def test_the_layout_option_is_parsed_and_checked():
    members = P.parse_address("etcd://127.0.0.1:2379,[::1]:2380?layout=etcd")
    assert members == [("etcd", ("127.0.0.1", 2379)), ("etcd", ("::1", 2380))]
    assert [where.layout for _, where in members] == ["etcd", "etcd"]
    assert P.format_address(members[1]) == "etcd://[::1]:2380?layout=etcd"
    assert P.parse_address("etcds://h:1?layout=kunci")[0][1].layout == "kunci"
    assert P.format_address(P.parse_address("etcds://h:1?layout=kunci")[0]) == "etcds://h:1"
    assert P.parse_address("etcd://h:1")[0][1].layout == "kunci"
    for bad in ["etcd://h:1?layout=zk", "etcd://h:1?layout", "etcd://h:1?mode=etcd",
                "etcd://h:1?layout=etcd&x=1", "etcd://h:1?layout=etcd,h:2"]:
        with pytest.raises(ValueError):
            P.parse_address(bad)


def test_what_etcds_recipe_cannot_express_is_refused_before_anything_is_sent(make_client):
    # Nothing listens there: a request sent would end Unavailable instead.
    port = free_port()
    client = make_client("etcd://127.0.0.1:%d?layout=etcd" % port, connect_timeout=0.2)
    for kwargs in (dict(limit=3), dict(limit=3, take=2), dict(shared=True)):
        started = time.monotonic()
        with pytest.raises(kunci.InvalidArgument, match="layout"):
            client.acquire("jobs", wait=0, lease=5, **kwargs)
        assert time.monotonic() - started < 0.1
    with pytest.raises(kunci.InvalidArgument, match="layout"):
        client.list_keys("")
    for name in ("kunci", "kunci/4:jobs", "kunci/"):
        started = time.monotonic()
        with pytest.raises(kunci.InvalidArgument, match="kunci's own layout keeps its locks"):
            client.acquire(name, wait=0, lease=5)
        with pytest.raises(kunci.InvalidArgument, match="kunci's own layout keeps its locks"):
            client.query(name)
        assert time.monotonic() - started < 0.1
    with pytest.raises(kunci.InvalidArgument, match="one layout"):
        make_client(["etcd://127.0.0.1:%d?layout=etcd" % port, "etcd://127.0.0.1:%d" % port])
    with pytest.raises(kunci.InvalidArgument):
        make_client("etcd://127.0.0.1:%d?layout=nope" % port)


def test_the_layout_is_etcds_keys_and_values(etcd_cluster, make_client):
    client = make_client(layout(etcd_cluster))
    name = "jobs/layout-%s" % client.flavour
    ticket = client.acquire(name, wait=0, lease=10, label="py")
    ((key, revision, value),) = entries(etcd_cluster, name)
    assert key.startswith(name + "/") and revision == ticket.token and value == "py"
    lease = key[len(name) + 1:]
    assert lease == "%x" % int(lease, 16)  # lowercase hex, unpadded
    assert client.query(name).token == ticket.token
    client.release(name, ticket.token)
    assert entries(etcd_cluster, name) == []
    # Under the default layout the same name is another lock.
    plain = make_client(etcd_cluster.address).acquire(name, wait=0, lease=10)
    assert entries(etcd_cluster, name) == []
    plain.release()


# ------------------------------------------------------ with etcdctl lock

CRITICAL = r"""
set -C
if ! echo "$1" > "$MARKER" 2>/dev/null; then echo OVERLAP >> "$LOG"; fi
echo "$1 ${2:-$ETCD_LOCK_KEY}" >> "$LOG"
sleep 0.02
rm -f "$MARKER"
"""


def test_python_and_etcdctl_lock_never_overlap_and_hand_over_in_fifo_order(
        etcd_cluster, make_client, tmp_path):
    """A queue of 24 alternating Python and ``etcdctl lock`` waiters behind a
    Python holder: each runs a critical section that claims a marker file
    (``set -C``: it fails if the previous one is still in it) and logs
    itself; they must run one at a time, in the order they queued (their
    create revisions), every hand-over Python → etcdctl and etcdctl →
    Python."""
    marker, log = str(tmp_path / "marker"), str(tmp_path / "log")
    env = dict(os.environ, MARKER=marker, LOG=log)
    client = make_client(layout(etcd_cluster))
    name = "fifo-%s" % client.flavour
    first = client.acquire(name, wait=0, lease=30)
    processes, threads, expected = [], [], []
    errors = []

    def python_waiter(tag):
        try:
            ticket = client.acquire(name, wait=60, lease=30)
            subprocess.run(["sh", "-c", CRITICAL, "sh", "python", str(ticket.token)], env=env,
                           check=True)
            client.release(name, ticket.token)
        except Exception as error:  # reported below
            errors.append(error)

    for index in range(24):
        if index % 2 == 0:
            processes.append(etcdctl(etcd_cluster, "lock", name, "--", "sh", "-c", CRITICAL,
                                     "sh", "etcdctl", env=dict(env, ETCDCTL_API="3"),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        else:
            thread = threading.Thread(target=python_waiter, args=(index,), daemon=True)
            thread.start()
            threads.append(thread)
        assert wait_for(lambda: len(entries(etcd_cluster, name)) == index + 2, 10), index
        key, revision, _ = entries(etcd_cluster, name)[-1]
        expected.append(("etcdctl", key) if index % 2 == 0 else ("python", str(revision)))
    started = time.monotonic()
    first.release()
    for process in processes:
        _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr
    for thread in threads:
        thread.join(30)
    elapsed = time.monotonic() - started
    assert errors == []
    lines = open(log).read().split("\n")[:-1]
    assert "OVERLAP" not in lines
    # Python logs its token (the create revision), etcdctl its key: in
    # the order they queued.
    assert [tuple(line.split()) for line in lines] == expected
    assert entries(etcd_cluster, name) == []
    assert elapsed < 15.0


def test_an_etcdctl_holder_is_shown_and_blocks_a_python_try(etcd_cluster, make_client):
    client = make_client(layout(etcd_cluster))
    name = "held-by-go-%s" % client.flavour
    holder = etcdctl(etcd_cluster, "lock", name, stdout=subprocess.PIPE,
                     stderr=subprocess.DEVNULL)
    try:
        assert wait_for(lambda: len(entries(etcd_cluster, name)) == 1, 10)
        with pytest.raises(kunci.Timeout):
            client.acquire(name, wait=0, lease=5)
        ((_, revision, _),) = entries(etcd_cluster, name)
        grants = client.holders(name).grants
        assert [(g.token, g.label) for g in grants] == [(revision, "")]
        assert client.query(name).token == revision
    finally:
        holder.send_signal(signal.SIGINT)
        holder.wait(10)
    assert wait_for(lambda: entries(etcd_cluster, name) == [], 5)
    client.acquire(name, wait=0, lease=5).release()


# ------------------------------------------------------ with etcdctl elect

def test_leader_and_observe_see_an_etcdctl_elect_leader(etcd_cluster, make_client):
    client = make_client(layout(etcd_cluster))
    name = "elect-go-%s" % client.flavour
    follower = Follower(make_client(layout(etcd_cluster)), name)
    follower.wait_count(1)
    go = etcdctl(etcd_cluster, "elect", name, "go-primary:5432", stdout=subprocess.PIPE,
                 stderr=subprocess.DEVNULL)
    try:
        at, item = follower.wait_count(2)
        ((_, revision, _),) = entries(etcd_cluster, name)
        assert (item.value, item.term, item.held_for) == ("go-primary:5432", revision, None)
        leader = client.leader(name)
        assert (leader.value, leader.term) == ("go-primary:5432", revision)
        # A Python candidate queues behind it and takes over when it resigns.
        box = {}
        thread = threading.Thread(
            target=lambda: box.update(t=campaign(client, name, "py-standby", lease=5)),
            daemon=True)
        thread.start()
        assert wait_for(lambda: len(entries(etcd_cluster, name)) == 2, 10)
    finally:
        go.send_signal(signal.SIGINT)  # etcdctl resigns on SIGINT
        go.wait(10)
    thread.join(10)
    at, item = follower.wait_count(3)
    assert (item.value, item.term) == ("py-standby", box["t"].token)
    assert box["t"].token > revision
    assert follower.error is None
    box["t"].release()


def test_etcdctl_elect_listen_sees_a_python_campaign_leader(etcd_cluster, make_client):
    client = make_client(layout(etcd_cluster))
    name = "elect-py-%s" % client.flavour
    ticket = campaign(client, name, "py-primary:5432", lease=10)
    listener = etcdctl(etcd_cluster, "elect", "-l", name, stdout=subprocess.PIPE,
                       stderr=subprocess.DEVNULL)
    try:
        lines = []

        def read():
            for line in listener.stdout:
                lines.append(line.decode().strip())
        threading.Thread(target=read, daemon=True).start()
        assert wait_for(lambda: "py-primary:5432" in lines, 10), lines
        key = lines[lines.index("py-primary:5432") - 1]
        ((stored, revision, _),) = entries(etcd_cluster, name)
        assert key == stored and revision == ticket.token
    finally:
        listener.send_signal(signal.SIGINT)
        listener.wait(10)
    ticket.release()
