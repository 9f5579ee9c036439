"""What a process does with SIGTERM or SIGINT before it has taken any work.

In a container the entrypoint is PID 1, and the kernel drops a signal that
PID 1 has no handler for. Without one, a stop that lands during start-up (the
bootstrap, importing torch, loading a model) is lost: the process goes on to
take work, and the end of the grace period kills it in the middle of it.
"""

from __future__ import annotations

import signal


def stop_while_starting(signum, frame) -> None:
    """Nothing is held yet, so nothing to finish or hand back: exit at once."""
    raise SystemExit(0)


def stop_at_once_until_ready() -> None:
    """The first thing an entrypoint does; it installs its own handlers once it takes work."""
    signal.signal(signal.SIGTERM, stop_while_starting)
    signal.signal(signal.SIGINT, stop_while_starting)
