"""`sluice`: operator and client commands.

Against the embedded profile (`make run`) it finds the emulator and the demo
key in .sluice/embedded.json, while the launcher that wrote it runs; elsewhere
it uses the standard AWS variables and SLUICE_URL / SLUICE_API_KEY.
"""

from __future__ import annotations

import argparse
import email.utils
import http.client
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from email.message import Message
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError, ProfileNotFound

from sluice.contract import MAX_IDEMPOTENCY_KEY_CHARS, MAX_TASK_ID_CHARS, TASK_ID_PATTERN, TaskStatus
from sluice.settings import OPERATOR_AWS_SETTINGS, SettingsError

# None: SLUICE_STATE_DIR's, or the nearest .sluice/ from the current folder up
# (make run keeps it at the repository's root: a CLI run from sluice/ or tests/
# must find it, not fall through to the operator's AWS account).
STATE_FILE: Path | None = None


def _state_file() -> Path:
    if STATE_FILE is not None:
        return STATE_FILE
    if os.environ.get("SLUICE_STATE_DIR"):
        return Path(os.environ["SLUICE_STATE_DIR"]) / "embedded.json"
    here = Path.cwd()
    for folder in (here, *here.parents):
        if (folder / ".sluice" / "embedded.json").is_file():
            return folder / ".sluice" / "embedded.json"
    return Path(".sluice") / "embedded.json"


def _state() -> dict:
    """The running `make run`'s state. A file left by a launcher that was killed
    is ignored: its emulator is gone, and an operator meaning AWS would be sent there."""
    try:
        state = json.loads(_state_file().read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) and _alive(state.get("pid")) else {}


def _alive(pid) -> bool:
    """Whether `pid` is a running `make run` launcher (`python -m onprem.embedded`).
    Where /proc tells, by its command line: the pid of a launcher killed long ago
    may name another process by now."""
    if not isinstance(pid, int) or pid <= 0:  # 0 and below name process groups
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if cmdline:  # empty while a process execs, and for a zombie: then asked as below
            return b"onprem.embedded" in cmdline
    except FileNotFoundError:
        if Path("/proc/self").exists():  # /proc is there, the process is not
            return False
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except PermissionError:  # it exists, as another user's
        return True
    except OSError:
        return False
    return True


def _use_embedded_endpoints() -> None:
    """Point boto3 at the running embedded emulator unless endpoints are already
    set, and say so: the operator sees where the commands go."""
    if any(k.startswith("AWS_ENDPOINT_URL") for k in os.environ):
        return
    env = _state().get("env", {})
    if env:
        # All of it, the region and keys too: the emulator's resources exist in
        # its region only, and a profile of the operator's has no say here.
        os.environ.update(env)
        for name in OPERATOR_AWS_SETTINGS:
            os.environ.pop(name, None)
        endpoints = ", ".join(v for k, v in sorted(env.items()) if k.startswith("AWS_ENDPOINT_URL"))
        print(f"sluice: using the `make run` emulator at {endpoints} ({_state_file()})", file=sys.stderr)


def _settings():
    from sluice.settings import Settings

    _use_embedded_endpoints()
    return Settings()


# -------------------------------------------------------------------- HTTP
_TIMEOUT_S = 30  # above a long poll's 20 s


