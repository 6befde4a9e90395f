#!/usr/bin/env python3
"""Lists every key of a kunci server with `L` (spec §11.3), page by page,
over and over until DURATION seconds have passed; prints one line per full
listing (keys, pages, seconds, slowest page) as JSON. Raw frames, no client
library: used by docs/bench/list.sh.

Usage: list_keys.py HOST:PORT COUNT DURATION
"""

import json
import socket
import struct
import sys
import time


def main():
    host, port = sys.argv[1].rsplit(":", 1)
    count = int(sys.argv[2])
    duration = float(sys.argv[3])
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    reader = sock.makefile("rb", buffering=1 << 20)
    end = time.monotonic() + duration
    while time.monotonic() < end:
        cursor, keys, pages, slowest = 0, 0, 0, 0.0
        start = time.monotonic()
        while True:
            sent = time.monotonic()
            sock.sendall(b"L" + struct.pack(">QQH", 1, cursor, count) + b"\n")
            while True:
                op = reader.read(1)
                if op == b"K":
                    reader.read(18)
                    reader.readline()
                    keys += 1
                elif op == b"Z":
                    _, _, cursor = struct.unpack(">QIQ", reader.read(20))
                    reader.read(1)
                    break
                else:
                    raise SystemExit(f"unexpected frame {op!r}")
            pages += 1
            slowest = max(slowest, time.monotonic() - sent)
            if cursor == 0:
                break
        print(json.dumps({"keys": keys, "pages": pages,
                          "seconds": round(time.monotonic() - start, 3),
                          "slowest_page_ms": round(slowest * 1e3, 2)}), flush=True)


if __name__ == "__main__":
    main()
