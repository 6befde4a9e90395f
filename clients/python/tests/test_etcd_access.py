"""``etcds://`` (TLS to the etcd members: a private CA, client
certificates) and etcd's own authentication (``etcd_credentials``), on
single-member etcd clusters, with the outcomes the Rust client gives:
a member whose certificate fails verification, or that refuses this
client's certificate, takes no request, and the call ends ``Unavailable``
at its deadline; a refused user or role is ``PermissionDenied`` at once."""

import json
import os
import ssl
import subprocess
import time
import urllib.request

import pytest

import kunci
import kunci._protocol
from conftest import free_port, kunci_bin, outcome, require_tool
from test_access import _make_ca, _make_leaf

# A refusal by etcd's authentication ends the call well before its deadline.
AT_ONCE = 1.5  # generous on a loaded machine; going on until the wait or D takes >= 2 s


@pytest.fixture
def short_deadline(monkeypatch):
    """Calls end by start + 1 s instead of 5 s (spec §8's D), so that the
    calls that end ``Unavailable`` at their deadline take little time."""
    monkeypatch.setattr(kunci._protocol, "TRANSPORT_DEADLINE", 1.0)
    return 1.0


@pytest.fixture(scope="module")
def etcd_pki(tmp_path_factory):
    """A private CA, etcd's certificate for 127.0.0.1/localhost (for client
    authentication too: etcd's gateway reaches etcd with it when etcd
    requires client certificates), a client certificate, and an unrelated
    CA. Paths by name."""
    require_tool("openssl", "openssl")
    directory = str(tmp_path_factory.mktemp("etcd-pki"))
    _make_ca(directory, "ca")
    _make_ca(directory, "other-ca")
    _make_leaf(directory, "etcd", "ca",
               "subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
               "keyUsage=critical,digitalSignature\n"
               "extendedKeyUsage=serverAuth,clientAuth\n")
    _make_leaf(directory, "client", "ca",
               "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
               "extendedKeyUsage=clientAuth\n")
    return lambda name: os.path.join(directory, name)


def context(pki, ca="ca.pem", cert=None):
    ctx = ssl.create_default_context(cafile=pki(ca))
    if cert is not None:
        ctx.load_cert_chain(pki(cert + ".pem"), pki(cert + ".key"))
    return ctx


class Etcd(object):
    """One etcd member on loopback; ``https`` serves its clients over TLS
    with the test CA's certificate. Ready once ``ready(client)`` works."""

    def __init__(self, directory, pki=None, extra=()):
        etcd = require_tool("etcd", "etcd-server")
        self.port, peer = free_port(), free_port()
        scheme = "https" if pki is not None else "http"
        command = [etcd, "--name", "m0", "--data-dir", os.path.join(directory, "data"),
                   "--listen-client-urls", "%s://127.0.0.1:%d" % (scheme, self.port),
                   "--advertise-client-urls", "%s://127.0.0.1:%d" % (scheme, self.port),
                   "--listen-peer-urls", "http://127.0.0.1:%d" % peer,
                   "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer,
                   "--initial-cluster", "m0=http://127.0.0.1:%d" % peer,
                   "--heartbeat-interval", "50", "--election-timeout", "500"]
        if pki is not None:
            command += ["--cert-file", pki("etcd.pem"), "--key-file", pki("etcd.key")]
        log = open(os.path.join(directory, "etcd.log"), "wb")
        self.process = subprocess.Popen(list(command) + list(extra), stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=log)
        log.close()

    def wait_ready(self, client, timeout=30):
        deadline = time.monotonic() + timeout
        while True:
            try:
                client.acquire("warm-up", lease=1).release()
                return
            except kunci.Error as error:
                if time.monotonic() > deadline:
                    pytest.fail("etcd did not start: %s" % error)
                time.sleep(0.1)

    def stop(self):
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


@pytest.fixture(scope="module")
def etcds(etcd_pki, tmp_path_factory):
    """etcd serving clients over TLS only."""
    etcd = Etcd(str(tmp_path_factory.mktemp("etcds")), etcd_pki)
    with kunci.Client("etcds://127.0.0.1:%d" % etcd.port, tls=context(etcd_pki)) as client:
        etcd.wait_ready(client)
    yield etcd
    etcd.stop()


