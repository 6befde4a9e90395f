"""Fixtures: real `kunci serve` processes, a fault-injecting TCP proxy, and
one client API that drives either the sync or the asyncio client, so that
every contract test runs against both.

The server binary is `$KUNCI_BIN`, else `target/release/kunci` at the root
of the repository (build it with `cargo build --release`).
"""

import asyncio
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE_ROOT = os.path.dirname(HERE)
REPO_ROOT = os.path.dirname(os.path.dirname(PACKAGE_ROOT))
sys.path.insert(0, PACKAGE_ROOT)

import kunci  # noqa: E402
import kunci.aio  # noqa: E402

LISTENING = re.compile(r"listening on (\S+(?: \S+)*?); limits")


def kunci_bin():
    path = os.environ.get("KUNCI_BIN") or os.path.join(REPO_ROOT, "target", "release", "kunci")
    if not os.access(path, os.X_OK):
        pytest.fail("no kunci binary at %s: run `cargo build --release` or set KUNCI_BIN" % path)
    return path


class Server(object):
    """One `kunci serve` on a free port (or the given listen addresses).
    Its restart state goes to the ``--state-dir`` the test gives, else to a
    fresh temporary directory of its own (never under the user's home): a
    server started again without one starts with nothing restored."""

    def __init__(self, *args, listen=("127.0.0.1:0",)):
        command = [kunci_bin(), "serve"]
        for address in listen:
            command += ["--listen", address]
        command += list(args)
        self._state_dir = None
        if "--state-dir" not in args:
            self._state_dir = tempfile.mkdtemp(prefix="kunci-state-")
            command += ["--state-dir", self._state_dir]
        env = dict(os.environ, RUST_LOG="info")
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, env=env)
        self.log = []
        deadline = time.monotonic() + 10
        addresses = None
        while addresses is None:
            line = self.proc.stderr.readline().decode("utf-8", "replace")
            if not line:
                raise RuntimeError("kunci serve exited: %s" % "".join(self.log))
            self.log.append(line)
            found = LISTENING.search(line)
            if found:
                addresses = found.group(1).split(" ")
            if time.monotonic() > deadline:
                raise RuntimeError("kunci serve did not start")
        threading.Thread(target=self._drain, daemon=True).start()
        self.addresses = addresses
        self.address = addresses[0]
        if not self.address.startswith("unix:"):
            self.port = int(self.address.rsplit(":", 1)[1])

    def _drain(self):
        for line in self.proc.stderr:
            self.log.append(line.decode("utf-8", "replace"))

    def info(self):
        with kunci.Client(self.address) as client:
            return client.info()

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._state_dir is not None:
            shutil.rmtree(self._state_dir, ignore_errors=True)


@pytest.fixture
def start_server():
    servers = []

    def start(*args, **kwargs):
        server = Server(*args, **kwargs)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def server(start_server):
    return start_server()


