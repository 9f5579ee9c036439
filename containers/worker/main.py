"""Worker image entrypoint: `python containers/worker/main.py`."""

import sys

from sluice.worker.main import main

if __name__ == "__main__":
    sys.exit(main())
