"""The etcd recipe's decisions without etcd: key layout, value encoding,
the fit rule and wake sets. The same cases as the Rust client's unit tests
(src/client/etcd/recipe.rs), so that both read and judge a queue alike."""

import pytest

from kunci import _etcd as E


def entry(revision, value):
    return E.Entry(b"kunci/1:k/%016x" % revision, revision, revision, value.encode())


def queue(values):
    """The earlier entries the latest first (a DESCEND range), from values
    in create order."""
    return [entry(revision, value) for revision, value in enumerate(values, 1)][::-1]


def wake(verdict):
    assert verdict[0] == "waits", verdict
    return [e.create_revision for e in verdict[1]]


def test_prefixes_of_different_keys_never_overlap():
    a, ab = E.prefix_of(b"a"), E.prefix_of(b"a/b")
    assert (a, ab) == (b"kunci/1:a/", b"kunci/3:a/b/")
    assert E.prefix_end(a) == b"kunci/1:a0"
    assert a + b"%016x" % 7 < E.prefix_end(a)
    assert E.key_of(b"kunci/3:a/b/00000000000000ff") == b"a/b"
    for foreign in [b"other/1:a/1", b"kunci/x:a/1", b"kunci/2:a/1", b"kunci/1:a"]:
        assert E.key_of(foreign) is None


def test_a_plain_acquire_writes_the_value_every_version_wrote():
    assert E.claim_value(42, 0, 0, b"") == b"42"
    assert E.claim_value(7, 5, 0, b"") == b"7 5 0"
    assert E.claim_value(7, 3, 2, b"") == b"7 3 2"
    assert E.claim_value(7, 0, 0, b"ops") == b"7 0 0 ops"
    assert E.claim_value(7, 65535, 1, b"ann@db1 pid=9 backup --full") == \
        b"7 65535 1 ann@db1 pid=9 backup --full"


@pytest.mark.parametrize("bad", [
    b"", b"\xff\xfe", b"owner", b"12 3", b"12 3 4", b"12 0 1", b"12 65536 1", b"12 -1 0",
    b"x 3 1", b"12 3 x label", b"1_2", b"12 0x3 1",
])
def test_an_unreadable_value_is_exclusive(bad):
    assert E.decode(bad)[1] == E.EXCLUSIVE


def test_values_decode_with_their_labels():
    for limit, take, label in [(0, 0, b""), (3, 2, b""), (65535, 1, b"a b  c "), (9, 0, b"x")]:
        value = E.claim_value(12, limit, take, label)
        assert E.decode(value) == (12, (limit, take) if value != b"12" else E.EXCLUSIVE)
        assert E.decode_label(value) == label.decode()
    assert E.decode(b" 12\n") == (12, E.EXCLUSIVE)
    assert E.decode(b"12 3 4")[0] == 12


def test_an_exclusive_entry_holds_alone_and_watches_its_predecessor():
    assert E.judge(E.EXCLUSIVE, [], True) == ("holds",)
    earlier = queue(["1 5 1", "2 5 2"])
    assert wake(E.judge(E.EXCLUSIVE, earlier, True)) == [2]
    assert wake(E.judge((5, 0), earlier, True)) == [2]
    assert E.judge((6, 0), earlier, True) == ("mismatch", 5)


def test_counted_entries_fit_as_a_prefix_sum_in_fifo_order():
    two = queue(["1 2 1", "2 2 1"])
    assert E.judge((2, 1), two[1:], True) == ("holds",)
    assert wake(E.judge((2, 1), two, True)) == [2, 1]
    three = queue(["1 2 1", "2 2 1", "3 2 1"])
    assert wake(E.judge((2, 1), three, True)) == [3, 2]
    big = queue(["1 3 1", "2 3 3"])
    assert wake(E.judge((3, 1), big, True)) == [2]
    assert wake(E.judge((3, 3), big[1:], True)) == [1]
    readers = queue(["1 65535 1", "2 65535 1"])
    assert E.judge((65535, 1), readers, True) == ("holds",)
    assert wake(E.judge((65535, 1), queue(["1 65535 1", "2", "3 65535 1"]), True)) == [2]
    assert wake(E.judge((4, 1), queue(["1 4 1", "garbage"]), True)) == [2]


