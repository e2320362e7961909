#!/usr/bin/env bash
# `make run`: relay-sim replays the real PDS capture at 200 frames/s on 127.0.0.1:2470,
# and firekeeper consumes it on embedded defaults (local lease file, file cursor, JSON
# lines on stdout, logs on stderr, HTTP on 127.0.0.1:9090). Ctrl-C stops both.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p relay-sim -p firekeeper
capture=${CAPTURE:-fixtures/pds-capture.frames}
./target/release/relay-sim --capture "$capture" --listen 127.0.0.1:2470 --initial 0 --rate "${RATE:-200}" &
sim=$!
trap 'kill $sim 2>/dev/null || true' EXIT
sleep 0.3
export FIREKEEPER_RELAY=${FIREKEEPER_RELAY:-ws://127.0.0.1:2470}
export FIREKEEPER_LOG_FORMAT=${FIREKEEPER_LOG_FORMAT:-text}
# First run: start from the beginning of the capture instead of the live tail.
if ./target/release/firekeeper cursor show | grep -q 'cursor none'; then
  ./target/release/firekeeper cursor set 0 >&2
fi
./target/release/firekeeper run
