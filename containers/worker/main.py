"""Worker image entrypoint: `python containers/worker/main.py`. With
SLUICE_BOOTSTRAP_ON_START=1 (compose.yaml, onprem/k8s/onprem) it first creates
what is missing, once its settings are accepted (sluice.worker.main.main)."""

import sys

from sluice.worker.main import main

if __name__ == "__main__":
    sys.exit(main())
