"""The client on a real 3-member etcd cluster (``etcd://``): every outcome,
FIFO, a lock kept across ``kill -9`` of the leader, a silent member, and
the Rust client (the `kunci` binary) and this one sharing keys. One cluster
serves the whole module; the test that kills its leader runs last."""

import base64
import json
import os
import subprocess
import threading
import time
import urllib.request

import pytest

import kunci
import kunci._common
import kunci._protocol
from conftest import free_port, kunci_bin, outcome, wait_for


def gateway(cluster, path, body):
    """One request to etcd's gateway on the first live member."""
    for member in cluster.members:
        if member["process"].poll() is not None:
            continue
        request = urllib.request.Request(
            "http://%s%s" % (member["client"], path), data=json.dumps(body).encode(),
            method="POST")
        with urllib.request.urlopen(request, timeout=5) as answer:
            return json.loads(answer.read())
    raise AssertionError("no live member")


def entries(cluster, key):
    """The etcd entries of kunci key ``key``: (name, value, lease) in create order."""
    prefix = b"kunci/%d:%s/" % (len(key), key.encode())
    answer = gateway(cluster, "/v3/kv/range", {
        "key": base64.b64encode(prefix).decode(),
        "range_end": base64.b64encode(prefix.rstrip(b"/") + b"0").decode(),
        "sort_target": "CREATE", "sort_order": "ASCEND"})
    return [(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", "")),
             int(kv["lease"])) for kv in answer.get("kvs", [])]


@pytest.fixture
def short_deadline(monkeypatch):
    """Calls end by start + 1 s instead of 5 s (spec §8's D, made short so
    that the tests of Unavailable and Indeterminate take little time)."""
    monkeypatch.setattr(kunci._protocol, "TRANSPORT_DEADLINE", 1.0)
    return 1.0


