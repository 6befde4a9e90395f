"""The API as a Python user meets it (issue 26, smaller items): every
failure is a kunci.Error, Timeout is also a TimeoutError, input is refused
at once, reprs say what a reader needs, units are named alike."""

import math
import os
import subprocess
import sys
import textwrap
import time

import pytest

import kunci
import kunci.aio
from conftest import PACKAGE_ROOT


@pytest.mark.parametrize("bad", ["x", None, -1, 0, math.nan, math.inf, True, [1]])
@pytest.mark.parametrize("client_class", [kunci.Client, kunci.aio.Client])
def test_a_bad_connect_timeout_is_invalid_argument(client_class, bad):
    with pytest.raises(kunci.InvalidArgument):
        client_class("127.0.0.1:1", connect_timeout=bad)


def test_on_lost_that_is_not_callable_is_refused_at_once(make_client):
    # No server at that address: the refusal comes before any connect.
    client = make_client("127.0.0.1:1")
    started = time.monotonic()
    with pytest.raises(kunci.InvalidArgument, match="on_lost must be callable"):
        client.lock("k", wait=1, on_lost="not a function")
    assert time.monotonic() - started < 1.0  # generous; nothing is waited for


def test_timeout_is_a_timeout_error(server, make_client):
    client = make_client(server.address)
    ticket = client.acquire("k")
    with pytest.raises(TimeoutError):
        client.acquire("k", wait=0)
    error = pytest.raises(kunci.Timeout, client.acquire, "k", wait=0).value
    assert isinstance(error, kunci.Error) and str(error).startswith("timeout:")
    ticket.release()


def test_reprs_show_addresses_and_time_left(server, make_client):
    client = make_client(server.address)
    inner = getattr(client, "client", client)
    assert repr(inner) == "<%s %s>" % (
        "kunci.Client" if isinstance(inner, kunci.Client) else "kunci.aio.Client",
        server.address)
    ticket = client.acquire("k", lease=30)
    text = repr(getattr(ticket, "ticket", ticket))
    assert text.startswith("Ticket(key='k', token=%d, lease=30, valid_for=29." % ticket.token)
    assert "valid_until" not in text
    status = client.query("k")
    assert 29.0 < status.lease_left <= 30.0 and status.lease_left == status.lease_ms / 1000.0
    ticket.release()
    client.close()
    assert repr(inner).endswith(" closed>")


OUT_OF_DESCRIPTORS = """
    import os, resource, sys
    import kunci

    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    held = []
    while True:
        try:
            held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            break
    os.close(held.pop())   # one left: a socket, but no pipe beside it
    client = kunci.Client(sys.argv[1], connect_timeout=0.2)
    try:
        client.ping()
    except kunci.Error as error:
        print(type(error).__name__)
    except OSError as error:
        print("raw", type(error).__name__, error)
"""


def test_running_out_of_descriptors_is_a_kunci_error(server):
    env = dict(os.environ, PYTHONPATH=PACKAGE_ROOT)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(OUT_OF_DESCRIPTORS),
                           server.address], capture_output=True, text=True, timeout=30, env=env)
    assert proc.stdout.strip() == "Unavailable", proc.stdout + proc.stderr