class ApiUnusable(Exception):
    """The API could not be asked: unreachable (`transient`: a poll may try again) or it redirected."""

    def __init__(self, message: str, transient: bool):
        super().__init__(message)
        self.transient = transient


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx is not followed: urllib would send x-api-key to whatever host it
    names, and turn a POST into a GET. It reaches _call as the 3xx it is."""

    def redirect_request(self, *_args):
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _base_url(args) -> str:
    return getattr(args, "url", None) or os.environ.get("SLUICE_URL") or _state().get("url") or "http://127.0.0.1:8000"


def _on_the_wire(value: str) -> str:
    """A header value as curl sends it, UTF-8, in what http.client writes as Latin-1:
    the API reads the same Idempotency-Key from both."""
    return value.encode().decode("latin-1")


def _call(method: str, path: str, body: dict | None = None, args=None,
          timeout_s: float | None = None, headers: dict[str, str] | None = None) -> tuple[int, dict, Message]:
    """`timeout_s`: how long to wait for the answer (_TIMEOUT_S by default)."""
    timeout_s = _TIMEOUT_S if timeout_s is None else timeout_s
    url = _base_url(args)
    key = getattr(args, "api_key", None) or os.environ.get("SLUICE_API_KEY") or _state().get("api_key")
    if key and _has_control_character(key):  # the value is a secret: named by where it came from, never shown
        raise ApiUnusable("sluice: the API key (--api-key, SLUICE_API_KEY or the make run state) has a control "
                          "character, a line end read with it from a file, say: no request can carry it",
                          transient=False)
    try:
        request = urllib.request.Request(
            url.rstrip("/") + path,
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={k: _on_the_wire(v) for k, v in {"content-type": "application/json",
                                                      **({"x-api-key": key} if key else {}), **(headers or {})}.items()},
        )
    except ValueError as err:  # urllib's parse of the URL: "Invalid IPv6 URL", say
        raise ApiUnusable(f"sluice: cannot use the URL {url}: {err}", transient=False) from None
    try:
        try:
            response = _OPENER.open(request, timeout=timeout_s)
        except urllib.error.HTTPError as err:  # an answer all the same
            response = err
        with response:
            status, raw, headers = response.status, response.read(), response.headers
    except urllib.error.URLError as err:
        raise ApiUnusable(f"sluice: cannot reach {url}: {err.reason}", transient=True) from None
    except UnicodeEncodeError:  # http.client sends a URL as ASCII
        raise ApiUnusable(f"sluice: cannot use the URL {url}: percent-encode what is not ASCII",
                          transient=False) from None
    # A connection dropped, reset or silent once the request was sent: urlopen raises these unwrapped.
    except (OSError, http.client.HTTPException) as err:
        reason = (f"no answer within {timeout_s:g} s" if isinstance(err, TimeoutError)
                  else f"{type(err).__name__}: {err}")
        raise ApiUnusable(f"sluice: cannot reach {url}: {reason}", transient=True) from None
    if 300 <= status < 400:
        target = urllib.parse.urljoin(request.full_url, headers.get("Location", ""))
        base = target.split("?")[0]
        route = path.split("?")[0]
        base = base[:-len(route)] if base.endswith(route) else base
        raise ApiUnusable(f"sluice: the API answered a redirect ({status}) to {target}; use --url {base}",
                          transient=False)
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        payload = None
    # Every route the CLI calls answers a task on success.
    if status < 300 and not (isinstance(payload, dict) and isinstance(payload.get("task_id"), str)):
        # Another service at the URL (a login proxy, a web page, another JSON
        # API): a success from it would read as a task submitted or found.
        shown = raw.decode("utf-8", "replace")[:200].replace("\n", " ")
        raise ApiUnusable(f"sluice: {url} answered {status} with a body that is not the Sluice API's JSON: {shown}",
                          transient=False)
    if payload is None:  # an error page (a proxy's, a gateway's): shown as it came
        payload = {"error": {"code": "not_json", "message": raw.decode("utf-8", "replace")[:2000]}}
    return status, payload, headers


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r}: must be more than 0 seconds")
    return value


def _http(method: str, path: str, body: dict | None = None, args=None) -> tuple[int, dict]:
    return _call(method, path, body, args)[:2]


def _print(status: int, payload: dict) -> int:
    print(_shown(payload))
    return 0 if status < 400 else 1


def _shown(payload) -> str:
    """Indented JSON, with each list of numbers (an embedding: 384 of them) on one line."""
    if isinstance(payload, list) and payload and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                     for x in payload):
        return json.dumps(payload)
    if isinstance(payload, dict) and payload:
        items = [f"  {json.dumps(k)}: {_shown(v).replace(chr(10), chr(10) + '  ')}" for k, v in payload.items()]
        return "{\n" + ",\n".join(items) + "\n}"
    if isinstance(payload, list) and payload:
        return "[\n" + ",\n".join("  " + _shown(v).replace("\n", "\n  ") for v in payload) + "\n]"
    return json.dumps(payload)


def cmd_submit(args) -> int:
    body = {"model": args.model, "inputs": args.inputs, "priority": args.priority}
    if args.deadline is not None:  # 0 too: the API says why it is refused
        body["deadline_s"] = args.deadline
    status, payload = _submit(body, args)
    if status >= 400 or not args.wait:
        return _print(status, payload)
    task_id = payload["task_id"]
    # Said at once: whatever happens to the polls, a script must not submit it again.
    print(f"sluice: submitted task {task_id}", file=sys.stderr)
    deadline = time.monotonic() + args.timeout
    trouble = None  # why the last poll told nothing, if it did not
    while (remaining := deadline - time.monotonic()) > 0:
        # Long poll: the API answers as soon as the task is final.
        wait_s = round(min(remaining, 20), 1)
        asked = time.monotonic()
        try:
            # Given up with the --timeout, give or take the answer's way back, not 30 s later.
            status, payload, headers = _call("GET", f"/v1/tasks/{task_id}?wait_s={wait_s}", None, args,
                                             timeout_s=min(_TIMEOUT_S, wait_s + 5))
        except ApiUnusable as exc:
            if not exc.transient:
                return _not_followed(task_id, str(exc).removeprefix("sluice: "))
            trouble, pause_s = str(exc).removeprefix("sluice: "), 1.0
        else:
            # Final ones only: a status a newer API adds is one to wait through, not an end.
            if status < 400 and payload.get("status") in _FINAL:
                _print(status, payload)
                # A script waiting on the task must tell a result from an outcome without one.
                return 0 if payload.get("status") == "succeeded" else 3
            if status < 400:
                trouble = None
                # A status of a newer API, which it may answer at once: not asked again in a tight loop.
                if payload.get("status") == "queued" or time.monotonic() - asked >= 1.0:
                    continue  # the long poll waited: at most one ask a second
                pause_s = 1.0
            else:
                trouble = f"the API answered {status}{_error_of(payload)}"
                if status != 429 and status < 500:  # 404, 403: asking again gets the same
                    return _not_followed(task_id, trouble)
                pause_s = _retry_after(headers)  # a DynamoDB blip (503), a rate limit (429)
        time.sleep(max(0.0, min(pause_s, deadline - time.monotonic())))
    if trouble:
        return _not_followed(task_id, f"{trouble} until --timeout {args.timeout:g} s")
    print(f"task {task_id} still {payload.get('status')} after {args.timeout}s", file=sys.stderr)
    return 2


_FINAL = frozenset(s.value for s in TaskStatus if s.is_terminal)


# A submit that got no answer, or a 503 or 429, is sent again this many times
# in all, under the same Idempotency-Key: the API then creates the task once.
SUBMIT_TRIES = 3


def _submit(body: dict, args) -> tuple[int, dict]:
    key = args.idempotency_key or uuid.uuid4().hex
    try:
        return _submit_under(key, body, args)
    except KeyboardInterrupt:
        print(f"sluice: interrupted; the task may have been created: send it again with --idempotency-key {key} "
              "to get it, never a second one", file=sys.stderr)
        raise


def _submit_under(key: str, body: dict, args) -> tuple[int, dict]:
    for attempt in range(1, SUBMIT_TRIES + 1):
        try:
            status, payload, headers = _call("POST", "/v1/tasks", body, args, headers={"Idempotency-Key": key})
        except ApiUnusable as exc:
            if not exc.transient:
                raise
            if attempt == SUBMIT_TRIES:
                # The request may have been taken before its answer was lost.
                raise ApiUnusable(f"{exc}; the task may have been created: send it again with "
                                  f"--idempotency-key {key} to get it, never a second one", transient=True) from None
            time.sleep(1.0)
            continue
        if status in (429, 503) and attempt < SUBMIT_TRIES:
            time.sleep(min(_retry_after(headers), 5.0))
            continue
        if status == 429 or status >= 500:
            # A 5xx may come after the task was queued (its answer lost on the
            # way back inside the API); the error body still goes to stdout.
            print(f"sluice: the API answered {status}; send it again with --idempotency-key {key} to get the "
                  "task if one was created, never a second one", file=sys.stderr)
        return status, payload
    raise AssertionError("unreachable")


def _not_followed(task_id: str, why: str) -> int:
    print(f"sluice submit: task {task_id} was submitted, but following it failed: {why}; do not submit it "
          f"again: `sluice get {task_id}` shows it", file=sys.stderr)
    return 4


def _error_of(payload: dict) -> str:
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return ""
    return f" {error.get('code')}: {' '.join(str(error.get('message', '')).split())[:200]}"


def _retry_after(headers: Message) -> float:
    """Seconds a 429 or 503 asks to wait (a number or an HTTP date); 1 without one, at least 0.25."""
    value = (headers.get("Retry-After") or "").strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError):
            seconds = 1.0
    return max(0.25, seconds)


def cmd_get(args) -> int:
    return _print(*_http("GET", f"/v1/tasks/{args.task_id}", None, args))


def cmd_cancel(args) -> int:
    return _print(*_http("DELETE", f"/v1/tasks/{args.task_id}", None, args))


# -------------------------------------------------------------- operators
def _tenant(value: str) -> str:
    from sluice.adapters.api_keys import check_tenant

    try:
        return check_tenant(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _task_id(value: str) -> str:
    # Checked before it goes into the URL: "t1#x" would name task t1, "t1?wait_s=20" add a query.
    if not (len(value) <= MAX_TASK_ID_CHARS and re.match(TASK_ID_PATTERN, value)):
        raise argparse.ArgumentTypeError(f"a task id is 1-{MAX_TASK_ID_CHARS} letters, digits, '_' or '-', "
                                         f"not {value!r}")
    return value


def _idempotency_key(value: str) -> str:
    if not 1 <= len(value.encode()) <= MAX_IDEMPOTENCY_KEY_CHARS:
        raise argparse.ArgumentTypeError(f"an Idempotency-Key is 1-{MAX_IDEMPOTENCY_KEY_CHARS} bytes in UTF-8")
    if _has_control_character(value):  # no HTTP header can carry one
        raise argparse.ArgumentTypeError("an Idempotency-Key has no control character (a line end, a tab)")
    return value


def _has_control_character(value: str) -> bool:
    return any(ord(c) < 32 or ord(c) == 127 for c in value)


def _at_least_1(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1, not {value!r}")
    return number


def cmd_keys_create(args) -> int:
    from sluice.adapters.api_keys import ApiKeys

    key, record = ApiKeys(_settings()).create(args.tenant)
    print(f"created key {record.key_id} for tenant {record.tenant_id}: {key}")
    return 0


def cmd_keys_revoke(args) -> int:
    from sluice.adapters.api_keys import ApiKeys
    from sluice.settings import Settings

    try:
        record = ApiKeys(_settings()).revoke(args.key)
    except LookupError as exc:
        print(f"sluice keys revoke: {exc}", file=sys.stderr)
        return 1
    # The APIs' cache time is their setting, not this shell's: only its default is known here.
    print(f"revoked key {record.key_id} of tenant {record.tenant_id}; running APIs refuse it once their cached "
          f"copy expires (their SLUICE_KEY_CACHE_S, {Settings.model_fields['key_cache_s'].default:g} s by default)")
    return 0


def cmd_bootstrap(args) -> int:
    from sluice.bootstrap import ensure_resources

    changes: list[str] = []
    print(json.dumps(ensure_resources(_settings(), apply=args.apply_settings, changes=changes), indent=2))
    for change in changes:
        print(f"sluice bootstrap: {'set' if args.apply_settings else 'differs, left as it is'}: {change}",
              file=sys.stderr)
    if changes and not args.apply_settings:
        print("sluice bootstrap: existing queues and bucket keep their settings; run it with this deployment's "
              "SLUICE_ settings and --apply-settings to set them", file=sys.stderr)
    return 0


def cmd_dlq(args) -> int:
    from sluice.adapters.queues import PriorityQueues
    from sluice.contract import Priority
    from sluice.adapters.task_store import TaskStore
    from sluice.dlq import dead_counts, list_dead, max_receive_count, redrive, settle_dead

    settings = _settings()
    queues = PriorityQueues(settings)
    priorities = [Priority(args.priority)] if args.priority else list(Priority)
    queues_named = f"the {args.priority} dead-letter queue" if args.priority else "the dead-letter queues"
    if args.action == "list":
        # One past --limit tells whether the list was cut (what is received is shown again).
        found = list_dead(queues, priorities, limit=args.limit + 1, store=TaskStore(settings))
        for item in found[:args.limit]:
            print(json.dumps(item))
        visible, hidden = dead_counts(queues, priorities)
        if not found and not visible + hidden:
            print(f"{queues_named} {'is' if args.priority else 'are'} empty", file=sys.stderr)
            return 0
        said = f"listed {min(len(found), args.limit)}"
        if len(found) > args.limit:
            said += f", stopped at --limit {args.limit}"
        said += f"; {queues_named} {'holds' if args.priority else 'hold'} about {visible + hidden} messages"
        if hidden:  # received by another reader: a worker's settling round (sluice.dlq)
            said += (f", {hidden} of them hidden by another reader (a worker's settling round): list again in "
                     "30 s; in a queue longer than a round reads (1000), settling keeps the dead letters of "
                     "finished tasks hidden in turns of 10 minutes")
        print(said, file=sys.stderr)
        return 0
    if args.action == "settle":
        # A task's runs are counted against what SQS dead-letters at: each main queue's maxReceiveCount.
        store, counts = TaskStore(settings), {"failed": 0, "requeued": 0}
        for priority in priorities:
            left = args.limit - counts["failed"] - counts["requeued"]
            if left < 1:
                break
            attempts = max_receive_count(queues, priority)
            if attempts is None:
                attempts = settings.max_attempts
                print(f"sluice dlq settle: the {priority.value} queue has no RedrivePolicy; counting "
                      f"SLUICE_MAX_ATTEMPTS={attempts} runs as its maxReceiveCount", file=sys.stderr)
            for k, v in settle_dead(queues, store, [priority], attempts, limit=left).items():
                counts[k] += v
        done = f"failed {counts['failed']} tasks, requeued {counts['requeued']} messages"
    else:
        done = f"redrove {redrive(queues, priorities, limit=args.limit)} messages"
    # What the round left (past --limit, or held hidden by a worker's settling
    # round meanwhile) tells the operator whether to run it again.
    where = f"the {args.priority} dead-letter queue still holds" if args.priority else "the dead-letter queues still hold"
    print(f"{done}; {where} about {sum(dead_counts(queues, priorities))} messages")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice client and operator commands.")
    parser.add_argument("--url", help="API base URL, for submit, get and cancel (default: SLUICE_URL, or the "
                                      "running `make run`); keys, bootstrap and dlq call AWS and refuse it")
    parser.add_argument("--api-key", help="API key, for submit, get and cancel (default: SLUICE_API_KEY, or the demo "
                                          "key of `make run`); keys, bootstrap and dlq refuse it")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="submit one task", epilog="exit status: 0 submitted, or with --wait succeeded; "
                       "1 the API refused it, could not be reached, or its URL or key cannot be used; 2 an argument refused "
                       "before anything was sent, or with --wait still queued after --timeout; with --wait, "
                       "3 failed, expired or cancelled, 4 submitted (its id on stderr) but the polls failed until "
                       "--timeout or were refused: do not submit it again")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--model", default="minilm-embed")
    p.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    p.add_argument("--deadline", type=int, help="seconds")
    p.add_argument("--wait", action="store_true", help="poll until the task is final (exit status: below)")
    p.add_argument("--timeout", type=_positive_seconds, default=60, help="seconds --wait waits (default: 60)")
    p.add_argument("--idempotency-key", type=_idempotency_key, help="the submit's Idempotency-Key, 1-128 bytes in UTF-8 without control characters "
                   "(default: a new one); the CLI resends "
                   "a submit that got no answer, a 503 or a 429 under it, up to 3 tries in all")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("get", help="show a task")
    p.add_argument("task_id", type=_task_id)
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("cancel", help="cancel a queued task")
    p.add_argument("task_id", type=_task_id)
    p.set_defaults(func=cmd_cancel)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", help="create a key; prints it as the last word")
    p.add_argument("--tenant", required=True, type=_tenant,
                   help="1-64 letters, digits, '_', '.' or '-', starting with a letter or digit")
    p.set_defaults(func=cmd_keys_create)
    p = keys.add_parser("revoke", help="revoke a key, given itself or its id (as `keys create` printed it)")
    p.add_argument("key", help="the key (sk_…, or one registered as given, such as make run's SLUICE_API_KEY) "
                                        "or its id")
    p.set_defaults(func=cmd_keys_revoke)

    p = sub.add_parser("bootstrap", help="create queues, tables and bucket if missing")
    p.add_argument("--apply-settings", action="store_true",
                   help="also give existing queues and bucket this shell's settings (visibility timeout, max "
                        "attempts, result expiry); without it their differences are only printed")
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser("dlq", help="list or redrive dead-letter messages, or settle their unfinished tasks")
    p.add_argument("action", choices=["list", "redrive", "settle"])
    p.add_argument("--priority", choices=["high", "normal", "low"])
    p.add_argument("--limit", type=_at_least_1, default=100,
                   help="at most this many messages in all priorities together: listed, redriven, or settled "
                        "(failed or requeued) (default: 100)")
    p.set_defaults(func=cmd_dlq)

    args = parser.parse_args(argv)
    if args.command in ("keys", "bootstrap", "dlq") and (args.url or args.api_key):
        parser.error("--url and --api-key are for submit, get and cancel; keys, bootstrap and dlq call AWS "
                     "directly (AWS_ENDPOINT_URL, AWS_REGION, SLUICE_QUEUE_PREFIX, or the running `make run`)")
    try:
        return args.func(args)
    except KeyboardInterrupt:  # what it means for a submit is on stderr already
        return 130
    except BrokenPipeError:  # `sluice get … | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except ApiUnusable as exc:
        print(exc, file=sys.stderr)
        return 1
    except SettingsError as exc:
        print(f"sluice: refused settings:\n{exc}", file=sys.stderr)
        return 1
    except (BotoCoreError, ClientError, ValueError) as exc:
        # A wrong prefix, table, region, credentials or endpoint: one line with what was used, not a traceback.
        if isinstance(exc, ValueError) and not str(exc).startswith("Invalid endpoint"):  # botocore's, for a URL
            raise
        command = " ".join(filter(None, (args.command, getattr(args, "keys_command", None), getattr(args, "action", None))))
        error = str(exc) if isinstance(exc, ClientError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, ProfileNotFound):
            named = "AWS_PROFILE" if os.environ.get("AWS_PROFILE") else "AWS_DEFAULT_PROFILE"
            error = f"{named} names no profile in the AWS config or credentials files: {exc}"
        print(f"sluice {command}: {error} ({_aws_context()})", file=sys.stderr)
        return 1


def _aws_context() -> str:
    from sluice.aws import client_config
    from sluice.settings import Settings

    settings = Settings()
    endpoints = ", ".join(f"{k} {v}" for k, v in sorted(os.environ.items()) if k.startswith("AWS_ENDPOINT_URL"))
    try:  # the profile's region, read again: the very error being reported may come from there
        region = client_config(settings).region_name
    except BotoCoreError:
        region = settings.region
    return (f"queue prefix {settings.queue_prefix}, tasks table {settings.tasks_table}, keys table "
            f"{settings.keys_table}, region {region}"
            + (f", {endpoints}" if endpoints else ""))


if __name__ == "__main__":
    sys.exit(main())
