"""Frames, input checks and the numbers of the client contract.

Everything here is pure: no sockets, no clock. The sync and asyncio
clients share it.
"""

import math
import os
import re
import struct
from typing import Any, List, Tuple

#: How long past its wait (or past its start, for calls that do not wait)
#: a call may take: the transport deadline of spec §8 rule 2. It is part
#: of the contract, not a setting.
TRANSPORT_DEADLINE = 5.0

#: The longest wait an acquire may ask for, in seconds.
WAIT_MAX = 255

#: The longest lease, in whole seconds (the shortest is 1).
LEASE_MAX = 255

#: The address used when neither the caller nor ``KUNCI_SERVER`` names one.
DEFAULT_SERVER = "127.0.0.1:5862"

KEY_LEN_MAX = 255

#: The most permits a key may have, and the most one request may take.
PERMITS_MAX = 65535

#: A shared lock (reader of a reader/writer lock) is this many permits,
#: taking one (spec §10 rule 6).
SHARED_LIMIT = PERMITS_MAX

#: The longest label, in UTF-8 bytes (spec §11.1).
LABEL_LEN_MAX = 128

#: Most keys one ``L`` request may ask for, and most grants (or waiters)
#: one ``H`` answer lists (spec §11).
LIST_COUNT_MAX = 1000
HOLDERS_MAX = 1000

#: Longest ``I`` or ``X`` text a server may send (the Rust client's bound).
RESPONSE_TEXT_MAX = 4096

_U64_MAX = (1 << 64) - 1

# Fixed header size of each response op (spec §2.2), after the op byte.
_HEADER_LEN = {
    0x41: 16,  # A owner token
    0x54: 8,  # T owner
    0x42: 8,  # B owner
    0x52: 8,  # R token
    0x45: 8,  # E token
    0x4E: 8,  # N token
    0x51: 24,  # Q token owner lease_ms waiters
    0x50: 8,  # P nonce
    0x49: 0,  # I text
    0x58: 9,  # X code id text
    0x47: 34,  # G id token owner lease_ms held_ms take label
    0x57: 22,  # W id owner wait_ms take label
    0x4B: 18,  # K id grants waiters limit key
    0x5A: 20,  # Z id count next
    0x55: 0,  # U name
    0x56: 30,  # V id token lease_ms held_ms grants waiters label
    0x43: 8,  # C token
}

# The ops whose frame carries text between the fixed header and ``\n``.
_TEXT_OPS = frozenset((0x49, 0x58, 0x47, 0x57, 0x4B, 0x55, 0x56))

# Error codes (spec §6).
ERROR_CONNECTION_LIMIT = 7
ERROR_SHUTTING_DOWN = 8
ERROR_NOT_ALLOWED = 9
ERROR_LIMIT_MISMATCH = 10
ERROR_INVALID_COUNT = 11
ERROR_NOT_AUTHENTICATED = 12
ERROR_NOT_PERMITTED = 13
ERROR_TOO_MANY_WATCHES = 14
ERROR_UNKNOWN_OP = 1
NON_FATAL_ERRORS = frozenset(
    (3, 4, 5, 6, ERROR_LIMIT_MISMATCH, ERROR_INVALID_COUNT, ERROR_NOT_PERMITTED,
     ERROR_TOO_MANY_WATCHES))
ERROR_TEXT = {
    1: "unknown op byte",
    2: "frame too long",
    3: "key empty",
    4: "key not valid UTF-8",
    5: "lease 0",
    6: "non-empty variable part",
    7: "connection limit reached",
    8: "server shutting down",
    9: "peer not allowed (--allow)",
    10: "limit mismatch",
    11: "invalid count",
    12: "not authenticated",
    13: "not permitted",
    14: "too many watches",
}

#: The shortest secret a server accepts (spec §12.2), in bytes; the longest
#: is what a request's variable part holds.
SECRET_LEN_MIN = 32
SECRET_LEN_MAX = 255

# The text of ``X 10`` (spec §6), which carries the key's limit.
_LIMIT_MISMATCH_TEXT = re.compile(r"limit mismatch: key limit ([0-9]{1,5})\Z")

