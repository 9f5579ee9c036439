"""The CLI's HTTP side against stub servers: polls that fail after a submit was
accepted, connections that drop or hang, and redirects."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler

import pytest

from sluice import cli
from tests.http_stub import serving


class Scripted(BaseHTTPRequestHandler):
    """POST accepts task t1; each GET takes the next of `polls` (the last one
    repeats): (status, body, headers), or "drop" (close without an answer),
    "reset" (a TCP reset) or "hang" (no answer until the test ends)."""

    polls: list = []
    gets: list[str] = []
    released: threading.Event

    posts: list = []  # steps for the submits, as `polls` (none: each accepted)
    post_keys: list[str] = []

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.post_keys.append(self.headers.get("Idempotency-Key"))
        step = self.posts[min(len(self.post_keys), len(self.posts)) - 1] if self.posts else \
            (202, {"task_id": "t1", "status": "queued"})
        if step == "drop":
            return
        self.answer(*step)

    def do_GET(self):
        self.gets.append(self.path)
        step = self.polls[min(len(self.gets), len(self.polls)) - 1]
        if step == "drop":
            return
        if step == "reset":
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.connection.close()
            return
        if step == "hang":
            self.released.wait(30)
            return
        self.answer(*step)

    def answer(self, code: int, body: dict, headers: dict | None = None):
        data = json.dumps(body).encode()
        self.send_response(code)
        for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def scripted():
    """Serves a Scripted of its own; yields (url, handler class): set its `polls`."""
    handler = type("Api", (Scripted,), {"polls": [], "gets": [], "posts": [], "post_keys": [],
                                        "released": threading.Event()})
    with serving(handler) as url:
        yield url, handler
        handler.released.set()


QUEUED = (200, {"task_id": "t1", "status": "queued"})
DONE = (200, {"task_id": "t1", "status": "succeeded", "result": {"outputs": []}})


@pytest.mark.parametrize("blip", [
    (503, {"error": {"code": "unavailable", "message": "a dependency is down"}}, {"Retry-After": "0"}),
    (429, {"error": {"code": "rate_limited", "message": "slow down"}}, {"Retry-After": "0"}),
    "drop",
])
def test_a_poll_that_fails_for_a_while_is_retried_and_the_task_id_said_at_once(scripted, capsys, blip):
    url, api = scripted
    api.polls = [blip, blip, DONE]
    started = time.monotonic()
    assert cli.main(["--url", url, "--api-key", "k", "submit", "--wait", "--timeout", "20", "hello"]) == 0
    assert time.monotonic() - started < 10 and len(api.gets) == 3
    captured = capsys.readouterr()
    assert json.loads(captured.out)["status"] == "succeeded"
    assert captured.err.splitlines()[0] == "sluice: submitted task t1"


@pytest.mark.parametrize("failing, why", [
    ((503, {"error": {"code": "unavailable", "message": "down"}}, {"Retry-After": "0"}),
     "the API answered 503 unavailable: down until --timeout 1 s"),
    ("drop", "cannot reach"),
    ("reset", "cannot reach"),
])
def test_polls_failing_until_the_timeout_exit_4_naming_the_task(scripted, capsys, failing, why):
    url, api = scripted
    api.polls = [failing]
    assert cli.main(["--url", url, "--api-key", "k", "submit", "--wait", "--timeout", "1", "hello"]) == 4
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    lines = captured.err.strip().splitlines()
    assert lines[0] == "sluice: submitted task t1" and len(lines) == 2, captured.err
    assert lines[1].startswith("sluice submit: task t1 was submitted, but following it failed: ") and why in lines[1]
    assert "do not submit it again" in lines[1]


def test_a_poll_refused_for_good_exits_4_at_once(scripted, capsys):
    url, api = scripted
    api.polls = [(403, {"error": {"code": "forbidden", "message": "revoked key"}})]
    assert cli.main(["--url", url, "--api-key", "k", "submit", "--wait", "--timeout", "20", "hello"]) == 4
    assert len(api.gets) == 1
    err = capsys.readouterr().err
    assert "task t1 was submitted, but following it failed: the API answered 403 forbidden: revoked key" in err


def test_still_queued_at_the_timeout_is_still_2(scripted, capsys):
    url, api = scripted
    api.polls = [QUEUED]
    assert cli.main(["--url", url, "--api-key", "k", "submit", "--wait", "--timeout", "0.5", "hello"]) == 2
    assert "task t1 still queued after 0.5s" in capsys.readouterr().err


@pytest.mark.parametrize("failing, reason", [
    ("drop", "RemoteDisconnected"),
    ("reset", "ConnectionResetError"),
    ("hang", "no answer within 0.5 s"),
])
def test_a_dropped_reset_or_silent_connection_is_one_line_naming_the_api(scripted, monkeypatch, capsys, failing,
                                                                         reason):
    url, api = scripted
    api.polls = [failing]
    monkeypatch.setattr(cli, "_TIMEOUT_S", 0.5)
    assert cli.main(["--url", url, "--api-key", "k", "get", "t1"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert captured.err.startswith(f"sluice: cannot reach {url}: ") and reason in captured.err, captured.err


class Moved(BaseHTTPRequestHandler):
    """An API that moved: every request is redirected to `target`."""

    target = ""

    def do_POST(self):
        self.send_response(302)
        self.send_header("Location", self.target + self.path)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args):
        pass


class Elsewhere(BaseHTTPRequestHandler):
    """Where the redirect points: records what reaches it, answers 200."""

    seen: list[tuple[str, str | None]] = []

    def do_GET(self):
        self.seen.append((self.command, self.headers.get("x-api-key")))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    do_POST = do_GET

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("command", [["submit", "hello"], ["get", "t1"]])
def test_a_redirect_is_refused_not_followed_with_the_key(monkeypatch, capsys, command):
    Elsewhere.seen.clear()
    with serving(Elsewhere) as other, serving(Moved) as moved:
        monkeypatch.setattr(Moved, "target", other + "/prod")
        assert cli.main(["--url", moved, "--api-key", "sk_secret", *command]) == 1
    assert Elsewhere.seen == []  # neither the key nor a GET standing in for the POST went there
    captured = capsys.readouterr()
    path = "/v1/tasks" if command[0] == "submit" else "/v1/tasks/t1"
    assert captured.out == ""
    assert captured.err.strip() == (f"sluice: the API answered a redirect (302) to {other}/prod{path}; "
                                    f"use --url {other}/prod")


class NotTheApi(BaseHTTPRequestHandler):
    """Some other service at --url (a login proxy, a web page): 200 with HTML."""

    body, content_type = b"<html>sign in</html>", "text/html"

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", self.content_type)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_POST = do_DELETE = do_GET

    def log_message(self, *args):
        pass


class AnotherJsonApi(NotTheApi):
    """Another JSON API at --url: 200 with JSON that names no task."""

    body, content_type = b'{"ok": true}', "application/json"


@pytest.mark.parametrize("server, shown", [(NotTheApi, "<html>"), (AnotherJsonApi, '{"ok": true}')],
                         ids=["a web page", "another JSON API"])
@pytest.mark.parametrize("command", [["submit", "hello"], ["submit", "--wait", "hello"], ["get", "t1"]])
def test_a_2xx_that_is_not_the_api_s_json_is_an_error_not_a_success(capsys, command, server, shown):
    with serving(server) as url:
        assert cli.main(["--url", url, "--api-key", "k", *command]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured.err
    assert "is not the Sluice API's JSON" in captured.err and shown in captured.err, captured.err


@pytest.mark.parametrize("timeout", ["-5", "0", "nan", "soon"])
def test_a_wait_timeout_that_is_not_a_positive_number_is_refused_before_submitting(capsys, timeout):
    with serving(AnotherJsonApi) as url, pytest.raises(SystemExit) as refused:
        cli.main(["--url", url, "--api-key", "k", "submit", "--wait", "--timeout", timeout, "hello"])
    assert refused.value.code == 2 and "--timeout" in capsys.readouterr().err


def test_a_poll_that_never_answers_is_given_up_at_the_timeout_not_after_the_request_s(scripted, capsys):
    url, api = scripted
    api.polls = ["hang"]
    started = time.monotonic()
    assert cli.main(["--url", url, "--api-key", "k", "submit", "--wait", "--timeout", "1", "hello"]) == 4
    assert time.monotonic() - started < 10, "waited out the 30 s request timeout"
    assert "t1" in capsys.readouterr().err


ACCEPTED = (202, {"task_id": "t1", "status": "queued"})


@pytest.mark.parametrize("blip", ["drop", (503, {"error": {"code": "dependency_unavailable", "message": "down"}},
                                           {"Retry-After": "0"})])
def test_a_submit_without_an_answer_is_sent_again_under_the_same_idempotency_key(scripted, capsys, blip):
    # The first may have been taken before its answer was lost: the key makes
    # the API create the task once, whichever try it saw.
    url, api = scripted
    api.posts = [blip, ACCEPTED]
    assert cli.main(["--url", url, "--api-key", "k", "submit", "hello"]) == 0
    assert json.loads(capsys.readouterr().out)["task_id"] == "t1"
    assert len(api.post_keys) == 2 and api.post_keys[0] and api.post_keys[0] == api.post_keys[1]


def test_a_submit_never_answered_names_the_key_to_send_it_again_with(scripted, capsys):
    url, api = scripted
    api.posts = ["drop"]
    assert cli.main(["--url", url, "--api-key", "k", "submit", "--idempotency-key", "job-42", "hello"]) == 1
    err = capsys.readouterr().err
    assert len(api.post_keys) == cli.SUBMIT_TRIES and set(api.post_keys) == {"job-42"}
    assert len(err.strip().splitlines()) == 1 and "--idempotency-key job-42" in err, err


def test_each_submit_has_a_key_of_its_own(scripted, capsys):
    url, api = scripted
    for _ in range(2):
        assert cli.main(["--url", url, "--api-key", "k", "submit", "hello"]) == 0
    assert len(set(api.post_keys)) == 2


@pytest.mark.parametrize("refusal, tries", [(503, cli.SUBMIT_TRIES), (429, cli.SUBMIT_TRIES), (500, 1)])
def test_a_submit_that_ends_refused_names_the_key_to_send_it_again_with(scripted, capsys, refusal, tries):
    url, api = scripted
    api.posts = [(refusal, {"error": {"code": "dependency_unavailable", "message": "down"}}, {"Retry-After": "0"})]
    assert cli.main(["--url", url, "--api-key", "k", "submit", "hello"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["error"]["code"] == "dependency_unavailable"  # the answer itself, as before
    assert len(api.post_keys) == tries and len(set(api.post_keys)) == 1
    assert len(err.strip().splitlines()) == 1 and f"--idempotency-key {api.post_keys[0]}" in err, err


def test_a_submit_interrupted_names_the_key_and_exits_130_without_a_traceback(monkeypatch, capsys):
    def interrupted(*_, **__):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_call", interrupted)
    assert cli.main(["--url", "http://127.0.0.1:9", "--api-key", "k", "submit", "--idempotency-key", "job-7",
                     "hello"]) == 130
    err = capsys.readouterr().err
    assert "--idempotency-key job-7" in err and "Traceback" not in err, err


@pytest.mark.parametrize("task_id", ["t1#frag", "t1?wait_s=20", "", "a b", "x" * 65, "../keys"])
@pytest.mark.parametrize("command", ["get", "cancel"])
def test_a_task_id_the_api_could_not_have_made_is_refused_before_any_request(scripted, capsys, command, task_id):
    # Put into the URL as it was, "t1#frag" named task t1 and "" drew a redirect.
    url, api = scripted
    with pytest.raises(SystemExit) as refused:
        cli.main(["--url", url, "--api-key", "k", command, task_id])
    assert refused.value.code == 2 and "a task id is" in capsys.readouterr().err
    assert api.gets == []


def test_a_key_that_is_not_latin_1_goes_out_as_utf_8_as_curl_sends_it(scripted, capsys):
    url, api = scripted
    assert cli.main(["--url", url, "--api-key", "k", "submit", "--idempotency-key", "ключ-1", "hello"]) == 0
    assert api.post_keys[0].encode("latin-1").decode() == "ключ-1"  # the server read the UTF-8 bytes
    with pytest.raises(SystemExit) as refused:
        cli.main(["--url", url, "submit", "--idempotency-key", "ключ" * 20, "hello"])  # 160 bytes
    assert refused.value.code == 2 and "bytes in UTF-8" in capsys.readouterr().err


def test_a_url_that_is_not_ascii_is_one_line_not_a_traceback(capsys):
    assert cli.main(["--url", "http://127.0.0.1:9/ü", "--api-key", "k", "get", "t1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "not ASCII" in err, err


@pytest.mark.parametrize("options, named", [
    (["--api-key", "sk_abc\r"], "--api-key"),  # read from a file saved with Windows line ends, say
    (["--api-key", "k", "--url", "http://[::1"], "http://[::1"),
])
def test_a_key_or_url_that_cannot_go_into_a_request_is_one_line_not_a_traceback(capsys, options, named):
    assert cli.main([*options, "get", "t1"]) == 1
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and named in err and "sk_abc" not in err, err


def test_an_idempotency_key_with_a_control_character_is_refused_before_any_request(scripted, capsys):
    url, api = scripted
    with pytest.raises(SystemExit) as refused:
        cli.main(["--url", url, "--api-key", "k", "submit", "--idempotency-key", "job\n42", "hello"])
    assert refused.value.code == 2 and "control character" in capsys.readouterr().err
    assert api.post_keys == []
