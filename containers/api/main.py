"""API image entrypoint: uvicorn serving the same FastAPI app that Lambda serves via Mangum."""

import os
import sys

import uvicorn
from uvicorn.config import LOG_LEVELS

from sluice.api.app import create_app
from sluice.bootstrap import ensure_resources_on_start
from sluice.settings import Settings, SettingsError
from sluice.starting import stop_at_once_until_ready


# What logging takes and uvicorn names otherwise (the workers share the variable).
_ALIASES = {"warn": "warning", "fatal": "critical"}


def log_level() -> str | None:
    """SLUICE_LOG_LEVEL in any case, as uvicorn names it (unset or empty: info); None if it is none of them."""
    level = (os.environ.get("SLUICE_LOG_LEVEL") or "info").strip().lower()
    level = _ALIASES.get(level, level)
    return level if level in LOG_LEVELS else None


if __name__ == "__main__":
    stop_at_once_until_ready()  # until uvicorn installs its own handlers
    level = log_level()
    if level is None:  # one line, not uvicorn's KeyError traceback
        print(f"api: refused settings: SLUICE_LOG_LEVEL={os.environ['SLUICE_LOG_LEVEL']!r}: should be one of "
              f"{', '.join(name.upper() for name in LOG_LEVELS)} (any case)", file=sys.stderr, flush=True)
        sys.exit(2)
    try:
        settings = Settings()
    except SettingsError as exc:  # before the bootstrap, which would trace back on it
        print(f"api: refused settings: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    ensure_resources_on_start(settings)  # on-prem only (SLUICE_BOOTSTRAP_ON_START=1)
    uvicorn.run(
        create_app(settings),
        host=os.environ.get("SLUICE_HOST", "127.0.0.1"),
        port=int(os.environ.get("SLUICE_PORT", "8000")),
        log_level=level,
        access_log=os.environ.get("SLUICE_ACCESS_LOG", "1") == "1",
    )
