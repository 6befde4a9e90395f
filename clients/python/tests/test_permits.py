"""Permits (spec §10, §8 rule 12): semaphores and shared locks in both
clients — the frames they send byte for byte, the checks made before
anything is sent, and the answers `X 10` / `X 11` from a fake server.
test_permits_e2e.py runs them against a real server."""

import struct

import pytest

import kunci
from kunci import _protocol as P
from conftest import free_port, request_frames

OWNER = 0x0102030405060708


# ------------------------------------------------------- frames, no client


def test_the_permits_frame_byte_for_byte():
    frame = P.encode_acquire_permits(3, 30, OWNER, 5, 2, b"backups", b"ops@db1 pid=42")
    assert frame == (
        b"S"
        + b"\x03"  # wait
        + b"\x1e"  # lease 30
        + b"\x01\x02\x03\x04\x05\x06\x07\x08"  # owner
        + b"\x00\x05"  # limit
        + b"\x00\x02"  # take
        + b"\x07"  # klen
        + b"backups"
        + b"ops@db1 pid=42"
        + b"\n"
    )
    # The largest: a 255-byte key, a 128-byte label, limit and take at
    # their maximum: 16 + 255 + 128 + 1 = 400 bytes (spec §2).
    largest = P.encode_acquire_permits(255, 255, 2**64 - 1, 65535, 65535, b"k" * 255, b"l" * 128)
    assert len(largest) == 400
    assert largest[:16] == b"S\xff\xff" + b"\xff" * 8 + b"\xff\xff\xff\xff\xff"


@pytest.mark.parametrize("limit, take, shared, expected", [
    (None, None, False, (0, 0)),
    (None, None, True, (65535, 1)),
    (3, None, False, (3, 1)),
    (5, 2, False, (5, 2)),
    (1, 1, False, (1, 1)),
    (65535, 65535, False, (65535, 65535)),
])
def test_permit_arguments_on_the_wire(limit, take, shared, expected):
    assert P.check_permits(limit, take, shared) == expected


def test_the_key_limit_is_read_from_the_mismatch_text():
    assert P.key_limit_of_mismatch("limit mismatch: key limit 5") == 5
    assert P.key_limit_of_mismatch("limit mismatch: key limit 65535") == 65535
    assert P.key_limit_of_mismatch("limit mismatch") is None
    assert P.key_limit_of_mismatch("limit mismatch: key limit 5 or so") is None


# ------------------------------------------------- a fake server, both clients


def fake_server(make_proxy, answer_acquire):
    """A fake server that answers every acquire (`A` or `S`) with
    ``answer_acquire(op, owner)``, pings with `P` and releases with `R`."""
    proxy = make_proxy(free_port())
    proxy.accept = "respond"

    def respond(data):
        answer = b""
        for op, header, _ in request_frames(data):
            if op in (b"A", b"S"):
                answer += answer_acquire(op, struct.unpack(">Q", header[2:10])[0])
            elif op == b"P":
                answer += b"P" + header + b"\n"
            elif op == b"R":
                answer += b"R" + header + b"\n"
        return answer

    proxy.responder = respond
    return proxy


def granting(op, owner):
    return b"A" + struct.pack(">QQ", owner, 1000 + owner % 1000) + b"\n"


def sent(proxy):
    return request_frames(proxy.upstream_bytes())


def test_an_exclusive_acquire_without_label_is_sent_as_a_byte_for_byte(make_proxy, make_client):
    proxy = fake_server(make_proxy, granting)
    client = make_client(proxy.address)
    for kwargs in ({}, {"shared": False}, {"label": ""}, {"label": None}):
        ticket = client.acquire("k", wait=0, lease=30, **kwargs)
        assert ticket.take == 0 and ticket.limit is None
        ticket.detach()
    frames = sent(proxy)
    assert len(frames) == 4
    for op, header, key in frames:
        owner = header[2:10]
        assert op + header + key == b"A\x00\x1e" + owner + b"k"
    assert proxy.upstream_bytes() == b"".join(b"A\x00\x1e" + h[2:10] + b"k\n" for _, h, _ in frames)


@pytest.mark.parametrize("kwargs, limit, take, label", [
    ({"shared": True}, 65535, 1, b""),
    ({"limit": 3}, 3, 1, b""),
    ({"limit": 5, "take": 2}, 5, 2, b""),
    ({"limit": 65535, "take": 65535}, 65535, 65535, b""),
    ({"label": "ops@db1 pid=42"}, 0, 0, b"ops@db1 pid=42"),
    ({"limit": 2, "label": "é" * 64}, 2, 1, "é".encode() * 64),
    ({"shared": True, "label": b"reader"}, 65535, 1, b"reader"),
])
def test_permits_or_a_label_are_sent_as_s_byte_for_byte(make_proxy, make_client,
                                                         kwargs, limit, take, label):
    proxy = fake_server(make_proxy, granting)
    client = make_client(proxy.address)
    ticket = client.acquire("backups", wait=0, lease=30, **kwargs)
    assert ticket.limit == (limit or None)
    assert ticket.take == take
    ticket.detach()
    [(op, header, rest)] = sent(proxy)
    owner = header[2:10]
    assert proxy.upstream_bytes() == (
        b"S\x00\x1e" + owner + struct.pack(">HHB", limit, take, 7) + b"backups" + label + b"\n")
    assert rest == b"backups" + label


