"""Who holds a key and which keys exist (spec §11) in both clients: the
``H`` and ``L`` frames byte for byte, the ``G``/``W``/``K``/``Z`` answers
gathered by id until ``Z``, ``keys()`` following the cursor, and the
clean-up after an indeterminate acquire (spec §8 rule 11) — against a
fake server, so that every answer is known."""

import asyncio
import struct
import time

import pytest

import kunci
from kunci import _protocol as P
from conftest import free_port, request_frames, wait_for

LABEL = "ünïcødé \"label\" \\ 🔒"


def grant_frame(ident, token, owner, lease_ms, held_ms, take, label):
    return (b"G" + struct.pack(">QQQIIH", ident, token, owner, lease_ms, held_ms, take)
            + label.encode() + b"\n")


def waiter_frame(ident, owner, wait_ms, take, label):
    return b"W" + struct.pack(">QQIH", ident, owner, wait_ms, take) + label.encode() + b"\n"


def key_frame(ident, grants, waiters, limit, key):
    return b"K" + struct.pack(">QIIH", ident, grants, waiters, limit) + key.encode() + b"\n"


def end_frame(ident, count, following):
    return b"Z" + struct.pack(">QIQ", ident, count, following) + b"\n"


# ------------------------------------------------------- frames, no client


def test_holders_and_list_frames_byte_for_byte():
    assert P.encode_holders(0x0102030405060708, b"jobs/a") == (
        b"H\x01\x02\x03\x04\x05\x06\x07\x08jobs/a\n")
    assert P.encode_list(7, 2**64 - 1, 1000, b"jobs/") == (
        b"L" + b"\x00" * 7 + b"\x07" + b"\xff" * 8 + b"\x03\xe8" + b"jobs/\n")
    assert P.encode_list(1, 0, 1, b"") == b"L" + struct.pack(">QQH", 1, 0, 1) + b"\n"


def test_answers_decode_byte_for_byte_even_split_at_every_byte():
    data = (grant_frame(5, 10, 70, 6500, 500, 0, LABEL)
            # A header full of 0x0A bytes: read by length, not by newline.
            + grant_frame(5, 0x0A0A, 0x0A, 0x0A0A0A0A, 0x0A, 0x0A0A, "")
            + waiter_frame(5, 72, 900, 2, "w")
            + end_frame(5, 3, 0)
            + key_frame(6, 1, 2, 3, "a b")
            + end_frame(6, 1, 1234))
    expected = [
        ("G", 5, 10, 70, 6500, 500, 0, LABEL),
        ("G", 5, 0x0A0A, 0x0A, 0x0A0A0A0A, 0x0A, 0x0A0A, ""),
        ("W", 5, 72, 900, 2, "w"),
        ("Z", 5, 3, 0),
        ("K", 6, 1, 2, 3, "a b"),
        ("Z", 6, 1, 1234),
    ]
    assert P.decode_frames(bytearray(data)) == expected
    buf = bytearray()
    frames = []
    for byte in data:
        buf.append(byte)
        frames += P.decode_frames(buf)
    assert frames == expected and not buf


# ------------------------------------------------- a fake server, both clients


def fake_table(make_proxy, lose_grants=False):
    """A fake server with a small table: acquires are granted (token 100,
    101, …; with ``lose_grants`` the grant is never answered), ``H``
    lists the key's grants (lease 30 s, held 1.5 s) and a waiter on
    ``queued``, ``L`` pages through the keys two at a time (the cursor is
    the index of the next key), ``R`` releases."""
    proxy = make_proxy(free_port())
    proxy.accept = "respond"
    table = {}  # key -> [(token, owner, take, label)]
    tokens = [100]

    def respond(data):
        answer = b""
        for op, header, rest in request_frames(data):
            if op in (b"A", b"S"):
                owner = struct.unpack(">Q", header[2:10])[0]
                if op == b"S":
                    klen = header[14]
                    key, label, take = rest[:klen], rest[klen:], struct.unpack(">H", header[12:14])[0]
                else:
                    key, label, take = rest, b"", 0
                token = tokens[0]
                tokens[0] += 1
                table.setdefault(key.decode(), []).append((token, owner, take, label.decode()))
                if not lose_grants:
                    answer += b"A" + struct.pack(">QQ", owner, token) + b"\n"
            elif op == b"R":
                token = struct.unpack(">Q", header)[0]
                key = rest.decode()
                before = table.get(key, [])
                table[key] = [grant for grant in before if grant[0] != token]
                if not table[key]:
                    del table[key]
                answer += (b"R" if len(table.get(key, [])) < len(before) else b"N") + header + b"\n"
            elif op == b"H":
                ident = struct.unpack(">Q", header)[0]
                key = rest.decode()
                frames = [grant_frame(ident, token, owner, 30000, 1500, take, label)
                          for token, owner, take, label in table.get(key, [])]
                if key == "queued":
                    frames.append(waiter_frame(ident, 5, 2001, 1, "next in line"))
                answer += b"".join(frames) + end_frame(ident, len(frames), 0)
            elif op == b"L":
                ident, cursor, count = struct.unpack(">QQH", header)
                keys = sorted(key for key in table if key.startswith(rest.decode()))
                page = keys[cursor:cursor + 2]
                following = cursor + 2 if cursor + 2 < len(keys) else 0
                answer += b"".join(key_frame(ident, len(table[key]), 0, 7, key) for key in page)
                answer += end_frame(ident, len(page), following)
        return answer

    proxy.responder = respond
    proxy.table = table
    return proxy


