"""The CLI against a local HTTP server standing where the API would be."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from onprem.embedded import free_port
from sluice import cli


class Gateway(BaseHTTPRequestHandler):
    """Answers what a proxy in front of the API might: an HTML error page."""

    bodies: list[dict] = []

    def do_POST(self):
        self.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        page = b"<html><body>502 Bad Gateway</body></html>"
        self.send_response(502)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        self.wfile.write(page)

    def log_message(self, *args):
        pass


@pytest.fixture
def gateway():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_an_answer_that_is_not_json_is_shown_not_a_traceback(gateway, capsys):
    Gateway.bodies.clear()
    code = cli.main(["--url", gateway, "--api-key", "k", "submit", "hello", "--deadline", "0"])
    assert code == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["error"]["code"] == "not_json" and "502 Bad Gateway" in shown["error"]["message"]
    # A deadline of 0 is sent, for the API to say why it is refused, not silently dropped.
    assert Gateway.bodies[-1]["deadline_s"] == 0


def test_an_unreachable_api_is_one_line_naming_it():
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as stopped:
        cli.main(["--url", url, "--api-key", "k", "get", "t1"])
    assert str(stopped.value).startswith(f"sluice: cannot reach {url}")
