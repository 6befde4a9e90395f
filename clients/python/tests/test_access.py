"""Spec §12 from the client's side, for both clients: the secret (``U``
first on every session, ``X 12`` and ``X 13`` are ``PermissionDenied``)
and TLS (a private CA, a server not trusted, client certificates)."""

import os
import ssl
import struct
import subprocess
import threading
import time

import pytest

import kunci
from conftest import free_port, kunci_bin, outcome, request_frames, require_tool

# A refused session or request ends at once: far below the 5 s deadline.
AT_ONCE = 1.5


# ---------------------------------------------------------------- secrets


def make_secret(name, *scopes):
    """``(secret, auth file line)`` from ``kunci secret``."""
    lines = subprocess.check_output([kunci_bin(), "secret", name] + list(scopes)).decode()
    secret, line = lines.splitlines()
    return secret, line


@pytest.fixture(scope="module")
def secrets(tmp_path_factory):
    """Two secrets and the ``--auth`` file that lets them in: ``admin``
    (every key, info) and ``team`` (locks under ``team/`` only)."""
    admin, admin_line = make_secret("admin", "lock:*", "read:*", "info")
    team, team_line = make_secret("team", "lock:team/")
    path = tmp_path_factory.mktemp("auth") / "auth"
    path.write_text("# test secrets\n%s\n%s\n" % (admin_line, team_line))
    return {"admin": admin, "team": team, "file": str(path)}


@pytest.fixture
def auth_server(start_server, secrets):
    return start_server("--auth", secrets["file"])


def test_u_goes_first_and_its_answer_is_taken(make_proxy, auth_server, secrets, make_client):
    proxy = make_proxy(auth_server.port)
    client = make_client(proxy.address, secret=secrets["admin"])
    ticket = client.acquire("deploy", lease=30)
    assert client.query("deploy").token == ticket.token
    ticket.release()
    data = proxy.upstream_bytes()
    secret = secrets["admin"].encode()
    assert data.startswith(b"U" + secret + b"\n")
    frames = request_frames(data[len(secret) + 2:])
    assert [op for op, _, _ in frames] == [b"A", b"Q", b"R"]
    # Every new session sends it again first.
    proxy.cut_all()
    time.sleep(0.1)
    assert client.query("deploy") is None
    assert proxy.upstream_bytes().count(b"U" + secret + b"\n") == 2
    assert client.info()["auth_failures"] == 0


def test_one_trailing_newline_of_a_secret_is_dropped(auth_server, secrets, make_client):
    client = make_client(auth_server.address, secret=(secrets["admin"] + "\n").encode())
    client.acquire("k").release()


@pytest.mark.parametrize("secret", ["wrong", "short", "absent"])
def test_refused_secret_is_permission_denied_at_once(auth_server, secrets, secret, make_client):
    if secret == "wrong":
        given = "0" * 64
    elif secret == "short":
        # What the client cannot check: the server's own minimum is the
        # client's, so a short secret is refused by the client first.
        with pytest.raises(kunci.InvalidArgument, match="shorter than 32 bytes"):
            make_client(auth_server.address, secret="x" * 31)
        return
    else:
        given = None
    client = make_client(auth_server.address, secret=given)
    kind, elapsed, error = outcome(client.acquire, "deploy", wait=10, lease=30)
    assert kind is kunci.PermissionDenied, error
    assert elapsed < AT_ONCE
    assert "X 12" in str(error)
    if secret == "absent":
        assert "has none" in str(error)
    else:
        assert "refused the secret" in str(error)
    assert isinstance(error, kunci.Error)
    # Another call tries once more (one connection), and ends the same way.
    kind, elapsed, error = outcome(client.release, "deploy", 1)
    assert kind is kunci.PermissionDenied and elapsed < AT_ONCE
    # Nothing was executed.
    admin = make_client(auth_server.address, secret=secrets["admin"])
    assert admin.query("deploy") is None
    info = admin.info()
    assert info["grants"] == 0 and info["released"] == 0 and info["not_held"] == 0
    assert info["auth_failures"] == 2


def test_refused_secret_is_not_tried_on_another_address(start_server, secrets, make_client):
    first = start_server("--auth", secrets["file"])
    second = start_server("--auth", secrets["file"])
    client = make_client([first.address, second.address], secret="1" * 64)
    kind, elapsed, error = outcome(client.acquire, "deploy", wait=5)
    assert kind is kunci.PermissionDenied and elapsed < AT_ONCE
    failures = []
    for server in (first, second):
        with kunci.Client(server.address, secret=secrets["admin"]) as admin:
            failures.append(admin.info()["auth_failures"])
    assert sorted(failures) == [0, 1]


