#!/usr/bin/env bash
# Installs what the integration tests start themselves (redis-server, the PostgreSQL
# server binaries, nats-server, libfaketime) when this machine lacks them. Tests never use a shared system
# instance: each starts its own server on a free loopback port.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# nats-server: the NATS lease, cursor store and JetStream sink tests run `nats-server -js`.
command -v nats-server >/dev/null 2>&1 || [ -x /usr/sbin/nats-server ] || need+=(nats-server)
compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || need+=(postgresql)
# libfaketime: the wall-clock-jump test fakes CLOCK_REALTIME of one process.
compgen -G "/usr/lib/*/faketime/libfaketime.so.1" >/dev/null || need+=(libfaketime)
# openssl (the command): the TLS-to-Redis test makes a throw-away CA and certificate.
command -v openssl >/dev/null 2>&1 || need+=(openssl)
# libsecp256k1 (secp256k1-sys) is compiled from C: a C compiler is needed.
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
# promtool (Debian prometheus) unit-tests the alert rules; docker-compose validates the
# compose file (tests/deploy.rs).
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
# python3-venv: kubernetes-validate (PyPI, schemas bundled, works offline once installed)
# checks the manifests in deploy/kubernetes; it lives in .tools/venv inside the checkout.
python3 -c 'import ensurepip, venv' >/dev/null 2>&1 || need+=(python3-venv)
# mkfifo (coreutils) is always there; the frozen-leader test writes its jsonl to a FIFO.

if ((${#need[@]})); then
  echo "ensure-deps: installing ${need[*]}"
  if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

kv=.tools/venv/bin/kubernetes-validate
if [ ! -x "$kv" ]; then
  echo "ensure-deps: installing kubernetes-validate into .tools/venv"
  python3 -m venv .tools/venv
  .tools/venv/bin/pip install -q --disable-pip-version-check kubernetes-validate==1.37.0
fi