def sent(proxy):
    return request_frames(proxy.upstream_bytes())


def all_keys(client, prefix=""):
    """``list(client.keys(prefix))``, for the asyncio client with ``async for``."""
    if client.flavour == "sync":
        return list(client.keys(prefix))

    async def collect():
        return [key async for key in client.client.keys(prefix)]

    return client._runner.run(collect())


def test_holders_lists_grants_then_waiters_with_labels(make_proxy, make_client):
    proxy = fake_table(make_proxy)
    client = make_client(proxy.address)
    ticket = client.acquire("queued", lease=30, limit=7, take=2, label=LABEL)
    holders = client.holders("queued")
    owner = struct.unpack(">Q", sent(proxy)[0][1][2:10])[0]
    assert holders == kunci.Holders(
        grants=[kunci.Grant(token=ticket.token, owner=owner, take=2, lease_left=30.0,
                            held_for=1.5, label=LABEL)],
        waiters=[kunci.Waiter(owner=5, take=1, wait_left=2.001, label="next in line")],
        left_out=0)
    assert isinstance(holders.grants[0].lease_left, float)
    # The `H` frame, byte for byte, with a fresh id.
    op, header, key = sent(proxy)[1]
    assert (op, key) == (b"H", b"queued")
    assert proxy.upstream_bytes().endswith(b"H" + header + b"queued\n")
    assert client.holders("nobody") == kunci.Holders([], [], 0)
    ticket.detach()


def test_keys_follows_the_cursor_to_the_end(make_proxy, make_client):
    proxy = fake_table(make_proxy)
    client = make_client(proxy.address)
    for key in ["jobs/a", "jobs/b", "jobs/c", "jobs/d", "jobs/e", "other"]:
        client.acquire(key).detach()
    keys = all_keys(client, "jobs/")
    assert [key.key for key in keys] == ["jobs/a", "jobs/b", "jobs/c", "jobs/d", "jobs/e"]
    assert keys[0] == kunci.KeyInfo(key="jobs/a", grants=1, waiters=0, limit=7)
    pages = [struct.unpack(">QQH", header)[1:] + (rest,)
             for op, header, rest in sent(proxy) if op == b"L"]
    assert pages == [(0, 1000, b"jobs/"), (2, 1000, b"jobs/"), (4, 1000, b"jobs/")]
    assert len(all_keys(client)) == 6
    assert all_keys(client, "none/") == []
    keys, following = client.list_keys("", 2, 5)
    assert following == 4 and keys[0].key == "jobs/c"


def test_listing_input_is_checked_before_anything_is_sent(make_proxy, make_client):
    proxy = fake_table(make_proxy)
    client = make_client(proxy.address)
    with pytest.raises(kunci.InvalidArgument, match="key is empty"):
        client.holders("")
    with pytest.raises(kunci.InvalidArgument, match="prefix contains a newline"):
        client.list_keys("a\nb")
    with pytest.raises(kunci.InvalidArgument, match="prefix is longer than 255 bytes"):
        all_keys(client, "x" * 256)
    for count in (0, 1001, True, 1.0):
        with pytest.raises(kunci.InvalidArgument, match="count must be"):
            client.list_keys("", 0, count)
    with pytest.raises(kunci.InvalidArgument, match="cursor must be"):
        client.list_keys("", -1)
    assert proxy.accepted == 0