def free_port():
    """A port nothing listens on (bound, then closed)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def _recv_or_eof(sock):
    """What ``sock`` received; a failed read counts as its end (b"")."""
    try:
        return sock.recv(65536)
    except OSError:
        return b""


class Proxy(object):
    """A TCP proxy in front of `upstream` that injects faults. Settings are
    read at each step, so a test may change them while connections run.

    - ``accept``: "forward"; "close" (close at once, as `--allow` did);
      "x7"/"x9" (send that `X` as the first frame, then close), after
      ``accept_delay`` seconds; "respond" (``responder(request_bytes)``
      returns the answer bytes, or ``Proxy.CLOSE`` to close that
      connection; nothing is forwarded).
    - ``up``/``down``: "pass" or "drop" (a blackhole for that direction).
    - ``dropped_down``: bytes "drop" threw away in that direction.
    - ``down_delay``: seconds each server→client chunk is held back.
    - ``cut_up_after``: after forwarding that many client bytes upstream,
      close both sides.
    """

    #: What a responder returns to close the connection instead.
    CLOSE = object()

    def __init__(self, upstream_port):
        self.upstream = ("127.0.0.1", upstream_port)
        self.accept = "forward"
        self.accept_delay = 0.0
        self.responder = None
        self.up = "pass"
        self.down = "pass"
        self.down_delay = 0.0
        self.cut_up_after = None
        #: Server→client bytes "drop" has thrown away, so a test can wait
        #: until an answer it means to lose is really lost.
        self.dropped_down = 0
        self.accepted = 0
        self.closed_by_client = 0
        self.received = []  # (monotonic time, bytes) from clients
        self.lock = threading.Lock()
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.address = "127.0.0.1:%d" % self.port
        self.running = True
        self.sockets = []
        threading.Thread(target=self._accept_loop, daemon=True).start()

    def upstream_bytes(self):
        with self.lock:
            return b"".join(data for _, data in self.received)

    def _accept_loop(self):
        while self.running:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            with self.lock:
                self.accepted += 1
                self.sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client):
        if self.accept_delay:
            time.sleep(self.accept_delay)
        mode = self.accept
        if mode == "close":
            client.close()
            return
        if mode in ("x7", "x9"):
            code = 7 if mode == "x7" else 9
            text = b"connection limit reached" if code == 7 else b"peer not allowed"
            try:
                client.sendall(b"X" + struct.pack(">BQ", code, 0) + text + b"\n")
                client.shutdown(socket.SHUT_WR)
                # Record what the client wrote (the server itself reads
                # nothing from such a connection).
                client.settimeout(0.2)
                while True:
                    data = client.recv(65536)
                    if not data:
                        break
                    self._record(data)
            except OSError:
                pass
            client.close()
            return
        if mode == "respond":
            self._respond(client)
            return
        try:
            server = socket.create_connection(self.upstream)
        except OSError:
            client.close()
            return
        with self.lock:
            self.sockets.append(server)
        state = {"up": 0, "closed": False}
        threading.Thread(target=self._pump_up, args=(client, server, state), daemon=True).start()
        self._pump_down(server, client, state)

    def _record(self, data):
        """Keeps what the client wrote, with when it arrived."""
        with self.lock:
            self.received.append((time.monotonic(), data))

    def _respond(self, client):
        while True:
            try:
                data = client.recv(65536)
            except OSError:
                return
            if not data:
                with self.lock:
                    self.closed_by_client += 1
                return
            self._record(data)
            answer = self.responder(data)
            if answer is Proxy.CLOSE:
                try:
                    client.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                client.close()
                return
            if answer:
                try:
                    client.sendall(answer)
                except OSError:
                    return

    def _close_both(self, a, b, state):
        state["closed"] = True
        for sock in (a, b):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _forward(self, data, to, client, server, state):
        """Sends ``data`` on; whether the pump goes on (a failed send ends
        both sides)."""
        try:
            to.sendall(data)
        except OSError:
            self._close_both(client, server, state)
            return False
        return True

    def _pump_up(self, client, server, state):
        while True:
            data = _recv_or_eof(client)
            if not data:
                if not state["closed"]:
                    with self.lock:
                        self.closed_by_client += 1
                self._close_both(client, server, state)
                return
            self._record(data)
            if self.up == "drop":
                continue
            cut = self.cut_up_after
            if cut is not None and state["up"] + len(data) >= cut:
                data = data[: cut - state["up"]]
                try:
                    server.sendall(data)
                except OSError:
                    pass
                state["up"] += len(data)
                time.sleep(0.1)  # let the server act on it first
                self._close_both(client, server, state)
                return
            state["up"] += len(data)
            if not self._forward(data, server, client, server, state):
                return

    def _pump_down(self, server, client, state):
        while True:
            data = _recv_or_eof(server)
            if not data:
                self._close_both(client, server, state)
                return
            if self.down_delay:
                time.sleep(self.down_delay)
            if self.down == "drop":
                with self.lock:
                    self.dropped_down += len(data)
                continue
            if not self._forward(data, client, client, server, state):
                return

    def cut_all(self):
        """Ends every connection that is open now, as a server restart
        would."""
        with self.lock:
            for sock in self.sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self):
        self.running = False
        try:
            self.listener.close()
        except OSError:
            pass
        with self.lock:
            for sock in self.sockets:
                try:
                    sock.close()
                except OSError:
                    pass


@pytest.fixture
def make_proxy():
    proxies = []

    def make(upstream_port):
        proxy = Proxy(upstream_port)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.stop()


# --------------------------------------------------------------------------
# One API over both clients.


class AioRunner(object):
    """An event loop on its own thread, to drive the asyncio client from
    plain test code."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout=60):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