@pytest.fixture(scope="module")
def etcds_mtls(etcd_pki, tmp_path_factory):
    """etcd over TLS that requires a client certificate from the test CA."""
    etcd = Etcd(str(tmp_path_factory.mktemp("etcds-mtls")), etcd_pki,
                ["--trusted-ca-file", etcd_pki("ca.pem"), "--client-cert-auth"])
    with kunci.Client("etcds://127.0.0.1:%d" % etcd.port,
                      tls=context(etcd_pki, cert="client")) as client:
        etcd.wait_ready(client)
    yield etcd
    etcd.stop()


def test_etcds_round_trip_with_a_private_ca(etcds, etcd_pki, make_client):
    client = make_client("etcds://127.0.0.1:%d" % etcds.port, tls=context(etcd_pki))
    key = "tls-" + client.flavour
    ticket = client.acquire(key, lease=30)
    assert client.query(key).token == ticket.token
    assert outcome(client.acquire, key)[0] is kunci.Timeout
    ticket.release()
    assert client.query(key) is None
    # The host in the address is checked as a DNS name too.
    by_name = make_client("etcds://localhost:%d" % etcds.port, tls=context(etcd_pki))
    assert by_name.query(key) is None
    assert by_name.ping() < 1


@pytest.mark.parametrize("case", ["other CA", "system trust"])
def test_etcds_member_that_fails_verification_takes_nothing(
        etcds, etcd_pki, make_client, short_deadline, case):
    # As the Rust client: no byte of the request went to a member whose
    # certificate failed verification, so the call tries the members until
    # its deadline and ends Unavailable (`kunci` exits 4).
    tls = context(etcd_pki, ca="other-ca.pem") if case == "other CA" else None
    client = make_client("etcds://127.0.0.1:%d" % etcds.port, tls=tls)
    kind, elapsed, error = outcome(client.acquire, "tls-untrusted")
    assert kind is kunci.Unavailable, error
    assert "no etcd member could be reached" in str(error)
    assert short_deadline <= elapsed < short_deadline + 2
    kind, elapsed, error = outcome(client.query, "tls-untrusted")
    assert kind is kunci.Unavailable and short_deadline <= elapsed < short_deadline + 2
    trusted = make_client("etcds://127.0.0.1:%d" % etcds.port, tls=context(etcd_pki))
    assert trusted.query("tls-untrusted") is None, "nothing was left behind"


def test_etcds_with_client_certificates(etcds_mtls, etcd_pki, make_client, short_deadline):
    address = "etcds://127.0.0.1:%d" % etcds_mtls.port
    good = make_client(address, tls=context(etcd_pki, cert="client"))
    key = "mtls-" + good.flavour
    ticket = good.acquire(key, lease=30)
    assert good.query(key).token == ticket.token
    # Without a certificate etcd refuses the session after the handshake:
    # a lease grant is asked for again until the deadline (a lost one
    # holds nothing), then Unavailable, as `kunci acquire` exits 4.
    without = make_client(address, tls=context(etcd_pki))
    kind, elapsed, error = outcome(without.acquire, key, wait=0.2)
    assert kind is kunci.Unavailable, error
    assert short_deadline + 0.2 <= elapsed < short_deadline + 2.2
    assert good.query(key).token == ticket.token and good.query(key).waiters == 0
    # A release may have been sent: Indeterminate, as `kunci release`
    # exits 5; the lock stays held.
    kind, elapsed, error = outcome(without.release, key, ticket.token)
    assert kind is kunci.Indeterminate, error
    assert short_deadline <= elapsed < short_deadline + 2
    assert good.query(key).token == ticket.token
    ticket.release()


def test_rust_and_python_see_each_others_lock_over_etcds(etcds, etcd_pki, make_client):
    address = "etcds://127.0.0.1:%d" % etcds.port
    client = make_client(address, tls=context(etcd_pki))
    key = "tls-shared-" + client.flavour

    def rust(*args):
        return subprocess.run([kunci_bin(), *args, "--server", address,
                               "--tls-ca", etcd_pki("ca.pem")],
                              capture_output=True, text=True, timeout=30)

    acquired = rust("acquire", key, "--lease", "30")
    assert acquired.returncode == 0, acquired.stderr
    token = int(acquired.stdout.strip())
    assert client.query(key).token == token
    assert outcome(client.acquire, key)[0] is kunci.Timeout
    released = rust("release", key, str(token))
    assert released.returncode == 0, released.stderr
    ticket = client.acquire(key, lease=30)
    assert ticket.token > token
    refused = rust("acquire", key)
    assert refused.returncode != 0 and "held" in refused.stdout + refused.stderr, refused
    ticket.release()


