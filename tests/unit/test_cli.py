"""The CLI against a local HTTP server standing where the API would be, and
its operator commands' errors against the emulator."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from http.server import BaseHTTPRequestHandler

import pytest

from onprem.embedded import free_port
from sluice import cli
from tests.http_stub import serving
from tests.reliability.harness import wait_until


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
    with serving(Gateway) as url:
        yield url


def test_an_answer_that_is_not_json_is_shown_not_a_traceback(gateway, capsys):
    Gateway.bodies.clear()
    code = cli.main(["--url", gateway, "--api-key", "k", "submit", "hello", "--deadline", "0"])
    assert code == 1
    shown = json.loads(capsys.readouterr().out)
    assert shown["error"]["code"] == "not_json" and "502 Bad Gateway" in shown["error"]["message"]
    # A deadline of 0 is sent, for the API to say why it is refused, not silently dropped.
    assert Gateway.bodies[-1]["deadline_s"] == 0


def test_an_unreachable_api_is_one_line_naming_it(capsys):
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["--url", url, "--api-key", "k", "get", "t1"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"sluice: cannot reach {url}") and len(err.strip().splitlines()) == 1, err


class Api(BaseHTTPRequestHandler):
    """Accepts a task and shows it `final` when polled."""

    final = "succeeded"

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.answer(202, {"task_id": "t1", "status": "queued"})

    def do_GET(self):
        self.answer(200, {"task_id": "t1", "status": self.final})

    def answer(self, code: int, body: dict):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    with serving(Api) as url:
        yield url


@pytest.mark.parametrize("final, code", [("succeeded", 0), ("failed", 3), ("expired", 3), ("cancelled", 3)])
def test_submit_wait_exits_0_only_for_a_result(api, final, code, monkeypatch, capsys):
    monkeypatch.setattr(Api, "final", final)
    assert cli.main(["--url", api, "--api-key", "k", "submit", "--wait", "hello"]) == code
    assert json.loads(capsys.readouterr().out)["status"] == final


def test_submit_wait_waits_through_a_status_it_does_not_know(api, monkeypatch, capsys):
    # A newer API's non-final status (say `running`) used to end the wait, exit 3.
    seen = iter(["running", "running", "succeeded"])
    monkeypatch.setattr(Api, "do_GET", lambda self: self.answer(200, {"task_id": "t1", "status": next(seen)}))
    assert cli.main(["--url", api, "--api-key", "k", "submit", "--wait", "hello"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "succeeded"


def test_submit_wait_does_not_spin_on_a_status_the_api_answers_at_once(api, monkeypatch, capsys):
    # A newer API's final status it does not know (say `rejected`) comes back at
    # once from the long poll: it used to be asked again in a tight loop, 639 GETs a second.
    gets = []
    monkeypatch.setattr(Api, "do_GET", lambda self: gets.append(1) or self.answer(200, {"task_id": "t1",
                                                                                         "status": "rejected"}))
    assert cli.main(["--url", api, "--api-key", "k", "submit", "--wait", "--timeout", "2", "hello"]) == 2
    assert len(gets) <= 3, len(gets)
    assert "still rejected" in capsys.readouterr().err


@pytest.fixture
def embedded_state(tmp_path, monkeypatch):
    """Writes a `make run` state file naming `pid`; no endpoint set, the operator's own credentials.
    What applying the state sets is removed after the test."""
    # setenv first: monkeypatch restores only what it changed, and applying the
    # state sets these whether or not they were set before.
    for name in {k for k in os.environ if k.startswith("AWS_")} | {"AWS_ENDPOINT_URL", "AWS_REGION", "AWS_PROFILE",
                                                                   "AWS_DEFAULT_REGION", "AWS_SESSION_TOKEN"}:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAOPERATOR")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "operator")
    path = tmp_path / "embedded.json"
    monkeypatch.setattr(cli, "STATE_FILE", path)

    def write(pid: int):
        path.write_text(json.dumps({"url": "http://127.0.0.1:9", "api_key": "sk_demo", "pid": pid, "env": {
            "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "embedded", "AWS_SECRET_ACCESS_KEY": "embedded",
            "AWS_REGION": "us-east-1"}}))

    return write


def test_a_state_file_left_by_a_killed_launcher_is_ignored(embedded_state, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(30)  # reaped: its pid names no process
    embedded_state(gone.pid)
    cli._settings()
    assert "AWS_ENDPOINT_URL" not in os.environ and os.environ["AWS_ACCESS_KEY_ID"] == "AKIAOPERATOR"
    assert cli._state() == {}  # nor its API URL or demo key
    assert capsys.readouterr().err == ""


@pytest.fixture
def launcher():
    """A process whose command line is a `make run` launcher's (`python -m onprem.embedded`)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "-m", "onprem.embedded"],
                            stdin=subprocess.PIPE)
    cmdline = Path(f"/proc/{proc.pid}/cmdline")
    if cmdline.parent.exists():  # the kernel shows the command line a moment after exec
        wait_until(lambda: cmdline.read_bytes(), 10, "the process's command line in /proc")
    yield proc
    proc.stdin.close()
    proc.wait(10)


