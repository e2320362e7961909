# firekeeper: build, test, bench.
#   make run     relay-sim replays the fixture; firekeeper consumes it on embedded defaults
#   make test    everything CI runs (installs redis-server and PostgreSQL if missing)
#   make bench   criterion benches on the real PDS capture
#   make lint    clippy, pedantic, as warnings

CARGO ?= cargo
SHELL := /bin/bash

.PHONY: build run test bench lint deps fmt

build:
	$(CARGO) build --workspace --all-targets

run:
	scripts/run-demo.sh

deps:
	scripts/ensure-deps.sh

test: deps
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --workspace --no-fail-fast; \
	else \
		$(CARGO) test --workspace --no-fail-fast; \
	fi
	$(CARGO) test --workspace --doc

bench:
	$(CARGO) bench -p relay-client --bench decode

lint:
	$(CARGO) clippy --workspace --all-targets

fmt:
	$(CARGO) fmt --all
