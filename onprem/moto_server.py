"""moto's AWS emulator app without an access-log line per call, for the embedded profile.

Same app and server as `moto_server` (werkzeug's), minus the log line
(docs/benchmarks.md). Each call still comes on a new connection: werkzeug
answers every request with `Connection: close`, and after each response reads
whatever the socket holds for 10 ms, which on a kept connection would swallow
the client's next request. So HTTP/1.1 here only frames the responses; it
does not keep connections. `python -m onprem.moto_server -H 127.0.0.1 -p PORT`
"""

from __future__ import annotations

import argparse
import signal
import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


class QuietHandler(MotoRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_request(self, code="-", size="-") -> None:
        pass


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple(args.host, args.port, DomainDispatcherApplication(create_backend_app), threaded=True,
               request_handler=QuietHandler)


if __name__ == "__main__":
    main()