def test_the_running_launchers_state_is_used_and_named(embedded_state, launcher, capsys):
    embedded_state(launcher.pid)
    cli._settings()
    assert os.environ["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9"
    assert "http://127.0.0.1:9" in capsys.readouterr().err  # the operator sees where commands go


@pytest.mark.skipif(not os.path.exists("/proc/self/cmdline"), reason="tells a launcher by its /proc command line")
def test_a_state_file_whose_pid_now_names_another_process_is_ignored(embedded_state, capsys):
    # A launcher killed long ago: its pid may be reused by any process.
    embedded_state(os.getpid())
    cli._settings()
    assert "AWS_ENDPOINT_URL" not in os.environ and capsys.readouterr().err == ""


def test_the_launchers_region_and_keys_win_over_the_operators(embedded_state, launcher, monkeypatch):
    # The emulator's queues exist in its region only; an exported AWS_REGION or profile is for AWS.
    monkeypatch.setenv("AWS_REGION", "eu-west-1")
    monkeypatch.setenv("AWS_PROFILE", "production")
    monkeypatch.setenv("AWS_DEFAULT_PROFILE", "production")  # the older name boto3 still reads
    embedded_state(launcher.pid)
    cli._settings()
    assert os.environ["AWS_REGION"] == "us-east-1" and os.environ["AWS_ACCESS_KEY_ID"] == "embedded"
    assert "AWS_PROFILE" not in os.environ and "AWS_DEFAULT_PROFILE" not in os.environ


@pytest.mark.parametrize("command, env, named", [
    (["dlq", "list"], {"SLUICE_QUEUE_PREFIX": "no-such-prefix"}, "queue prefix no-such-prefix"),
    (["keys", "create", "--tenant", "a"], {"SLUICE_KEYS_TABLE": "no-such-keys"}, "keys table no-such-keys"),
])
def test_an_aws_error_is_one_line_naming_what_was_used(settings, monkeypatch, capsys, command, env, named):
    monkeypatch.setenv("SLUICE_TASKS_TABLE", settings.tasks_table)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(command) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"sluice {command[0]} {command[1]}: ") and named in err and "region us-east-1" in err, err


def test_a_key_is_revoked_by_the_id_create_printed_or_by_itself(settings, monkeypatch, capsys):
    # An operator seldom holds a tenant's secret: `keys create` prints the id too.
    from sluice.adapters.api_keys import ApiKeys

    monkeypatch.setenv("SLUICE_KEYS_TABLE", settings.keys_table)
    # This shell's cache setting says nothing of the APIs': the message must not quote it as theirs.
    monkeypatch.setenv("SLUICE_KEY_CACHE_S", "99")
    assert cli.main(["keys", "create", "--tenant", "team-c"]) == 0
    created = capsys.readouterr().out.split()
    key_id, key = created[2], created[-1]
    keys = ApiKeys(settings)
    assert keys.authenticate(key).tenant_id == "team-c"
    assert cli.main(["keys", "revoke", key_id]) == 0
    out = capsys.readouterr().out
    # (Not counting the key's random hex id, which may hold a "99" of its own.)
    assert f"revoked key {key_id} of tenant team-c" in out and "99" not in out.replace(key_id, "")
    assert "(their SLUICE_KEY_CACHE_S, 10 s by default)" in out
    assert keys.authenticate(key) is None
    other, _ = keys.create("team-d")
    assert cli.main(["keys", "revoke", other]) == 0 and keys.authenticate(other) is None