_PACK_A = struct.Struct(">BBQ").pack
_PACK_S = struct.Struct(">BBQHHB").pack
_PACK_Q64 = struct.Struct(">Q").pack
_PACK_E = struct.Struct(">BQ").pack
_UNPACK_Q64 = struct.Struct(">Q").unpack_from
_UNPACK_A = struct.Struct(">QQ").unpack_from
_UNPACK_QUERY = struct.Struct(">QQII").unpack_from
_UNPACK_X = struct.Struct(">BQ").unpack_from
_UNPACK_G = struct.Struct(">QQQIIH").unpack_from
_UNPACK_W = struct.Struct(">QQIH").unpack_from
_UNPACK_K = struct.Struct(">QIIH").unpack_from
_UNPACK_Z = struct.Struct(">QIQ").unpack_from
_PACK_L = struct.Struct(">QQH").pack
_PACK_O = struct.Struct(">BQQ").pack
_UNPACK_V = struct.Struct(">QQIIHI").unpack_from


class ProtocolError(Exception):
    """Bytes from the server that do not decode: the session must end."""


def drift_margin(lease):
    """Seconds taken off a lease for the server's clock running faster than
    ours: 10 ms plus 0.2 % of the lease (the Rust client's margin: 2000 ppm,
    twice the largest slew NTP applies to two drifting clocks, plus a ms
    tick)."""
    return 0.010 + lease / 500.0


def valid_until(sent_at, lease):
    """The conservative expiry of a lease whose request was handed to the
    socket just after ``sent_at`` (spec §8 rule 9)."""
    return sent_at + lease - drift_margin(lease)


def _utf8(value, what):
    """``value`` (str or bytes) as UTF-8 bytes, or ``ValueError``."""
    if isinstance(value, str):
        try:
            return value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("%s is not valid UTF-8 (it contains a lone surrogate)" % what)
    if isinstance(value, (bytes, bytearray)):
        data = bytes(value)
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError("%s is not valid UTF-8" % what)
        return data
    raise ValueError("%s must be a str, not %s" % (what, type(value).__name__))


def check_key(key):
    """The key as UTF-8 bytes, or ``ValueError`` naming the problem."""
    data = _utf8(key, "key")
    if not data:
        raise ValueError("key is empty")
    if len(data) > KEY_LEN_MAX:
        raise ValueError("key is longer than 255 bytes")
    if b"\n" in data:
        raise ValueError("key contains a newline")
    return data


def check_prefix(prefix):
    """A prefix of keys as UTF-8 bytes: like a key, but it may be empty."""
    data = _utf8(prefix, "prefix")
    if len(data) > KEY_LEN_MAX:
        raise ValueError("prefix is longer than 255 bytes")
    if b"\n" in data:
        raise ValueError("prefix contains a newline")
    return data


def check_secret(secret):
    """The secret as bytes (``None``: no secret), or ``ValueError``. One
    trailing newline is dropped, as when the secret was read from a file
    (spec §12.5); what is left must be 32..=255 bytes without a newline."""
    if secret is None:
        return None
    if isinstance(secret, str):
        try:
            data = secret.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("secret is not valid UTF-8 (it contains a lone surrogate)")
    elif isinstance(secret, (bytes, bytearray)):
        data = bytes(secret)
    else:
        raise ValueError("secret must be a str or bytes, not %s" % type(secret).__name__)
    if data.endswith(b"\n"):
        data = data[:-1]
    if len(data) < SECRET_LEN_MIN:
        raise ValueError("secret is shorter than %d bytes (%d): a server refuses it"
                         % (SECRET_LEN_MIN, len(data)))
    if len(data) > SECRET_LEN_MAX:
        raise ValueError("secret is longer than %d bytes (%d)" % (SECRET_LEN_MAX, len(data)))
    if b"\n" in data:
        raise ValueError("secret contains a newline")
    return data


def _is_count(value):
    return isinstance(value, int) and not isinstance(value, bool)


def check_permits(limit, take, shared):
    """The ``(limit, take)`` written on the wire for an acquire's permit
    arguments (spec §10): exclusive with no limit is ``(0, 0)``; ``shared``
    is ``(65535, 1)``; ``limit`` alone takes 1 permit; ``take`` needs a
    ``limit`` and at most that many. ``ValueError`` names the problem."""
    if not isinstance(shared, bool):
        raise ValueError("shared must be True or False, got %r" % (shared,))
    if shared:
        if limit is not None or take is not None:
            raise ValueError("shared=True is limit %d take 1: it takes no limit or take"
                             % SHARED_LIMIT)
        return SHARED_LIMIT, 1
    if limit is None:
        if take is not None:
            raise ValueError("take needs a limit (take permits out of how many?)")
        return 0, 0
    if not _is_count(limit) or not 1 <= limit <= PERMITS_MAX:
        raise ValueError("limit must be a whole number from 1 to %d, got %r" % (PERMITS_MAX, limit))
    if take is None:
        return limit, 1
    if not _is_count(take) or not 1 <= take <= PERMITS_MAX:
        raise ValueError("take must be a whole number from 1 to %d, got %r" % (PERMITS_MAX, take))
    if take > limit:
        raise ValueError("take %d is more than the limit %d" % (take, limit))
    return limit, take