def test_etcd_grants_timeouts_and_releases_exactly_as_a_server(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    key = "outcomes-" + client.flavour
    ticket = client.acquire(key, lease=10, label="first")
    assert ticket.token > 0
    assert ticket.valid_until <= time.monotonic() + 10
    status = client.query(key)
    assert status.token == ticket.token and status.waiters == 0
    assert 9000 <= status.lease_ms <= 10000
    assert entries(etcd_cluster, key)[0][1] == b"%d 0 0 first" % status.owner
    kind, elapsed, _ = outcome(client.acquire, key)
    assert kind is kunci.Timeout and elapsed < 1
    kind, elapsed, _ = outcome(client.acquire, key, wait=0.4)
    assert kind is kunci.Timeout and 0.4 <= elapsed < 2
    assert len(entries(etcd_cluster, key)) == 1, "a timed-out waiter leaves nothing behind"
    ticket.renew(lease=12)
    assert ticket.valid_until > time.monotonic() + 10
    ticket.release()
    assert client.query(key) is None
    kind, _, error = outcome(client.release, key, ticket.token)
    assert kind is kunci.NotHeld and str(ticket.token) in str(error)
    assert outcome(client.renew, key, ticket.token)[0] is kunci.NotHeld
    later = client.acquire(key)
    assert later.token > ticket.token
    later.release()


def test_etcd_refuses_bad_arguments_before_sending(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    for call, args, kwargs in [
        (client.acquire, ("",), {}),
        (client.acquire, ("k",), {"lease": 0}),
        (client.acquire, ("k",), {"limit": 2, "take": 3}),
        (client.acquire, ("k",), {"label": "a\nb"}),
        (client.list_keys, ("",), {"cursor": 12345}),
    ]:
        kind, elapsed, error = outcome(call, *args, **kwargs)
        assert kind is kunci.InvalidArgument, (args, kwargs, error)
        assert elapsed < 1.5  # generous: sent, it would take D (>= 5 s)
    assert "unknown or forgotten listing cursor" in str(outcome(
        client.list_keys, "", cursor=12345)[2])


def test_etcd_permits_fit_as_a_prefix_sum_and_a_wrong_limit_is_refused(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    key = "permits-" + client.flavour
    first = client.acquire(key, limit=3, take=2, label="two")
    second = client.acquire(key, limit=3)
    kind, _, error = outcome(client.acquire, key, limit=4)
    assert kind is kunci.LimitMismatch and error.limit == 3
    assert outcome(client.acquire, key, limit=3, wait=0.2)[0] is kunci.Timeout
    kind, _, error = outcome(client.acquire, key, limit=5, wait=1)
    assert kind is kunci.LimitMismatch and error.limit == 3
    assert len(entries(etcd_cluster, key)) == 2, "a refused request leaves nothing behind"
    holders = client.holders(key)
    assert [(g.token, g.take, g.label) for g in holders.grants] == [
        (first.token, 2, "two"), (second.token, 1, "")]
    assert all(0 < g.lease_left <= 30 and g.held_for == 0 for g in holders.grants)
    first.release()
    second.release()
    readers = [client.acquire(key + "-rw", shared=True) for _ in range(3)]
    assert outcome(client.acquire, key + "-rw")[0] is kunci.Timeout
    for reader in readers:
        reader.release()


def test_etcd_grants_in_fifo_order_and_waiters_are_listed(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    key = "fifo-" + client.flavour
    holder = client.acquire(key, lease=10)
    granted = []
    tickets = []

    def wait(index):
        ticket = client.acquire(key, wait=20, lease=10, label="w%d" % index)
        granted.append(index)
        tickets.append(ticket)
        time.sleep(0.05)
        ticket.release()

    threads = []
    for index in range(4):
        thread = threading.Thread(target=wait, args=(index,))
        thread.start()
        threads.append(thread)
        wait_for(lambda: len(client.holders(key).waiters) == index + 1, 10)
    assert [w.label for w in client.holders(key).waiters] == ["w0", "w1", "w2", "w3"]
    assert client.list_keys(key) == ([kunci.KeyInfo(key, 1, 4, 0)], 0)
    holder.release()
    for thread in threads:
        thread.join(30)
    assert granted == [0, 1, 2, 3]
    tokens = [ticket.token for ticket in tickets]
    assert tokens == sorted(tokens) and tokens[0] > holder.token


def test_etcd_listing_pages_through_every_key_once(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    prefix = "page-%s-" % client.flavour
    tickets = [client.acquire(prefix + name, limit=3, take=take)
               for name, take in (("a", 1), ("a", 2), ("b", 1), ("c", 3))]
    seen, cursor = [], 0
    while True:
        keys, cursor = client.list_keys(prefix, cursor, count=1)
        seen.extend(keys)
        if cursor == 0:
            break
    assert seen == [kunci.KeyInfo(prefix + "a", 2, 0, 3), kunci.KeyInfo(prefix + "b", 1, 0, 3),
                    kunci.KeyInfo(prefix + "c", 1, 0, 3)]
    keys, cursor = client.list_keys(prefix, 0, count=1)
    other = make_client(etcd_cluster.address)
    kind, _, error = outcome(other.list_keys, prefix, cursor, count=1)
    assert kind is kunci.InvalidArgument and "unknown or forgotten listing cursor" in str(error)
    for ticket in tickets:
        ticket.release()


def test_etcd_cancelled_asyncio_waiter_leaves_the_queue(etcd_cluster):
    import asyncio

    async def scenario():
        client = kunci.aio.Client(etcd_cluster.address)
        holder = await client.acquire("cancelled")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.acquire("cancelled", wait=20), 0.3)
        started = time.monotonic()
        while len(entries(etcd_cluster, "cancelled")) > 1:
            assert time.monotonic() - started < 2, "the abandoned entry stayed"
            await asyncio.sleep(0.05)
        await holder.release()
        await client.close()

    asyncio.run(scenario())


def test_etcd_closing_a_sync_client_ends_its_waiting_acquire_and_its_entry(etcd_cluster):
    # As on a kunci server, close() ends the calls in progress: a waiting
    # acquire stops within its watch's check (0.2 s) instead of waiting on,
    # its entry leaves the queue, and nothing is held.
    holder_client = kunci.Client(etcd_cluster.address)
    holder = holder_client.acquire("closed-wait", lease=30)
    client = kunci.Client(etcd_cluster.address)
    ended = []

    def wait():
        started = time.monotonic()
        kind, _, error = outcome(client.acquire, "closed-wait", wait=30, lease=30)
        ended.append((kind, str(error), time.monotonic() - started))

    thread = threading.Thread(target=wait)
    thread.start()
    assert wait_for(lambda: len(entries(etcd_cluster, "closed-wait")) == 2, 10)
    closed_at = time.monotonic()
    client.close()
    thread.join(5)
    assert ended and ended[0][0] is kunci.Unavailable and "closed" in ended[0][1], ended
    assert time.monotonic() - closed_at < 2.0
    assert len(entries(etcd_cluster, "closed-wait")) == 1
    assert holder_client.query("closed-wait").token == holder.token
    holder.release()
    holder_client.close()


def test_etcd_unavailable_when_no_member_answers_and_moves_past_dead_ones(
        etcd_cluster, make_client, short_deadline):
    nobody = make_client("etcd://127.0.0.1:%d" % free_port())
    kind, elapsed, error = outcome(nobody.acquire, "u", wait=0)
    assert kind is kunci.Unavailable and 1.0 <= elapsed < 2.5, (kind, elapsed, error)
    assert outcome(nobody.query, "u")[0] is kunci.Unavailable
    # A member that refuses connections is certainly not sent to: the
    # request moves on to the next.
    client = make_client("etcd://127.0.0.1:%d,%s" % (free_port(), etcd_cluster.endpoints[0]))
    client.acquire("moves-" + client.flavour).release()


def _forwarding_leases_only(member):
    """A member that answers lease requests (by asking the real one) and
    never answers anything else: it grants, then goes silent."""
    def respond(data):
        head, _, body = bytes(data).partition(b"\r\n\r\n")
        path = head.split(b" ")[1].decode()
        if not path.startswith("/v3/lease/"):
            return b""
        request = urllib.request.Request("http://%s%s" % (member, path), data=body,
                                         method="POST")
        with urllib.request.urlopen(request, timeout=5) as answer:
            payload = answer.read()
        return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(payload), payload)
    return respond


def test_etcd_silent_member_makes_the_deciding_request_indeterminate_and_never_resends_it(
        etcd_cluster, make_client, make_proxy, short_deadline, monkeypatch):
    silent = make_proxy(1)
    silent.accept = "respond"
    silent.responder = _forwarding_leases_only(etcd_cluster.endpoints[0])
    client = make_client("etcd://" + silent.address)
    key = "silent-" + client.flavour
    kind, elapsed, _ = outcome(client.acquire, key)
    assert kind is kunci.Indeterminate and 1.0 <= elapsed < 2.5, (kind, elapsed)
    txns = [data for _, data in silent.received if data.startswith(b"POST /v3/kv/txn")]
    assert len(txns) == 1, "a possibly-sent transaction is never sent again"
    assert entries(etcd_cluster, key) == []

    # A member that takes everything and answers nothing, in front of the
    # cluster: reads move on; a held lock's release through it alone is
    # indeterminate at D.
    ticket = make_client(etcd_cluster.address).acquire(key)
    dropping = make_proxy(etcd_cluster.members[0]["port"])
    dropping.down = "drop"
    alone = make_client("etcd://" + dropping.address)
    kind, elapsed, _ = outcome(alone.release, key, ticket.token)
    assert kind is kunci.Indeterminate and 1.0 <= elapsed < 2.5, (kind, elapsed)
    # A read is repeated: after one attempt's limit (2 s) on the silent
    # member, it moves on, within the usual D of 5 s.
    monkeypatch.setattr(kunci._protocol, "TRANSPORT_DEADLINE", 5.0)
    before = make_client("etcd://%s,%s" % (dropping.address, etcd_cluster.endpoints[1]))
    kind, elapsed, status = outcome(before.query, key)
    assert kind == "ok" and status.token == ticket.token and 2.0 <= elapsed < 4, (kind, elapsed)
    ticket.release()


def _revoke_lease_of(cluster, key):
    (_, _, lease), = entries(cluster, key)
    gateway(cluster, "/v3/lease/revoke", {"ID": str(lease)})


def test_etcd_lock_lost_when_its_lease_is_gone_or_the_cluster_unreachable(
        etcd_cluster, make_client, make_proxy):
    client = make_client(etcd_cluster.address)
    key = "lost-" + client.flavour
    lost = []
    with client.lock(key, lease=3, on_lost=lambda t: lost.append(t.token)) as ticket:
        _revoke_lease_of(etcd_cluster, key)
        wait_for(lambda: lost, 3)
        assert lost == [ticket.token] and ticket.lost
        with pytest.raises(kunci.LockLost):
            ticket.check()
    proxy = make_proxy(etcd_cluster.members[1]["port"])
    behind = make_client("etcd://" + proxy.address)
    lost.clear()
    with behind.lock(key, lease=2, on_lost=lambda t: lost.append(time.monotonic())) as ticket:
        proxy.up = proxy.down = "drop"
        proxy.cut_all()
        # No renewal can succeed from here on: lost at valid_until, not before.
        bound = ticket.valid_until
        wait_for(lambda: lost, 4)
        assert bound - 0.01 <= lost[0] < bound + 1
        with pytest.raises(kunci.LockLost):
            ticket.check()


def test_etcd_managed_lock_outlives_its_lease(etcd_cluster, make_client):
    client = make_client(etcd_cluster.address)
    key = "kept-" + client.flavour
    with client.lock(key, lease=2) as ticket:
        time.sleep(2.5)
        ticket.check()
        assert outcome(client.acquire, key)[0] is kunci.Timeout
    assert client.query(key) is None


# ------------------------------------------------------ Rust and Python


def kunci_cli(cluster, *args):
    environ = dict(os.environ, KUNCI_SERVER=cluster.address)
    return subprocess.run([kunci_bin(), *args], capture_output=True, text=True, timeout=60,
                          env=environ)


def test_etcd_rust_and_python_share_one_queue_without_overlap(etcd_cluster, tmp_path):
    key = "shared-run"
    log_path = tmp_path / "log"
    log_lock = threading.Lock()
    script = ('echo "start $KUNCI_TOKEN" >> %s; sleep 0.05; echo "end $KUNCI_TOKEN" >> %s'
              % (log_path, log_path))

    def rust():
        for _ in range(4):
            done = kunci_cli(etcd_cluster, "run", key, "--wait", "30", "--lease", "5",
                             "--", "sh", "-c", script)
            assert done.returncode == 0, done.stderr

    def python():
        client = kunci.Client(etcd_cluster.address)
        for _ in range(4):
            with client.lock(key, wait=30, lease=5) as ticket:
                with log_lock, open(log_path, "a") as log:
                    log.write("start %d\n" % ticket.token)
                time.sleep(0.05)
                with log_lock, open(log_path, "a") as log:
                    log.write("end %d\n" % ticket.token)
        client.close()

    threads = [threading.Thread(target=f) for f in (rust, rust, python, python)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    print("16 turns in %.2f s" % (time.monotonic() - started))
    lines = [line.split() for line in log_path.read_text().splitlines()]
    assert len(lines) == 32
    starts = [int(token) for kind, token in lines[0::2]]
    assert [kind for kind, _ in lines] == ["start", "end"] * 16, "never two holders at once"
    assert [token for _, token in lines[0::2]] == [token for _, token in lines[1::2]]
    assert starts == sorted(starts) and len(set(starts)) == 16, "tokens strictly increase"


def test_etcd_rust_holder_blocks_python_and_python_holder_blocks_rust(etcd_cluster):
    client = kunci.Client(etcd_cluster.address)
    held = kunci_cli(etcd_cluster, "acquire", "rust-held", "--lease", "10", "--label", "rust")
    assert held.returncode == 0, held.stderr
    token = int(held.stdout.split()[-1])
    started = time.monotonic()
    releaser = threading.Timer(0.5, kunci_cli, (etcd_cluster, "release", "rust-held", str(token)))
    releaser.start()
    assert outcome(client.acquire, "rust-held")[0] is kunci.Timeout
    grants = client.holders("rust-held").grants
    assert [(g.token, g.label) for g in grants] == [(token, "rust")]
    ticket = client.acquire("rust-held", wait=10, label="python")
    assert time.monotonic() - started >= 0.5 and ticket.token > token
    releaser.join()

    who = kunci_cli(etcd_cluster, "who", "rust-held", "--json")
    assert who.returncode == 0, who.stderr
    assert [g["label"] for g in json.loads(who.stdout)["grants"]] == ["python"]
    listed = kunci_cli(etcd_cluster, "list", "rust-", "--json")
    assert "rust-held" in listed.stdout
    assert kunci_cli(etcd_cluster, "acquire", "rust-held").returncode == 1
    threading.Timer(0.5, ticket.release).start()
    waited = kunci_cli(etcd_cluster, "acquire", "rust-held", "--wait", "10")
    assert waited.returncode == 0, waited.stderr
    assert int(waited.stdout.split()[-1]) > ticket.token
    assert [k.key for k in client.keys("rust-")] == ["rust-held"]
    client.release("rust-held", int(waited.stdout.split()[-1]))
    client.close()


# Last: it kills a member of the module's cluster.
def _acquire_in_thread(client, *args, **kwargs):
    box = {}

    def run():
        started = time.monotonic()
        try:
            box["result"] = client.acquire(*args, **kwargs)
        except BaseException as error:  # noqa: B902
            box["error"] = error
        box["took"] = time.monotonic() - started

    box["thread"] = threading.Thread(target=run, daemon=True)
    box["thread"].start()
    return box


@pytest.mark.parametrize("slice_s", [1.0, None])
def test_etcd_wait_forever_is_granted_after_any_number_of_waits(
        etcd_cluster, make_client, monkeypatch, slice_s):
    # wait=None on etcd: each attempt queues one slice (1 s here, or the
    # default), leaves nothing behind when it runs out, and asks again.
    if slice_s is not None:
        monkeypatch.setattr(kunci._common, "WAIT_FOREVER_SLICE", slice_s)
    holder = make_client(etcd_cluster.address)
    client = make_client(etcd_cluster.address)
    key = "forever-%s-%s" % (client.flavour, slice_s)
    held = holder.acquire(key, lease=30)
    box = _acquire_in_thread(client, key, wait=None, lease=7)
    time.sleep(2.6)
    assert "took" not in box, box
    assert client.query(key).token == held.token
    held.release()
    box["thread"].join(5)
    assert "took" in box, "still waiting 5 s after the release"
    assert "error" not in box, box["error"]
    ticket = box["result"]
    assert ticket.token > held.token and ticket.lease == 7
    assert 2.6 <= box["took"] < 8
    assert len(entries(etcd_cluster, key)) == 1, "the waits that ran out left nothing behind"
    ticket.release()
    assert client.query(key) is None


def test_etcd_lock_is_kept_while_the_leader_is_killed(etcd_cluster):
    client = kunci.Client(etcd_cluster.address)
    other = kunci.Client(etcd_cluster.address)
    with client.lock("failover", lease=2) as ticket:
        etcd_cluster.kill(etcd_cluster.leader())
        until = time.monotonic() + 5
        while time.monotonic() < until:
            ticket.check()
            kind = outcome(other.acquire, "failover")[0]
            assert kind in (kunci.Timeout, kunci.Unavailable, kunci.Indeterminate), kind
            time.sleep(0.2)
        ticket.check()
    assert other.acquire("failover", wait=5).token > ticket.token
    client.close()
    other.close()
