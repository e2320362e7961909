# firekeeper: build, test, bench.
#   make test    everything CI runs (installs redis-server if the machine lacks it)
#   make bench   criterion benches on the real PDS capture
#   make lint    clippy, pedantic, as warnings

CARGO ?= cargo
SHELL := /bin/bash

.PHONY: build test bench lint deps fmt

build:
	$(CARGO) build --workspace --all-targets

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
