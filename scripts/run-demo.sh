#!/usr/bin/env bash
# `make run`: relay-sim replays the real PDS capture at 200 frames/s on 127.0.0.1:2470,
# and firekeeper consumes it on embedded defaults (local lease file, file cursor, JSON
# lines on stdout, logs on stderr, HTTP on 127.0.0.1:9090). Ctrl-C stops both.
# stdout carries the events and nothing else: `make run > events.jsonl` is JSON lines.
#   RATE=…          frames per second (default 200)
#   DEMO_LISTEN=…   where relay-sim listens (default 127.0.0.1:2470)
#   DEMO_BIN_DIR=…  use binaries built there instead of building release ones
set -euo pipefail
cd "$(dirname "$0")/.."
bin=${DEMO_BIN_DIR:-}
if [[ -z $bin ]]; then
  cargo build --release -p relay-sim -p firekeeper >&2
  bin=./target/release
fi
listen=${DEMO_LISTEN:-127.0.0.1:2470}
capture=${CAPTURE:-fixtures/pds-capture.frames}
"$bin/relay-sim" --capture "$capture" --listen "$listen" --initial 0 --rate "${RATE:-200}" >&2 &
sim=$!
trap 'kill $sim 2>/dev/null || true' EXIT
sleep 0.3
export FIREKEEPER_RELAY=${FIREKEEPER_RELAY:-ws://$listen}
export FIREKEEPER_LOG_FORMAT=${FIREKEEPER_LOG_FORMAT:-text}
# The demo capture's DIDs resolve nowhere (its PDS and PLC are not running): verification,
# on by default, would hold every commit waiting for a key.
export FIREKEEPER_VERIFY=${FIREKEEPER_VERIFY:-off}
# First run: start from the beginning of the capture instead of the live tail.
if "$bin/firekeeper" cursor show | grep -q 'cursor none'; then
  "$bin/firekeeper" cursor set 0 >&2
fi
"$bin/firekeeper" run