def check_label(label):
    """The label as UTF-8 bytes (``None`` is empty): at most 128 bytes, no
    newline."""
    if label is None:
        return b""
    data = _utf8(label, "label")
    if len(data) > LABEL_LEN_MAX:
        raise ValueError("label is longer than %d bytes (%d)" % (LABEL_LEN_MAX, len(data)))
    if b"\n" in data:
        raise ValueError("label contains a newline")
    return data


def _is_number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_wait(wait):
    """The wait in seconds as a float: 0..=255, fractions allowed."""
    if not _is_number(wait) or not math.isfinite(wait):
        raise ValueError("wait must be a number of seconds, got %r" % (wait,))
    if wait < 0:
        raise ValueError("wait must not be negative")
    if wait > WAIT_MAX:
        raise ValueError("wait is longer than 255 s")
    return float(wait)


def check_lease(lease):
    """The lease as an int: a whole number of seconds in 1..=255."""
    if not _is_number(lease) or not math.isfinite(lease):
        raise ValueError("lease must be a whole number of seconds, got %r" % (lease,))
    if isinstance(lease, float):
        if not lease.is_integer():
            raise ValueError("lease must be a whole number of seconds")
        lease = int(lease)
    if not 1 <= lease <= LEASE_MAX:
        raise ValueError("lease must be a whole number of seconds from 1 to 255")
    return lease


def check_token(token):
    if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token <= _U64_MAX:
        raise ValueError("token must be an unsigned 64-bit integer")
    return token


def wire_wait(wait_until, now):
    """The wait written on the wire at ``now`` (spec §8 rule 3): ``None``
    (an original zero wait) stays 0; otherwise the seconds left to ``Dw``,
    rounded up, or 0 once it has passed."""
    if wait_until is None:
        return 0
    left = wait_until - now
    if left <= 0:
        return 0
    return min(WAIT_MAX, math.ceil(left))


def encode_acquire(wait_s, lease_s, owner, key):
    return b"A" + _PACK_A(wait_s, lease_s, owner) + key + b"\n"


def encode_acquire_permits(wait_s, lease_s, owner, limit, take, key, label):
    """``S``: an acquire with a limit, a count or a label (spec §2.1)."""
    return b"S" + _PACK_S(wait_s, lease_s, owner, limit, take, len(key)) + key + label + b"\n"


def key_limit_of_mismatch(text):
    """The key's limit named by the text of an ``X 10``, or ``None``."""
    found = _LIMIT_MISMATCH_TEXT.match(text)
    return int(found.group(1)) if found else None


def encode_proclaim(token, key, label):
    """``C token klen key label`` (spec §13.4a)."""
    return b"C" + _PACK_Q64(token) + bytes((len(key),)) + key + label + b"\n"


def encode_release(token, key):
    return b"R" + _PACK_Q64(token) + key + b"\n"


def encode_extend(lease_s, token, key):
    return b"E" + _PACK_E(lease_s, token) + key + b"\n"


def encode_query(key):
    return b"Q" + key + b"\n"


def encode_ping(nonce):
    return b"P" + _PACK_Q64(nonce) + b"\n"


INFO_FRAME = b"I\n"


def encode_auth(secret):
    """``U secret``: the first request of a session (spec §12.2)."""
    return b"U" + secret + b"\n"


def encode_holders(ident, key):
    """``H id key``: the grants and waiters of one key (spec §11.2)."""
    return b"H" + _PACK_Q64(ident) + key + b"\n"


def encode_list(ident, cursor, count, prefix):
    """``L id cursor count prefix``: one page of keys (spec §11.3)."""
    return b"L" + _PACK_L(ident, cursor, count) + prefix + b"\n"


def encode_observe(wait_s, ident, since, key):
    """``O wait id since key``: the key's state when its current token is
    not ``since``, else when it changes or ``wait_s`` seconds end (spec
    §13.1)."""
    return b"O" + _PACK_O(wait_s, ident, since) + key + b"\n"


