#!/usr/bin/env bash
# Run ON THE LENT GPU MACHINE, from the repository root, as the second call of
# bench/gpu_setup.sh's header (the kit's parts unpacked or carried): check the
# kit, then `python3 -m bench --only gpu` inside the device's 600 s per command,
# with everything it writes in $OUT, the only folder that comes back:
#
#   $OUT/gpu.json         the figures, saved after every phase (a late failure keeps the earlier ones)
#   $OUT/machine.json     the suite's machine record
#   $OUT/drain-logs.txt   the tail of every process log of each drain's stack (a dead worker's too)
#   $OUT/gpu-stdout.txt   everything printed, every figure included
#
#   bash bench/gpu_run.sh [--no-node]     (--no-node: the one-call variant, DynamoDB on moto)
#
# Time: the device stops a command at 600 s (SLUICE_GPU_COMMAND_LIMIT_S). What
# the kit check leaves of it, less a margin, bounds python3 with `timeout`, and
# the benchmark's own budget (SLUICE_GPU_BUDGET_S) is 90 s less again: that
# covers Python's start, the last stack's stop and a phase's overrun, so the
# benchmark ends by itself, and `timeout` is only the backstop.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
LIMIT=${SLUICE_GPU_COMMAND_LIMIT_S:-600}
RESULTS=${OUT:-$ROOT/bench/results}
mkdir -p "$RESULTS"

bash bench/gpu_setup.sh --check "$@" 2>&1 | tee "$RESULTS/gpu-stdout.txt"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "gpu_run: the kit check failed (above); no benchmark run" >&2; exit 1; }
# shellcheck disable=SC1091
. "${SLUICE_KIT:-/root/kit}/env.sh"

left=$((LIMIT - 20 - SECONDS))  # 20 s for the tool to collect $OUT
budget=$((left - 90))
if [ "$budget" -lt 120 ]; then
  echo "gpu_run: only ${left}s left after the kit check; not starting the benchmark" >&2
  exit 1
fi
export SLUICE_BENCH_RESULTS=$RESULTS SLUICE_GPU_BUDGET_S=$budget PYTHONUNBUFFERED=1
echo "gpu_run: ${SECONDS}s spent on the kit; the benchmark gets ${budget}s of budget, python3 at most ${left}s" \
  | tee -a "$RESULTS/gpu-stdout.txt"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | sed 's/^/gpu_run: nvidia-smi: /' \
    | tee -a "$RESULTS/gpu-stdout.txt"
fi
timeout -k 5 "$left" python3 -m bench --only gpu 2>&1 | tee -a "$RESULTS/gpu-stdout.txt"
rc=${PIPESTATUS[0]}
[ "$rc" != 124 ] || echo "gpu_run: python3 was stopped at ${left}s; gpu.json holds the phases saved before" >&2
if [ "$rc" = 0 ] && grep -q '"skipped"' "$RESULTS/gpu.json" 2>/dev/null; then
  echo "gpu_run: the benchmark skipped (no CUDA GPU seen by torch): nothing measured" >&2
  rc=2
fi
echo "gpu_run: exit code $rc after ${SECONDS}s; in $RESULTS: $(cd "$RESULTS" && echo *)"
exit "$rc"
