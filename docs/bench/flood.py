#!/usr/bin/env python3
"""Issue 27's attacks on one `kunci serve`, and what another client sees.

    python3 docs/bench/flood.py BINARY [list|holders|idle|unread|tls|grants|none ...]

Starts BINARY serve on a free loopback port for each attack, prepares it,
starts the flood, and prints one line per attack:

- list:    16,000 keys; 4 connections pipeline `L 0 1000 "zzz"` (16,000
           slots examined each) and read every answer. Another client's
           ping round trip, p50/p99/max of PINGS (default 50, 5 ms apart).
- holders: a key with 65,535 grants; 2 connections pipeline `H` on it.
           Pings as above.
- idle:    as many idle connections from 127.0.0.1 as the server takes
           (of --max-connections 16,384); then whether a client from
           127.0.0.2 gets a pong.
- unread:  1,000 keys of 255 bytes; 200 connections each send 100 `L`
           of 1,000 and never read; the server's RSS growth.
- grants:  --auth, --max-grants 100,000: identity `tenant` (lock:t/,
           with the quota words in $QUOTA, default max-grants=50000; set
           QUOTA= for none) pipelines 100,000 `S` (limit 65,535, take 1)
           on two keys; then whether identity `other` (lock:o/) is
           granted a new key. Counts the tenant's grants and `B`s.
- none:    no attack: the pings alone, the machine's baseline.
- tls:     a second listener, tls:// with an RSA-2048 certificate (made
           with openssl); PARALLEL (default 512) threads each replay one
           recorded ClientHello on a new connection, wait for the
           server's first flight (it signed) and close, over and over.
           Pings (plaintext) as above, and the handshakes per second.

Stdlib only; every server and flood is stopped before it returns.
"""
import hashlib
import os
import shutil
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time