def decode_frames(buf):
    """Decodes every whole response frame at the start of ``buf`` (a
    bytearray) and removes them from it. Returns a list of tuples:
    ``("A", owner, token)``, ``("T", owner)``, ``("B", owner)``,
    ``("R"|"E"|"N", token)``, ``("Q", token, owner, lease_ms, waiters)``,
    ``("P", nonce)``, ``("I", text)``, ``("X", code, id, text)``,
    ``("G", id, token, owner, lease_ms, held_ms, take, label)``,
    ``("W", id, owner, wait_ms, take, label)``,
    ``("K", id, grants, waiters, limit, key)``, ``("Z", id, count, next)``,
    ``("U", name)``,
    ``("V", id, token, lease_ms, held_ms, grants, waiters, label)``
    (texts decoded as UTF-8, an invalid byte replaced).
    Raises :class:`ProtocolError` on bytes that cannot be a frame; the
    frames decoded before them are lost with the session anyway."""
    frames: List[Tuple[Any, ...]] = []
    pos = 0
    end = len(buf)
    while pos < end:
        op = buf[pos]
        header_len = _HEADER_LEN.get(op)
        if header_len is None:
            raise ProtocolError("unknown response op byte 0x%02x" % op)
        tail = pos + 1 + header_len
        if op in _TEXT_OPS:
            if end < tail:
                break
            newline = buf.find(b"\n", tail, min(end, tail + RESPONSE_TEXT_MAX + 1))
            if newline < 0:
                if end - tail > RESPONSE_TEXT_MAX:
                    raise ProtocolError("response text longer than %d bytes" % RESPONSE_TEXT_MAX)
                break
            text = bytes(buf[tail:newline]).decode("utf-8", "replace")
            if op == 0x49:
                frames.append(("I", text))
            elif op == 0x58:
                code, ident = _UNPACK_X(buf, pos + 1)
                frames.append(("X", code, ident, text))
            elif op == 0x47:
                frames.append(("G",) + _UNPACK_G(buf, pos + 1) + (text,))
            elif op == 0x57:
                frames.append(("W",) + _UNPACK_W(buf, pos + 1) + (text,))
            elif op == 0x55:
                frames.append(("U", text))
            elif op == 0x56:
                frames.append(("V",) + _UNPACK_V(buf, pos + 1) + (text,))
            else:
                frames.append(("K",) + _UNPACK_K(buf, pos + 1) + (text,))
            pos = newline + 1
            continue
        if tail >= end:
            break
        if buf[tail] != 0x0A:
            raise ProtocolError("response %r is not followed by a newline" % chr(op))
        if op == 0x41:
            owner, token = _UNPACK_A(buf, pos + 1)
            frames.append(("A", owner, token))
        elif op == 0x51:
            frames.append(("Q",) + _UNPACK_QUERY(buf, pos + 1))
        elif op == 0x5A:
            frames.append(("Z",) + _UNPACK_Z(buf, pos + 1))
        else:
            frames.append((chr(op), _UNPACK_Q64(buf, pos + 1)[0]))
        pos = tail + 1
    if pos:
        del buf[:pos]
    return frames


def parse_info(text):
    """The ``I`` line as a dict: ints where the value is a decimal number."""
    info = {}
    for pair in text.split():
        name, sep, value = pair.partition("=")
        if not sep:
            continue
        try:
            info[name] = int(value)
        except ValueError:
            info[name] = value
    return info


#: The kinds of address that name an etcd member: ``etcds`` speaks TLS.
ETCD_KINDS = ("etcd", "etcds")

#: The key layouts on etcd (``?layout=``): kunci's own (the default) and
#: etcd's ``client/v3/concurrency`` recipe (docs/ETCD.md).
ETCD_LAYOUTS = ("kunci", "etcd")


class EtcdMember(Tuple[str, int]):
    """``(host, port)`` of an etcd member, with the ``layout`` its address
    named (``?layout=etcd``; else ``"kunci"``)."""

    layout: str

    def __new__(cls, host: str, port: int, layout: str = "kunci") -> "EtcdMember":
        member = super().__new__(cls, (host, port))
        member.layout = layout
        return member