def test_pipelined_requests_behind_a_refused_u_all_end_denied(auth_server, make_client):
    client = make_client(auth_server.address, secret="2" * 64)
    results = []

    def call(index):
        results.append(outcome(client.acquire, "k%d" % index, wait=3))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert len(results) == 8
    assert all(kind is kunci.PermissionDenied and elapsed < AT_ONCE
               for kind, elapsed, _ in results), results


def test_key_outside_the_scopes_is_denied_and_the_session_goes_on(
        auth_server, secrets, make_client):
    client = make_client(auth_server.address, secret=secrets["team"])
    kind, elapsed, error = outcome(client.acquire, "prod/db", wait=5)
    assert kind is kunci.PermissionDenied and elapsed < AT_ONCE
    assert "X 13" in str(error)
    with pytest.raises(kunci.PermissionDenied):
        client.info()
    ticket = client.acquire("team/build", lease=30)
    assert client.query("team/build").token == ticket.token
    ticket.release()
    admin = make_client(auth_server.address, secret=secrets["admin"])
    assert admin.query("prod/db") is None
    info = admin.info()
    assert info["connections"] == 2  # the team session was not closed
    assert info["auth_failures"] == 0


def test_renewal_answered_x13_is_a_loss(make_proxy, make_client):
    # As after a restart whose --auth file took the key out of the scopes.
    proxy = make_proxy(free_port())
    proxy.accept = "respond"

    def respond(data):
        answer = b""
        for op, header, _ in request_frames(data):
            if op == b"U":
                answer += b"Uteam\n"
            elif op == b"A":
                answer += b"A" + header[2:10] + struct.pack(">Q", 7) + b"\n"
            elif op == b"E":
                answer += b"X" + struct.pack(">BQ", 13, 7) + b"not permitted\n"
        return answer

    proxy.responder = respond
    lost = threading.Event()
    client = make_client(proxy.address, secret="s" * 32)
    start = time.monotonic()
    with client.lock("k", lease=1, on_lost=lambda ticket: lost.set()) as ticket:
        assert lost.wait(3)
        assert time.monotonic() - start >= 1 / 3.0  # the first renewal's time
        assert ticket.lost
        with pytest.raises(kunci.LockLost):
            ticket.check()
    assert [op for op, _, _ in request_frames(proxy.upstream_bytes())] == [b"U", b"A", b"E"]


def test_secret_on_a_server_without_auth(server, secrets, make_client):
    # A server without --auth answers U with an empty name.
    client = make_client(server.address, secret=secrets["admin"])
    client.acquire("k").release()


def test_secret_and_tls_arguments_are_checked_at_construction(make_client):
    for bad in (b"a" * 20, 42, "a" * 300, "a" * 40 + "\nb"):
        with pytest.raises(kunci.InvalidArgument):
            make_client("127.0.0.1:1", secret=bad)
    with pytest.raises(kunci.InvalidArgument, match="tls must be"):
        make_client("127.0.0.1:1", tls="yes")
    with pytest.raises(kunci.InvalidArgument, match="for kunci servers"):
        make_client("etcd://127.0.0.1:2379", secret="a" * 32)


# -------------------------------------------------------------------- TLS