def free_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def start(binary, *args):
    port = free_port()
    server = subprocess.Popen(
        [binary, "serve", "--no-state-dir", "--listen", f"127.0.0.1:{port}", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(100):
        try:
            socket.create_connection(("127.0.0.1", port), 1).close()
            return server, port
        except OSError:
            time.sleep(0.05)
    server.kill()
    raise SystemExit("server did not start")


def acquire(owner, key, lease=255):
    return b"A\x00" + bytes([lease]) + struct.pack(">Q", owner) + key + b"\n"


def s_frame(owner, key, label=b"", limit=65535):
    return (b"S\x00\xff" + struct.pack(">QHHB", owner, limit, 1, len(key))
            + key + label + b"\n")


def ping(nonce):
    return b"P" + struct.pack(">Q", nonce) + b"\n"


def prepare(port, frames, answers_bytes_min):
    """Sends frames and reads until at least that many bytes came back."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(frames)
    got = 0
    while got < answers_bytes_min:
        chunk = conn.recv(1 << 16)
        if not chunk:
            break
        got += len(chunk)
    conn.close()


def flood(port, count, frame):
    stop = threading.Event()
    burst = frame * max(1, (64 * 1024) // len(frame))
    conns = []
    threads = []
    for _ in range(count):
        conn = socket.create_connection(("127.0.0.1", port))
        conns.append(conn)

        def reader(c=conn):
            try:
                while c.recv(1 << 16):
                    pass
            except OSError:
                pass

        def writer(c=conn):
            try:
                while not stop.is_set():
                    c.sendall(burst)
            except OSError:
                pass
        for target in (reader, writer):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            threads.append(thread)

    def end():
        stop.set()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
    return end


def client_hello():
    """One ClientHello as a TLS client sends it (recorded in memory)."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = context.wrap_bio(incoming, outgoing, server_hostname="localhost")
    try:
        client.do_handshake()
    except ssl.SSLWantReadError:
        pass
    return outgoing.read()


def hello_flood(port, count, hello):
    """count threads replay hello on new connections; returns (end,
    handshakes), handshakes() being the server flights received so far."""
    stop = threading.Event()
    done = [0] * count

    def replay(index):
        while not stop.is_set():
            try:
                conn = socket.create_connection(("127.0.0.1", port), 10)
                conn.settimeout(10)
                conn.sendall(hello)
                if conn.recv(1 << 16):
                    done[index] += 1
                conn.close()
            except OSError:
                time.sleep(0.01)
    threads = [threading.Thread(target=replay, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()

    def end():
        stop.set()
        for thread in threads:
            thread.join(15)
    return end, lambda: sum(done)


def pings(port, n=int(os.environ.get("PINGS", "50"))):
    time.sleep(0.5)
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(60)
    times = []
    for nonce in range(n):
        start = time.monotonic()
        conn.sendall(ping(nonce))
        got = b""
        while len(got) < 10:
            chunk = conn.recv(10 - len(got))
            if not chunk:
                raise SystemExit("ping connection closed")
            got += chunk
        times.append(time.monotonic() - start)
        time.sleep(0.005)
    conn.close()
    times.sort()
    return (f"ping p50 {times[n // 2] * 1e3:.2f} ms, p99 {times[n * 99 // 100] * 1e3:.2f} ms, "
            f"max {times[-1] * 1e3:.2f} ms")


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def attack(binary, name):
    if name == "list":
        server, port = start(binary)
        keys = b"".join(acquire(1, b"k%05d" % n) for n in range(16000))
        prepare(port, keys, 16000 * 18)
        frame = b"L" + struct.pack(">QQH", 1, 0, 1000) + b"zzz\n"
        end = flood(port, 4, frame)
    elif name == "holders":
        server, port = start(binary)
        grants = b"".join(s_frame(owner, b"h") for owner in range(65535))
        prepare(port, grants, 65535 * 18)
        end = flood(port, 2, b"H" + struct.pack(">Q", 1) + b"h\n")
    elif name == "idle":
        server, port = start(binary)
        held = []
        for _ in range(16384):
            try:
                held.append(socket.create_connection(("127.0.0.1", port)))
            except OSError:
                break
        time.sleep(1)
        other = socket.socket()
        other.bind(("127.0.0.2", 0))
        other.settimeout(10)
        other.connect(("127.0.0.1", port))
        other.sendall(ping(7))
        try:
            answer = other.recv(64)
        except OSError as e:
            answer = repr(e).encode()
        kind = "pong" if answer[:1] == b"P" else f"refused {answer[:2]!r}"
        server.kill()
        server.wait()
        for c in held:
            c.close()
        return f"{len(held)} idle connections opened from 127.0.0.1; then 127.0.0.2 got {kind}"
    elif name == "unread":
        server, port = start(binary)
        keys = b"".join(acquire(1, b"%0255d" % n) for n in range(1000))
        prepare(port, keys, 1000 * 18)
        before = rss_kib(server.pid)
        frame = (b"L" + struct.pack(">QQH", 1, 0, 1000) + b"\n") * 100
        conns = []
        for _ in range(200):
            conn = socket.create_connection(("127.0.0.1", port))
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.sendall(frame)
            conns.append(conn)
        time.sleep(2)
        after = rss_kib(server.pid)
        server.kill()
        server.wait()
        for c in conns:
            c.close()
        return (f"200 connections that never read: RSS +{(after - before) / 1024:.1f} MiB "
                f"({(after - before) * 1024 // 200:,} B each)")
    elif name == "grants":
        directory = tempfile.mkdtemp(prefix="flood-grants-")
        secrets = {who: f"{who}-secret-0123456789abcdef-0123456789".encode()
                   for who in ("tenant", "other")}
        quota = os.environ.get("QUOTA", "max-grants=50000")
        with open(f"{directory}/auth", "w") as auth:
            for who, scope in (("tenant", f"lock:t/ {quota}"), ("other", "lock:o/")):
                digest = hashlib.sha256(secrets[who]).hexdigest()
                auth.write(f"{who} {digest} {scope}\n")
        server, port = start(binary, "--auth", f"{directory}/auth", "--max-grants", "100000")
        shutil.rmtree(directory)
        tenant = socket.create_connection(("127.0.0.1", port))
        tenant.sendall(b"U" + secrets["tenant"] + b"\n")
        reader = tenant.makefile("rb")
        reader.readline()
        count = 100000
        frames = b"".join(s_frame(n, b"t/%d" % (n % 2)) for n in range(count))
        threading.Thread(target=tenant.sendall, args=(frames,), daemon=True).start()
        kinds = {}
        for _ in range(count):
            kind = reader.read(1)
            reader.read(17 if kind == b"A" else 9)
            kinds[kind] = kinds.get(kind, 0) + 1
        other = socket.create_connection(("127.0.0.1", port))
        other.sendall(b"U" + secrets["other"] + b"\n" + acquire(1, b"o/x"))
        answers = other.makefile("rb")
        answers.readline()
        answer = answers.read(1)
        server.kill()
        server.wait()
        tenant.close()
        other.close()
        seen = {b"A": "granted", b"B": "busy", b"T": "timeout"}
        return (f"tenant ({quota or 'no quota'}): {kinds.get(b'A', 0):,} granted, "
                f"{kinds.get(b'B', 0):,} busy; another identity's A on a new key: "
                f"{seen.get(answer, repr(answer))}")
    elif name == "none":
        # The baseline: the same pings with no flood.
        server, port = start(binary)
        end = lambda: None  # noqa: E731
    elif name == "tls":
        directory = tempfile.mkdtemp(prefix="flood-tls-")
        cert, key = f"{directory}/cert.pem", f"{directory}/key.pem"
        subprocess.run(
            ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
             "-out", cert, "-days", "1", "-subj", "/CN=localhost",
             "-addext", "subjectAltName=DNS:localhost"],
            check=True, capture_output=True)
        tls_port = free_port()
        server, port = start(binary, "--listen", f"tls://127.0.0.1:{tls_port}",
                             "--tls-cert", cert, "--tls-key", key)
        shutil.rmtree(directory)
        parallel = int(os.environ.get("PARALLEL", "512"))
        end, handshakes = hello_flood(tls_port, parallel, client_hello())
        time.sleep(1)
        first, start_at = handshakes(), time.monotonic()
        try:
            seen = pings(port)
            rate = (handshakes() - first) / (time.monotonic() - start_at)
            return f"{seen}; {rate:,.0f} handshakes/s ({parallel} in parallel)"
        finally:
            end()
            server.kill()
            server.wait()
    else:
        raise SystemExit(f"unknown attack {name}")
    try:
        return pings(port)
    finally:
        end()
        server.kill()
        server.wait()


def main():
    binary = sys.argv[1]
    for name in sys.argv[2:] or ["list", "holders", "idle", "unread", "tls"]:
        print(f"{name}: {attack(binary, name)}", flush=True)


if __name__ == "__main__":
    main()
