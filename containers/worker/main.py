"""Worker image entrypoint: `python containers/worker/main.py`."""

import sys

from sluice.bootstrap import ensure_resources_on_start
from sluice.worker.main import main

if __name__ == "__main__":
    ensure_resources_on_start()  # on-prem only (SLUICE_BOOTSTRAP_ON_START=1: compose.yaml, onprem/k8s/onprem)
    sys.exit(main())