@pytest.mark.parametrize("answer", [
    # A `Z` that counts other than what came.
    lambda ident: grant_frame(ident, 1, 1, 1, 1, 0, "") + end_frame(ident, 2, 0),
    # A grant after a waiter.
    lambda ident: waiter_frame(ident, 1, 1, 0, "") + grant_frame(ident, 1, 1, 1, 1, 0, ""),
    # A key for holders; a grant for another id.
    lambda ident: key_frame(ident, 1, 0, 0, "k"),
    lambda ident: grant_frame(ident + 1, 1, 1, 1, 1, 0, ""),
])
def test_a_broken_answer_ends_the_session_indeterminate(make_proxy, make_client, answer):
    proxy = make_proxy(free_port())
    proxy.accept = "respond"
    proxy.responder = lambda data: answer(struct.unpack(">Q", request_frames(data)[0][1])[0])
    client = make_client(proxy.address)
    with pytest.raises(kunci.Indeterminate):
        client.holders("k")


def test_an_acquire_whose_grant_was_lost_is_released_after_holders(make_proxy, make_client):
    """Rule 11: the server granted the acquire but its answer never came.
    After ``Indeterminate`` the client asks ``H`` and releases exactly the
    grant of the failed call's owner, long before its 60 s lease ends."""
    proxy = fake_table(make_proxy, lose_grants=True)
    proxy.table["nightly"] = [(7, 1234, 1, "someone else")]
    client = make_client(proxy.address)
    started = time.monotonic()
    with pytest.raises(kunci.Indeterminate):
        client.acquire("nightly", wait=0, lease=60, shared=True)
    assert wait_for(lambda: len(proxy.table.get("nightly", [])) == 1, 2.0)
    assert time.monotonic() - started < 7.5
    assert proxy.table["nightly"] == [(7, 1234, 1, "someone else")]
    ops = [(op, header) for op, header, _ in sent(proxy)]
    owner = ops[0][1][2:10]
    assert [op for op, _ in ops] == [b"S", b"H", b"R"]
    assert ops[1][1] == owner  # the `H`'s id is the lost call's owner
    assert ops[2][1] == struct.pack(">Q", 100)


# ------------------------------------------------- against a real server


def test_holders_and_keys_against_a_real_server(server, make_client):
    client = make_client(server.address)
    tickets = [client.acquire("jobs/%04d" % n, lease=60) for n in range(1200)]
    shared = [client.acquire("catalog", lease=30, shared=True, label=label)
              for label in (LABEL, "second reader")]
    keys = all_keys(client, "jobs/")
    assert sorted(key.key for key in keys) == ["jobs/%04d" % n for n in range(1200)]
    assert all((key.grants, key.waiters, key.limit) == (1, 0, 0) for key in keys)
    [catalog] = all_keys(client, "cat")
    assert catalog == kunci.KeyInfo("catalog", 2, 0, 65535)
    holders = client.holders("catalog")
    assert [(g.token, g.take, g.label) for g in holders.grants] == [
        (shared[0].token, 1, LABEL), (shared[1].token, 1, "second reader")]
    assert all(29.0 < g.lease_left <= 30.0 and 0 <= g.held_for < 5.0 for g in holders.grants)
    assert holders.waiters == [] and holders.left_out == 0
    assert client.holders("nobody") == kunci.Holders([], [], 0)
    for ticket in tickets + shared:
        ticket.release()
    assert all_keys(client) == []


def test_a_lost_grant_frees_the_key_at_once_against_a_real_server(server, make_proxy,
                                                                  make_client):
    """Rule 11 end to end: the proxy drops the server's answers while the
    acquire goes through, then lets answers pass again; the call ends
    ``Indeterminate`` at its deadline and the clean-up frees the key long
    before its 60 s lease would end."""
    proxy = make_proxy(server.port)
    proxy.down = "drop"
    client = make_client(proxy.address)
    direct = make_client(server.address)

    def pass_answers_once_sent():
        wait_for(lambda: b"orphan" in proxy.upstream_bytes(), 5.0)
        time.sleep(0.2)  # the grant's answer is dropped meanwhile
        proxy.down = "pass"

    import threading
    threading.Thread(target=pass_answers_once_sent, daemon=True).start()
    with pytest.raises(kunci.Indeterminate):
        client.acquire("orphan", wait=0, lease=60)
    returned = time.monotonic()
    wait_for(lambda: direct.holders("orphan") == kunci.Holders([], [], 0), 2.0)
    assert time.monotonic() - returned < 2.0
    direct.acquire("orphan", wait=0, lease=5).release()
