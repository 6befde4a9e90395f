#!/usr/bin/env bash
# The cost of the key hash: foldhash (the default build, A) against std's
# SipHash-1-3 (`--features sip-hash`, B), on `pairs` C=50 P=32 with an
# empty table and with 1,000,000 other locks held, alternating run by run
# (see ab.sh). Builds both binaries (the SipHash one under target/sip-hash).
# Environment: as ab.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
(cd "$ROOT" && cargo build --release -q &&
    cargo build --release -q --features sip-hash --target-dir target/sip-hash)
A=$ROOT/target/release/kunci B=$ROOT/target/sip-hash/release/kunci \
    NAME_A=foldhash NAME_B=SipHash-1-3 exec "$HERE/ab.sh"