def _openssl(*args, cwd):
    subprocess.run(["openssl"] + list(args), cwd=cwd, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _make_ca(directory, name):
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", name + ".key", "-out", name + ".pem", "-days", "2",
             "-subj", "/CN=" + name, "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=directory)


def _make_leaf(directory, name, ca, extensions):
    ext = os.path.join(directory, name + ".ext")
    with open(ext, "w") as file:
        file.write(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", name + ".key", "-out", name + ".csr", "-subj", "/CN=" + name,
             cwd=directory)
    _openssl("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
             "-CAcreateserial", "-out", name + ".pem", "-days", "2", "-extfile", ext,
             cwd=directory)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A private CA with a server certificate for 127.0.0.1/localhost and a
    client certificate, and an unrelated CA. Paths by name."""
    require_tool("openssl", "openssl")
    directory = str(tmp_path_factory.mktemp("pki"))
    _make_ca(directory, "ca")
    _make_ca(directory, "other-ca")
    _make_leaf(directory, "server", "ca",
               "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
               "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    _make_leaf(directory, "elsewhere", "ca",
               "subjectAltName=DNS:elsewhere.example\nbasicConstraints=CA:FALSE\n"
               "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n")
    _make_leaf(directory, "client", "ca",
               "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
               "extendedKeyUsage=clientAuth\n")
    _make_leaf(directory, "stranger", "other-ca",
               "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
               "extendedKeyUsage=clientAuth\n")
    return lambda name: os.path.join(directory, name)


def tls_server(start_server, pki, *extra, cert="server"):
    server = start_server("--tls-cert", pki(cert + ".pem"), "--tls-key", pki(cert + ".key"),
                          *extra, listen=("tls://127.0.0.1:0",))
    assert server.address.startswith("tls://127.0.0.1:")
    return server


def context(pki, ca="ca.pem", cert=None):
    ctx = ssl.create_default_context(cafile=pki(ca))
    if cert is not None:
        ctx.load_cert_chain(pki(cert + ".pem"), pki(cert + ".key"))
    return ctx


def test_tls_round_trip_with_a_private_ca(start_server, pki, make_client):
    server = tls_server(start_server, pki)
    client = make_client(server.address, tls=context(pki))
    ticket = client.acquire("deploy", lease=30)
    assert client.query("deploy").token == ticket.token
    ticket.release()
    assert client.query("deploy") is None
    # A plain HOST:PORT address speaks TLS when given a context.
    plain = make_client("127.0.0.1:%d" % server.port, tls=context(pki))
    assert plain.ping() < 1
    # The server's name is checked as a DNS name too.
    by_name = make_client("tls://localhost:%d" % server.port, tls=context(pki))
    assert by_name.query("deploy") is None


@pytest.mark.parametrize("case", ["other CA", "system trust", "wrong name"])
def test_untrusted_server_is_unavailable_naming_the_certificate(
        start_server, pki, case, make_client):
    if case != "wrong name":
        server = tls_server(start_server, pki)
    if case == "other CA":
        client = make_client(server.address, tls=context(pki, ca="other-ca.pem"))
    elif case == "system trust":
        client = make_client(server.address)  # tls:// with the system's trust
    else:
        # Signed by the trusted CA, for another name than 127.0.0.1.
        server = tls_server(start_server, pki, cert="elsewhere")
        client = make_client(server.address, tls=context(pki))
    kind, elapsed, error = outcome(client.acquire, "deploy", wait=3)
    assert kind is kunci.Unavailable, error
    assert "certificate" in str(error) and "not trusted" in str(error)
    # The certificate cannot change within the call: it ends at once.
    assert elapsed < AT_ONCE


def test_mtls_without_a_client_certificate_is_permission_denied(start_server, pki, make_client):
    server = tls_server(start_server, pki, "--tls-client-ca", pki("ca.pem"))
    client = make_client(server.address, tls=context(pki))
    kind, elapsed, error = outcome(client.acquire, "deploy", wait=3)
    assert kind is kunci.PermissionDenied, error
    assert "certificate" in str(error)
    assert elapsed < AT_ONCE
    # With TLS 1.2 the refusal comes during the handshake, not after it.
    old = context(pki)
    old.maximum_version = ssl.TLSVersion.TLSv1_2
    kind, elapsed, error = outcome(make_client(server.address, tls=old).acquire, "deploy", wait=3)
    assert kind is kunci.PermissionDenied, error
    assert "certificate" in str(error) and elapsed < AT_ONCE
    stranger = make_client(server.address, tls=context(pki, cert="stranger"))
    kind, elapsed, error = outcome(stranger.acquire, "deploy", wait=3)
    assert kind is kunci.PermissionDenied, error
    assert elapsed < AT_ONCE
    good = make_client(server.address, tls=context(pki, cert="client"))
    assert good.query("deploy") is None
    assert good.info()["grants"] == 0


def test_mtls_with_a_good_client_certificate(start_server, pki, make_client):
    server = tls_server(start_server, pki, "--tls-client-ca", pki("ca.pem"))
    client = make_client(server.address, tls=context(pki, cert="client"))
    ticket = client.acquire("deploy", lease=30)
    ticket.release()
    assert client.info()["released"] == 1


def test_secret_over_tls(start_server, pki, secrets, make_client):
    server = tls_server(start_server, pki, "--auth", secrets["file"])
    client = make_client(server.address, tls=context(pki), secret=secrets["team"])
    client.acquire("team/x").release()
    with pytest.raises(kunci.PermissionDenied, match="X 13"):
        client.acquire("other")
    wrong = make_client(server.address, tls=context(pki), secret="3" * 64)
    kind, elapsed, _ = outcome(wrong.query, "team/x")
    assert kind is kunci.PermissionDenied and elapsed < AT_ONCE
