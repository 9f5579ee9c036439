"""API image entrypoint: uvicorn serving the same FastAPI app that Lambda serves via Mangum."""

import os

import uvicorn

from sluice.api.app import create_app
from sluice.bootstrap import ensure_resources_on_start

if __name__ == "__main__":
    ensure_resources_on_start()  # on-prem Compose only (SLUICE_BOOTSTRAP_ON_START=1)
    uvicorn.run(
        create_app(),
        host=os.environ.get("SLUICE_HOST", "127.0.0.1"),
        port=int(os.environ.get("SLUICE_PORT", "8000")),
        log_level=os.environ.get("SLUICE_LOG_LEVEL", "info").lower(),
        access_log=os.environ.get("SLUICE_ACCESS_LOG", "1") == "1",
    )