def test_the_earliest_conflicting_limit_is_reported_and_limit_0_never_conflicts():
    mixed = queue(["1", "2 3 1", "3 4 1"])
    assert E.judge((4, 1), mixed, True) == ("mismatch", 3)
    assert E.judge((3, 1), mixed, True) == ("mismatch", 4)
    assert wake(E.judge(E.EXCLUSIVE, mixed, True)) == [3]
    assert wake(E.judge((4, 1), mixed, False)) == [1]


@pytest.mark.parametrize("values, held", [
    ([], 0), (["1"], 1), (["1", "2"], 1), (["1 2 1", "2 2 1", "3 2 1"], 2),
    (["1 9 1", "2 9 1", "3", "4 9 1"], 2), (["1 9 0", "2 9 1"], 1),
    (["1 3 1", "2 3 3", "3 3 1"], 1), (["1 3 3", "2 3 1"], 1),
    (["1 4 1", "2 4 2", "3 4 1", "4 4 1"], 3),
])
def test_holders_are_the_prefix_that_fits(values, held):
    entries = queue(values)[::-1]
    assert E.holding(entries) == held
    for index, one in enumerate(entries):
        holds = E.judge(E.decode(one.value)[1], entries[:index][::-1], False) == ("holds",)
        assert holds == (index < held)


def old_decode(value):
    """The reader of the previous release (docs/ETCD.md, "The value"),
    line for line: no trailer."""
    text = value.decode("utf-8")
    owner = E._unsigned(text.strip(E._WHITESPACE), E.U64_MAX)
    if owner is not None:
        return owner, E.EXCLUSIVE, ""
    fields = text.split(" ", 3)
    owner = E._unsigned(fields[0], E.U64_MAX)
    if len(fields) < 3:
        return owner or 0, E.EXCLUSIVE, ""
    limit, take = E._unsigned(fields[1], 65535), E._unsigned(fields[2], 65535)
    if owner is not None and limit is not None and take is not None and take <= limit:
        return owner, (limit, take), fields[3] if len(fields) == 4 else ""
    return owner or 0, E.EXCLUSIVE, ""


def test_a_labelled_grant_stores_its_time_as_a_trailer_older_readers_tolerate():
    value = E.claim_value(7, 0, 0, b"host-a:5432", 1733300000.1234)
    assert value == b"7 0 0 host-a:5432\ngranted_ms=1733300000123"
    assert E.granted_ms(value) == 1733300000123
    assert (E.decode(value), E.decode_label(value)) == ((7, E.EXCLUSIVE), "host-a:5432")
    # An older reader: owner, limit and take exactly; the trailer shows in
    # the label only.
    assert old_decode(value) == (7, E.EXCLUSIVE, "host-a:5432\ngranted_ms=1733300000123")
    counted = E.claim_value(9, 3, 1, b"r 1", 2.0)
    assert counted == b"9 3 1 r 1\ngranted_ms=2000"
    assert E.decode(counted) == (9, (3, 1)) and old_decode(counted)[:2] == (9, (3, 1))
    # No label, or no time: the value of the previous release, no trailer.
    assert E.claim_value(7, 0, 0, b"", 5.0) == b"7"
    assert E.claim_value(7, 3, 1, b"", 5.0) == b"7 3 1"
    assert E.claim_value(7, 0, 0, b"a") == b"7 0 0 a"
    for stored in [b"7", b"7 0 0 a", b"7 0 0 a\ngranted_ms=", b"7 0 0 a\ngranted_ms=x1",
                   b"7 0 0 a\ngranted=5", b"7 0 0 a\ngranted_ms=-5"]:
        assert E.granted_ms(stored) is None, stored
    # Unknown fields are ignored, in any order.
    assert E.granted_ms(b"7 0 0 a\nnext=1\ngranted_ms=15") == 15
