"""Python imports this module at start-up in every process that has this
folder on PYTHONPATH (the `site` hook). It sets the interpreter's switch
interval from SLUICE_BENCH_SWITCH_INTERVAL_S, so that bench/gpu.py can drain
with workers at another interval without a product setting for it."""

import os
import sys

if os.environ.get("SLUICE_BENCH_SWITCH_INTERVAL_S"):
    sys.setswitchinterval(float(os.environ["SLUICE_BENCH_SWITCH_INTERVAL_S"]))