class AioTicket(object):
    def __init__(self, runner, ticket):
        self._runner = runner
        self.ticket = ticket

    def __getattr__(self, name):
        return getattr(self.ticket, name)

    def renew(self, lease=None):
        return self._runner.run(self.ticket.renew(lease))

    def release(self):
        return self._runner.run(self.ticket.release())


class AioLock(object):
    def __init__(self, runner, context):
        self._runner = runner
        self._context = context

    def __enter__(self):
        return AioTicket(self._runner, self._runner.run(self._context.__aenter__()))

    def __exit__(self, *exc):
        return self._runner.run(self._context.__aexit__(*exc))


class AioClient(object):
    """The sync client's API, run on the asyncio client."""

    flavour = "aio"

    def __init__(self, runner, *args, **kwargs):
        self._runner = runner
        self.client = kunci.aio.Client(*args, **kwargs)

    def acquire(self, *args, **kwargs):
        return AioTicket(self._runner, self._runner.run(self.client.acquire(*args, **kwargs)))

    def lock(self, *args, **kwargs):
        return AioLock(self._runner, self.client.lock(*args, **kwargs))

    def __getattr__(self, name):
        method = getattr(self.client, name)

        def call(*args, **kwargs):
            return self._runner.run(method(*args, **kwargs))

        return call

    def close(self):
        self._runner.run(self.client.close())


@pytest.fixture(params=["sync", "aio"])
def flavour(request):
    return request.param


@pytest.fixture
def make_client(flavour):
    """``make_client(servers, **kwargs)``: a client of the test's flavour."""
    made = []
    runner = AioRunner() if flavour == "aio" else None

    def make(*args, **kwargs):
        if runner is None:
            client = kunci.Client(*args, **kwargs)
            client.flavour = "sync"
        else:
            client = AioClient(runner, *args, **kwargs)
        made.append(client)
        return client

    yield make
    for client in made:
        try:
            client.close()
        except Exception:
            pass
    if runner is not None:
        runner.close()


# Fixed header length of each request op (spec §2.1), after the op byte.
REQUEST_HEADER = {b"A": 10, b"R": 8, b"E": 9, b"Q": 0, b"P": 8, b"I": 0, b"S": 15,
                  b"H": 8, b"L": 18, b"U": 0, b"C": 9}


def request_frames(data):
    """The request frames in ``data`` (bytes a client wrote), as
    ``(op, header, key)`` tuples: the header is read by its length first,
    as a server does, because it may contain any byte. (For ``S`` the
    "key" is the key and the label: the key's length is ``header[14]``.)"""
    frames = []
    pos = 0
    while pos < len(data):
        op = data[pos:pos + 1]
        start = pos + 1 + REQUEST_HEADER[op]
        end = data.index(b"\n", start)
        frames.append((op, data[pos + 1:start], data[start:end]))
        pos = end + 1
    return frames