@pytest.mark.parametrize("unknown", ["0123456789abcdef", "sk_not-a-key"])
def test_revoking_an_unknown_key_is_one_line_and_exit_1(settings, monkeypatch, capsys, unknown):
    monkeypatch.setenv("SLUICE_KEYS_TABLE", settings.keys_table)
    assert cli.main(["keys", "revoke", unknown]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sluice keys revoke: no ") and len(err.strip().splitlines()) == 1, err


def test_an_aws_endpoint_without_its_scheme_is_one_line_naming_it(monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "localhost:4566")
    assert cli.main(["keys", "create", "--tenant", "team-e"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("sluice keys create: ") and len(err.strip().splitlines()) == 1, err
    assert "AWS_ENDPOINT_URL localhost:4566" in err


@pytest.mark.parametrize("command", [["keys", "create", "--tenant", "team-f"], ["bootstrap"], ["dlq", "list"]])
def test_the_api_s_url_and_key_given_to_an_aws_command_are_refused_not_ignored(capsys, command):
    # Ignored, they left an operator thinking the command reached that API's deployment.
    with pytest.raises(SystemExit) as refused:
        cli.main(["--url", "https://sluice.example.com", *command])
    err = capsys.readouterr().err
    assert refused.value.code == 2 and "--url and --api-key are for submit, get and cancel" in err, err


def test_a_result_prints_each_embedding_on_one_line():
    payload = {"status": "succeeded", "result": {"embeddings": [[0.1, -0.2, 3], [0.5]], "dim": 384},
               "error": None, "metadata": {}, "flags": [True, False]}
    text = cli._shown(payload)
    assert json.loads(text) == payload
    assert "      [0.1, -0.2, 3]," in text.splitlines()


def test_listing_empty_dead_letter_queues_says_so(settings, monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_QUEUE_PREFIX", settings.queue_prefix)
    monkeypatch.setenv("SLUICE_TASKS_TABLE", settings.tasks_table)
    assert cli.main(["dlq", "list"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "the dead-letter queues are empty" in captured.err


def test_a_reader_that_leaves_early_is_no_error(monkeypatch):
    # `sluice get … | head`: the pipe closes under the print.
    def closed_pipe(_args):
        raise BrokenPipeError

    monkeypatch.setattr(cli, "cmd_get", closed_pipe)
    monkeypatch.setattr(os, "dup2", lambda *_: None)  # leave pytest's stdout alone
    assert cli.main(["get", "t"]) == 0



@pytest.mark.parametrize("tenant", ["", " ", "team a", "team-a ", " team-a", "a/b", "-a", ".a", "team\n", "x" * 65])
def test_a_tenant_outside_the_pattern_is_refused_before_any_key_is_made(monkeypatch, capsys, tenant):
    # An unset $TEAM in a script (`--tenant "$TEAM"`) must not make keys sharing the empty tenant.
    monkeypatch.setattr(cli, "cmd_keys_create", lambda _args: pytest.fail("a key was created"))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["keys", "create", f"--tenant={tenant}"])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "argument --tenant: tenant " in err and "must be 1-64 letters, digits, '_', '.' or '-'" in err, err


def test_the_key_store_refuses_such_a_tenant_too(settings):
    from sluice.adapters.api_keys import ApiKeys
    from sluice.aws import client

    for tenant in ["", "team a", "a/b", "team-a "]:
        with pytest.raises(ValueError, match="must be 1-64 letters"):
            ApiKeys(settings).create(tenant)
    assert client("dynamodb", settings).scan(TableName=settings.keys_table)["Count"] == 0
    assert ApiKeys(settings).create("team_a.v2-" + "x" * 54)[1].tenant_id.startswith("team_a.v2-")  # 64: the most


def test_a_missing_aws_profile_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    # No region set anywhere: the handler itself must not read the missing profile again.
    from sluice import aws

    for name in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setattr(cli, "STATE_FILE", tmp_path / "embedded.json")
    monkeypatch.setattr(aws, "_clients", {})
    assert cli.main(["dlq", "list"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith("sluice dlq list: AWS_PROFILE names no profile") and "no-such-profile" in err, err
    assert "region us-east-1" in err, err


def test_the_state_of_make_run_is_found_from_a_folder_below_the_repository(tmp_path, monkeypatch):
    # make run keeps .sluice/ at the repository's root; a CLI run from sluice/ or
    # tests/ that missed it would send `keys create` or `dlq redrive` to AWS.
    monkeypatch.delenv("SLUICE_STATE_DIR", raising=False)
    monkeypatch.setattr(cli, "_alive", lambda pid: pid == 4242)  # a running launcher's
    (tmp_path / ".sluice").mkdir()
    (tmp_path / ".sluice" / "embedded.json").write_text(json.dumps({"url": "http://127.0.0.1:9", "pid": 4242}))
    below = tmp_path / "sluice" / "api"
    below.mkdir(parents=True)
    monkeypatch.chdir(below)
    assert cli._state()["url"] == "http://127.0.0.1:9"
    monkeypatch.setenv("SLUICE_STATE_DIR", str(tmp_path / "elsewhere"))  # named: only there
    assert cli._state() == {}