def test_lock_takes_the_same_permit_keywords(make_proxy, make_client):
    proxy = fake_server(make_proxy, granting)
    client = make_client(proxy.address)
    with client.lock("backups", wait=5, lease=30, limit=4, take=2, label="nightly") as ticket:
        assert (ticket.limit, ticket.take) == (4, 2)
    with client.lock("catalog", wait=5, shared=True) as ticket:
        assert (ticket.limit, ticket.take) == (65535, 1)
    ops = [(op, header[10:]) for op, header, _ in sent(proxy)]
    assert ops[0] == (b"S", struct.pack(">HHB", 4, 2, 7))
    assert ops[1][0] == b"R"
    assert ops[2] == (b"S", struct.pack(">HHB", 65535, 1, 7))
    assert ops[3][0] == b"R"


INVALID = [
    ({"take": 1}, "take needs a limit"),
    ({"limit": 2, "take": 3}, "take 3 is more than the limit 2"),
    ({"limit": 0}, "limit must be"),
    ({"limit": 65536}, "limit must be"),
    ({"limit": -1}, "limit must be"),
    ({"limit": 2.0}, "limit must be"),
    ({"limit": True}, "limit must be"),
    ({"limit": "3"}, "limit must be"),
    ({"limit": 3, "take": 0}, "take must be"),
    ({"limit": 3, "take": 65536}, "take must be"),
    ({"limit": 3, "take": False}, "take must be"),
    ({"shared": True, "limit": 65535}, "shared=True"),
    ({"shared": True, "take": 1}, "shared=True"),
    ({"shared": 1}, "shared must be True or False"),
    ({"label": "x" * 129}, "label is longer than 128 bytes"),
    ({"label": "é" * 65}, "label is longer than 128 bytes"),  # 130 bytes
    ({"label": "a\nb"}, "label contains a newline"),
    ({"label": b"\xff"}, "label is not valid UTF-8"),
    ({"label": "\ud800"}, "label is not valid UTF-8"),
    ({"label": 42}, "label must be a str"),
]


@pytest.mark.parametrize("kwargs, message", INVALID)
def test_invalid_permits_or_label_send_nothing(make_proxy, make_client, kwargs, message):
    proxy = fake_server(make_proxy, granting)
    client = make_client(proxy.address)
    with pytest.raises(kunci.InvalidArgument, match=message):
        client.acquire("k", wait=1, **kwargs)
    with pytest.raises(kunci.InvalidArgument, match=message):
        with client.lock("k", wait=1, **kwargs):
            pytest.fail("entered the block")
    assert proxy.accepted == 0


def test_limit_mismatch_is_definitive_and_names_the_keys_limit(make_proxy, make_client):
    def mismatch(op, owner):
        return b"X" + struct.pack(">BQ", 10, owner) + b"limit mismatch: key limit 5\n"

    proxy = fake_server(make_proxy, mismatch)
    client = make_client(proxy.address)
    with pytest.raises(kunci.LimitMismatch) as caught:
        client.acquire("backups", wait=10, limit=3)
    error = caught.value
    assert error.limit == 5
    assert isinstance(error, kunci.Error) and not isinstance(error, kunci.InvalidArgument)
    assert str(error) == ("limit mismatch: key 'backups' has limit 5, this request named "
                          "limit 3; nothing was acquired")
    with pytest.raises(kunci.LimitMismatch):
        with client.lock("backups", wait=10, limit=3):
            pytest.fail("entered the block")
    # Not fatal: the session goes on.
    client.ping()
    assert proxy.accepted == 1
    assert [op for op, _, _ in sent(proxy)] == [b"S", b"S", b"P"]


def test_limit_mismatch_with_a_text_that_names_no_limit(make_proxy, make_client):
    def mismatch(op, owner):
        return b"X" + struct.pack(">BQ", 10, owner) + b"limit mismatch\n"

    client = make_client(fake_server(make_proxy, mismatch).address)
    with pytest.raises(kunci.LimitMismatch, match="has no known limit") as caught:
        client.acquire("k", limit=3)
    assert caught.value.limit is None


def test_invalid_count_from_the_server_is_invalid_argument(make_proxy, make_client):
    def invalid(op, owner):
        return b"X" + struct.pack(">BQ", 11, owner) + b"invalid count\n"

    proxy = fake_server(make_proxy, invalid)
    client = make_client(proxy.address)
    with pytest.raises(kunci.InvalidArgument, match=r"invalid count \(X 11\)"):
        client.acquire("k", limit=3, take=2)
    client.ping()
    assert proxy.accepted == 1
