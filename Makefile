# firekeeper: build, test, bench.
#   make run     relay-sim replays the fixture; firekeeper consumes it on embedded defaults
#   make test    everything CI runs (installs redis-server and PostgreSQL if missing)
#   make bench   decode benchmark (criterion), the chain check's memory, figures through the real binary
#   make chaos   the fault suites (Redis and NATS) at scale 4, and 20,000 generated relay switches (make test runs scale 1, 300 switches)
#   make soak    30 minutes of random faults under the chaos oracle, on Redis and on NATS (make test runs 12 s each)
#   make lint    the CI style gates: rustfmt check, clippy (pedantic) with warnings as errors

CARGO ?= cargo
SHELL := /bin/bash

.PHONY: build run test bench chaos soak lint deps fmt

build:
	$(CARGO) build --workspace --all-targets

run:
	@scripts/run-demo.sh

deps:
	scripts/ensure-deps.sh

test: deps
	@if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(CARGO) nextest run --workspace --no-fail-fast; \
	else \
		$(CARGO) test --workspace --no-fail-fast; \
	fi

bench: deps
	$(CARGO) bench -p relay-client --bench decode
	$(CARGO) bench -p consumer --bench chain
	$(CARGO) bench -p atproto-crypto --bench verify
	$(CARGO) bench -p atproto-repo --bench check
	$(CARGO) bench -p repo-sync --bench snapshot
	$(CARGO) bench -p firekeeper --bench cluster
	$(CARGO) bench -p firekeeper --bench giant
	$(CARGO) bench -p firekeeper --bench shared
	$(CARGO) bench -p firekeeper --bench jetstream

chaos: deps
	FK_SWITCH_CASES=20000 $(CARGO) nextest run -p consumer -E 'test(every_generated_switch)' --no-fail-fast
	FK_TEST_CHAOS_SCALE=4 $(CARGO) nextest run -p firekeeper --test chaos --test chaos_nats --no-fail-fast

soak: deps
	FK_TEST_SOAK_SECS=$${FK_TEST_SOAK_SECS:-1800} $(CARGO) nextest run -p firekeeper --test chaos --test chaos_nats --no-capture -E 'test(soak)'

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

fmt:
	$(CARGO) fmt --all