def wait_for(predicate, timeout, interval=0.01):
    """Polls ``predicate`` until it is true; fails the test after
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail("condition not met within %.1f s" % timeout)
        time.sleep(interval)


def in_thread(function, *args, **kwargs):
    """Starts ``function`` in a daemon thread; returns a dict that gets its
    outcome (``result`` or ``error``), the instant it ended (``at``) and how
    long it took (``took``)."""
    box = {}

    def run():
        started = time.monotonic()
        try:
            box["result"] = function(*args, **kwargs)
        except BaseException as error:  # noqa: B902
            box["error"] = error
        box["at"] = time.monotonic()
        box["took"] = box["at"] - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    box["thread"] = thread
    return box


def joined(box, timeout):
    """The result of an ``in_thread`` call (its exception raised again);
    fails the test if it still runs after ``timeout`` seconds."""
    box["thread"].join(timeout)
    assert "took" in box, "still waiting after %.1f s" % timeout
    if "error" in box:
        raise box["error"]
    return box["result"]


def outcome(function, *args, **kwargs):
    """(the exception class or "ok", elapsed seconds, value or exception)."""
    start = time.monotonic()
    try:
        value = function(*args, **kwargs)
    except kunci.Error as error:
        return type(error), time.monotonic() - start, error
    return "ok", time.monotonic() - start, value


def running_in_ci(environ=None):
    """Whether this is a CI run (``CI`` set, and not to ``false``/``0``)."""
    value = (os.environ if environ is None else environ).get("CI", "")
    return value not in ("", "false", "0")


def require_tool(program, package, environ=None):
    """The path of ``program``, which a test drives. When it is missing the
    test is skipped with a note naming it, except under CI (``CI=true``),
    where it fails: CI must run every test it claims to run. (The Rust
    suite's ``util::require_tool`` applies the same rule.)"""
    path = shutil.which(program)
    if path is not None:
        return path
    message = "`%s` is not installed (Debian package %s)" % (program, package)
    if running_in_ci(environ):
        pytest.fail(message + ": under CI=true a missing tool fails the test", pytrace=False)
    pytest.skip(message)


# --------------------------------------------------------------------------
# A real etcd cluster on loopback (for `etcd://`).


class EtcdCluster(object):
    """``size`` etcd members on loopback with temporary data directories, a
    short heartbeat (50 ms) and election timeout (500 ms), so that a leader
    change takes well under a second. As tests/util/etcd.rs starts them."""

    def __init__(self, etcd, directory, size=3):
        self.directory = str(directory)
        peers = [("m%d" % i, free_port(), free_port()) for i in range(size)]
        initial = ",".join("%s=http://127.0.0.1:%d" % (name, peer) for name, _, peer in peers)
        self.members = []
        for name, client, peer in peers:
            command = [etcd, "--name", name, "--data-dir", os.path.join(self.directory, name),
                 "--listen-client-urls", "http://127.0.0.1:%d" % client,
                 "--advertise-client-urls", "http://127.0.0.1:%d" % client,
                 "--listen-peer-urls", "http://127.0.0.1:%d" % peer,
                 "--initial-advertise-peer-urls", "http://127.0.0.1:%d" % peer,
                 "--initial-cluster", initial, "--initial-cluster-state", "new",
                 "--initial-cluster-token", "kunci-py-%d" % peers[0][2],
                 "--heartbeat-interval", "50", "--election-timeout", "500"]
            self.members.append({"name": name, "client": "127.0.0.1:%d" % client,
                                 "port": client, "command": command})
            self._start(self.members[-1])
        self.wait_ready()

    def _start(self, member):
        log = open(os.path.join(self.directory, member["name"] + ".log"), "ab")
        member["process"] = subprocess.Popen(
            member["command"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log)
        log.close()

    def restart(self, index):
        """Starts a member that was killed again, on its data directory."""
        self._start(self.members[index])

    @property
    def endpoints(self):
        return [member["client"] for member in self.members]

    @property
    def address(self):
        return "etcd://" + ",".join(self.endpoints)

    def status(self, member):
        import json
        import urllib.request
        request = urllib.request.Request(
            "http://%s/v3/maintenance/status" % member["client"], data=b"{}", method="POST")
        with urllib.request.urlopen(request, timeout=1) as answer:
            return json.loads(answer.read())

    def wait_ready(self, timeout=30):
        client = kunci.Client(self.address)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.acquire("warm-up", lease=1).release()
                    return
                except kunci.Error as error:
                    if time.monotonic() > deadline:
                        pytest.fail("etcd did not start: %s" % error)
                    time.sleep(0.1)
        finally:
            client.close()

    def leader(self, timeout=10):
        """The index of the member that leads, as the members report it."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for index, member in enumerate(self.members):
                if member["process"].poll() is not None:
                    continue
                try:
                    status = self.status(member)
                except (OSError, ValueError):
                    continue
                if status.get("leader") and status["leader"] == status["header"].get("member_id"):
                    return index
            time.sleep(0.05)
        pytest.fail("no etcd leader")

    def kill(self, index):
        """``kill -9`` of one member."""
        process = self.members[index]["process"]
        if process.poll() is None:
            process.kill()
            process.wait()

    def stop(self):
        for index in range(len(self.members)):
            self.kill(index)


@pytest.fixture(scope="module")
def etcd_cluster(tmp_path_factory):
    """One 3-member etcd cluster for the whole test module."""
    etcd = require_tool("etcd", "etcd-server")
    cluster = EtcdCluster(etcd, tmp_path_factory.mktemp("etcd"))
    yield cluster
    cluster.stop()
