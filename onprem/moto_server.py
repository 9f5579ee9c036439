"""moto's AWS emulator app on a cheaper HTTP server, for the embedded profile.

Same app as `moto_server`, two changes, both measured in docs/benchmarks.md:
HTTP/1.1 keep-alive (moto_server answers HTTP/1.0, so every boto3 call opened
a TCP connection and the server started a thread for it) and no access-log
line per call. `python -m onprem.moto_server -H 127.0.0.1 -p PORT`
"""

from __future__ import annotations

import argparse
import signal
import sys

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from werkzeug.serving import run_simple


class KeepAliveHandler(MotoRequestHandler):
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
               request_handler=KeepAliveHandler)


if __name__ == "__main__":
    main()