def _etcd_layout(query, text):
    """The layout an ``etcd://…?QUERY`` names: ``layout=kunci`` or
    ``layout=etcd``; any other parameter is refused."""
    layout = "kunci"
    for item in query.split("&"):
        name, sep, value = item.partition("=")
        if name != "layout" or not sep:
            raise ValueError("address %r: unknown option %r (etcd addresses take "
                             "?layout=kunci or ?layout=etcd)" % (text, item))
        if value not in ETCD_LAYOUTS:
            raise ValueError("address %r: layout must be kunci or etcd, not %r" % (text, value))
        layout = value
    return layout


def parse_address(text):
    """``("unix", path)``, ``("tcp", (host, port))`` or ``("tls", (host,
    port))`` for ``unix:PATH``, ``HOST:PORT`` or ``[V6]:PORT``, and
    ``tls://HOST:PORT`` (spec §12.4); ``("etcd", (host, port))`` for each
    member of ``etcd://HOST:PORT[,HOST:PORT…]`` (a list of them), and
    ``("etcds", (host, port))`` for each of ``etcds://…`` (TLS); an etcd
    member's ``(host, port)`` is an :class:`EtcdMember`, whose ``layout``
    ``?layout=etcd`` sets."""
    text = text.strip()
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path:
            raise ValueError("unix: address without a path")
        return ("unix", path)
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() == "tls":
        return ("tls", _host_port(rest, text))
    if sep:
        if scheme in ETCD_KINDS:
            rest, has_query, query = rest.partition("?")
            layout = _etcd_layout(query, text) if has_query else "kunci"
            members = rest.split(",")
            try:
                return [(scheme, EtcdMember(*_etcd_endpoint(member), layout))
                        for member in members]
            except ValueError as error:
                raise ValueError("address %r: %s" % (text, error))
        raise ValueError("address %r: the Python client takes HOST:PORT, tls://HOST:PORT, "
                         "unix:PATH or etcd[s]://HOST:PORT[,HOST:PORT...]" % text)
    return ("tcp", _host_port(text, text))


def _host_port(text, address):
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("address %r is not HOST:PORT, tls://HOST:PORT or unix:PATH" % address)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return (host, int(port))


def _etcd_endpoint(text: str) -> Tuple[str, int]:
    """``(host, port)`` of an etcd member ``HOST:PORT``, or ``ValueError``."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not text:
        raise ValueError("an etcd member is empty")
    if not sep or not port:
        raise ValueError("etcd member %r: no port" % text)
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("etcd member %r: bad port" % text)
    if not host:
        raise ValueError("etcd member %r: no host" % text)
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def format_address(address):
    kind, where = address
    if kind == "unix":
        return "unix:" + where
    host, port = where
    text = ("[%s]:%d" if ":" in host else "%s:%d") % (host, port)
    if kind == "tls":
        return "tls://" + text
    if kind in ETCD_KINDS:
        etcd_layout = getattr(where, "layout", "kunci") == "etcd"
        return kind + "://" + text + ("?layout=etcd" if etcd_layout else "")
    return text


def resolve_servers(servers):
    """The parsed addresses of ``servers`` (a comma-separated str, or an
    iterable of str); ``None`` means ``$KUNCI_SERVER``, else the default.
    ``etcd://A,B`` and ``etcd://A``, ``etcd://B`` say the same: the members
    of one etcd cluster, which cannot be mixed with kunci servers."""
    source = None
    if servers is None:
        servers = os.environ.get("KUNCI_SERVER") or DEFAULT_SERVER
        source = "KUNCI_SERVER" if os.environ.get("KUNCI_SERVER") else None
    if isinstance(servers, str):
        servers = [servers]
    try:
        addresses = []
        for text in servers:
            if text.strip().startswith(("etcd://", "etcds://")):
                # Everything after etcd:// is the member list.
                addresses.extend(parse_address(text))
                continue
            addresses.extend(parse_address(item) for item in text.split(",") if item.strip())
        if not addresses:
            raise ValueError("a client needs at least one server address")
        etcd = [address for address in addresses if address[0] in ETCD_KINDS]
        if etcd and len(etcd) != len(addresses):
            raise ValueError("etcd:// addresses cannot be mixed with kunci servers")
    except ValueError as error:
        if source is None:
            raise
        raise ValueError("%s: %s" % (source, error))
    return addresses


def retry_delay(failures):
    """After its first failure an address is retried at once; after ``n``
    consecutive failures, after 10 ms × 2^(n − 2), at most 500 ms (the Rust
    client's schedule)."""
    if failures <= 1:
        return 0.0
    return min(0.5, 0.010 * (1 << min(failures - 2, 16)))


def random_u64():
    return int.from_bytes(os.urandom(8), "big")