def test_etcd_address_arguments_for_tls_and_credentials(make_client):
    with pytest.raises(kunci.InvalidArgument, match="etcd:// is plain HTTP.*etcds://"):
        make_client("etcd://127.0.0.1:2379", tls=True)
    with pytest.raises(kunci.InvalidArgument, match="a secret is for kunci servers"):
        make_client("etcds://127.0.0.1:2379", secret="a" * 32)
    with pytest.raises(kunci.InvalidArgument, match="tls must be"):
        make_client("etcds://127.0.0.1:2379", tls="yes")
    with pytest.raises(kunci.InvalidArgument, match="etcd_credentials are for etcd"):
        make_client("127.0.0.1:5862", etcd_credentials=("root", "pw"))
    for bad in ("root", ("root",), ("root", b"pw"), ("", "pw")):
        with pytest.raises(kunci.InvalidArgument, match="etcd_credentials"):
            make_client("etcd://127.0.0.1:2379", etcd_credentials=bad)


def test_etcd_user_without_password_in_the_environment(make_client, monkeypatch):
    monkeypatch.setenv("KUNCI_ETCD_USER", "root")
    monkeypatch.delenv("KUNCI_ETCD_PASSWORD", raising=False)
    with pytest.raises(kunci.InvalidArgument,
                       match="KUNCI_ETCD_USER is set but KUNCI_ETCD_PASSWORD is not"):
        make_client("etcd://127.0.0.1:2379")
    # Kunci servers do not read it.
    make_client("127.0.0.1:5862")


# ------------------------------------------------------- authentication


def _gateway(port, path, body):
    request = urllib.request.Request("http://127.0.0.1:%d%s" % (port, path),
                                     data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=5) as answer:
        return json.loads(answer.read())


@pytest.fixture(scope="module")
def etcd_auth(tmp_path_factory):
    """etcd with authentication on: ``root`` (role root) and ``nobody`` (no
    role); tokens that expire after 1 s unused. Set up as tests/etcd.rs
    does, through the JSON gateway."""
    etcd = Etcd(str(tmp_path_factory.mktemp("etcd-auth")), extra=["--auth-token-ttl", "1"])
    with kunci.Client("etcd://127.0.0.1:%d" % etcd.port) as client:
        etcd.wait_ready(client)
    for path, body in [
            ("/v3/auth/user/add", {"name": "root", "password": "root-password"}),
            ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
            ("/v3/auth/user/add", {"name": "nobody", "password": "nobody-password"}),
            ("/v3/auth/enable", {})]:
        _gateway(etcd.port, path, body)
    yield etcd
    etcd.stop()


@pytest.mark.parametrize("credentials, reason", [
    (None, "did not take this client's user"),
    (("root", "wrong"), "did not take this client's user"),
    (("nobody", "nobody-password"), "roles do not allow"),
])
def test_etcd_refuses_users_and_roles_at_once(etcd_auth, make_client, credentials, reason):
    client = make_client("etcd://127.0.0.1:%d" % etcd_auth.port, etcd_credentials=credentials)
    kind, elapsed, error = outcome(client.acquire, "job", wait=2)
    assert kind is kunci.PermissionDenied, error
    assert reason in str(error) and "nothing was executed" in str(error)
    assert elapsed < AT_ONCE
    kind, elapsed, error = outcome(client.query, "job")
    assert kind is kunci.PermissionDenied and elapsed < AT_ONCE, error


def test_etcd_user_takes_locks_and_gets_new_tokens(etcd_auth, make_client):
    client = make_client("etcd://127.0.0.1:%d" % etcd_auth.port,
                         etcd_credentials=("root", "root-password"))
    key = "job-" + client.flavour
    ticket = client.acquire(key, lease=30)
    # The token expires unused; the next calls get a new one.
    time.sleep(2.5)
    assert client.query(key).token == ticket.token
    ticket.renew(lease=30)
    ticket.release()
    assert client.query(key) is None


def test_etcd_user_from_the_environment(etcd_auth, make_client, monkeypatch):
    monkeypatch.setenv("KUNCI_ETCD_USER", "root")
    monkeypatch.setenv("KUNCI_ETCD_PASSWORD", "root-password")
    client = make_client("etcd://127.0.0.1:%d" % etcd_auth.port)
    client.acquire("job-env-" + client.flavour).release()
    # Given ones come first.
    wrong = make_client("etcd://127.0.0.1:%d" % etcd_auth.port,
                        etcd_credentials=("root", "wrong"))
    assert outcome(wrong.query, "job")[0] is kunci.PermissionDenied
