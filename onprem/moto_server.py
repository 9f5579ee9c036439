"""moto's AWS emulator app without an access-log line per call, for the embedded profile.

Same app and server as `moto_server` (werkzeug's), minus the log line
(docs/benchmarks.md). Each call still comes on a new connection: werkzeug
answers every request with `Connection: close`, and after each response reads
whatever the socket holds for 10 ms, which on a kept connection would swallow
the client's next request. So HTTP/1.1 here only frames the responses; it
does not keep connections.

DynamoDB calls go one at a time. moto checks an UpdateItem's condition and
then applies the update to the stored item in place, with no lock between the
two, so two concurrent conditional writes to one task could both pass
(outcomes are written "only while queued": sluice.lifecycle), and a read
could see an item half updated. DynamoDB makes each single-item write atomic,
and Sluice's exactly-once outcome rests on that, so the emulator must too.
moto's DynamoDB is pure Python under the GIL: one lock costs it little.

A queue's receives likewise go one pass at a time. moto checks that a message
is visible and then marks it received, with no lock between, so two receivers
could both take one message (the SQS API hides it from every other receiver
once handed out): its task then ran twice, its attempts counting the second
receive. The long poll's waiting stays outside the lock.
`python -m onprem.moto_server -H 127.0.0.1 -p PORT`
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time

from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
from moto.sqs.models import SQSBackend
from werkzeug.serving import run_simple


class QuietHandler(MotoRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_request(self, code="-", size="-") -> None:
        pass


class AtomicDynamoDB:
    """WSGI middleware: DynamoDB requests (told by their X-Amz-Target) run one at a time."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Lock()

    def __call__(self, environ, start_response):
        if not environ.get("HTTP_X_AMZ_TARGET", "").startswith("DynamoDB_"):
            return self.app(environ, start_response)
        with self.lock:
            # moto's responses are built whole; list() keeps any lazy body inside the lock.
            return list(self.app(environ, start_response))


def atomic_receives() -> None:
    """Each pass over a queue's messages (find the visible ones, mark them
    received) under one lock; between passes a long poll waits unlocked."""
    one_pass = SQSBackend.receive_message
    lock = threading.Lock()

    def receive_message(self, queue_name, count, wait_seconds_timeout, visibility_timeout,
                        message_attribute_names=None):
        # moto's own loop, but for the lock: a pass, then (while nothing was
        # found) a wait of up to a second, and no pass once the poll's time is up.
        polling_end = time.monotonic() + (wait_seconds_timeout or 0)
        while True:
            with lock:  # a wait of 0: one pass, no waiting inside the lock
                received = one_pass(self, queue_name, count, 0, visibility_timeout, message_attribute_names)
            if received or not wait_seconds_timeout:
                return received
            self.get_queue(queue_name).wait_for_messages(1)
            if time.monotonic() > polling_end:
                return received

    SQSBackend.receive_message = receive_message


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-H", "--host", default="127.0.0.1")
    parser.add_argument("-p", "--port", type=int, default=5000)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    atomic_receives()
    run_simple(args.host, args.port, AtomicDynamoDB(DomainDispatcherApplication(create_backend_app)), threaded=True,
               request_handler=QuietHandler)


if __name__ == "__main__":
    main()
