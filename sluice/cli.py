"""`sluice`: operator and client commands.

Against the embedded profile (`make run`) it finds the emulator and the demo
key in .sluice/embedded.json, while the launcher that wrote it runs; elsewhere
it uses the standard AWS variables and SLUICE_URL / SLUICE_API_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from botocore.exceptions import BotoCoreError, ClientError

from sluice.settings import SettingsError

STATE_FILE = Path(os.environ.get("SLUICE_STATE_DIR", ".sluice")) / "embedded.json"


def _state() -> dict:
    """The running `make run`'s state. A file left by a launcher that was killed
    is ignored: its emulator is gone, and an operator meaning AWS would be sent there."""
    try:
        state = json.loads(STATE_FILE.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) and _alive(state.get("pid")) else {}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:  # 0 and below name process groups
        return False
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
    for k, v in env.items():
        os.environ.setdefault(k, v)
    if env:
        endpoints = ", ".join(v for k, v in sorted(env.items()) if k.startswith("AWS_ENDPOINT_URL"))
        print(f"sluice: using the `make run` emulator at {endpoints} ({STATE_FILE})", file=sys.stderr)


def _settings():
    from sluice.settings import Settings

    _use_embedded_endpoints()
    return Settings()


# -------------------------------------------------------------------- HTTP
def _http(method: str, path: str, body: dict | None = None, args=None) -> tuple[int, dict]:
    url = (getattr(args, "url", None) or os.environ.get("SLUICE_URL") or _state().get("url") or "http://127.0.0.1:8000")
    key = getattr(args, "api_key", None) or os.environ.get("SLUICE_API_KEY") or _state().get("api_key")
    request = urllib.request.Request(
        url.rstrip("/") + path,
        method=method,
        data=json.dumps(body).encode() if body is not None else None,
        headers={"content-type": "application/json", **({"x-api-key": key} if key else {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, _json(r.read())
    except urllib.error.HTTPError as err:
        return err.code, _json(err.read())
    except urllib.error.URLError as err:
        raise SystemExit(f"sluice: cannot reach {url}: {err.reason}") from None


def _json(raw: bytes) -> dict:
    """An answer that is not the API's JSON (a proxy's or gateway's page) is shown as it came."""
    try:
        return json.loads(raw or b"{}")
    except ValueError:
        return {"error": {"code": "not_json", "message": raw.decode("utf-8", "replace")[:2000]}}


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
    status, payload = _http("POST", "/v1/tasks", body, args)
    if status >= 400 or not args.wait:
        return _print(status, payload)
    task_id = payload["task_id"]
    deadline = time.monotonic() + args.timeout
    while (remaining := deadline - time.monotonic()) > 0:
        # Long poll: the API answers as soon as the task is final.
        wait_s = round(min(remaining, 20), 1)
        status, payload = _http("GET", f"/v1/tasks/{task_id}?wait_s={wait_s}", None, args)
        if status >= 400:
            return _print(status, payload)
        if payload.get("status") != "queued":
            _print(status, payload)
            # A script waiting on the task must tell a result from an outcome without one.
            return 0 if payload.get("status") == "succeeded" else 3
    print(f"task {task_id} still {payload.get('status')} after {args.timeout}s", file=sys.stderr)
    return 2


def cmd_get(args) -> int:
    return _print(*_http("GET", f"/v1/tasks/{args.task_id}", None, args))


def cmd_cancel(args) -> int:
    return _print(*_http("DELETE", f"/v1/tasks/{args.task_id}", None, args))


# -------------------------------------------------------------- operators
def cmd_keys_create(args) -> int:
    from sluice.adapters.api_keys import ApiKeys

    key, record = ApiKeys(_settings()).create(args.tenant)
    print(f"created key {record.key_id} for tenant {record.tenant_id}: {key}")
    return 0


def cmd_keys_revoke(args) -> int:
    from sluice.adapters.api_keys import ApiKeys

    settings = _settings()
    try:
        record = ApiKeys(settings).revoke(args.key)
    except LookupError as exc:
        print(f"sluice keys revoke: {exc}", file=sys.stderr)
        return 1
    print(f"revoked key {record.key_id} of tenant {record.tenant_id}; running APIs refuse it within "
          f"{settings.key_cache_s:g} s (their key cache, SLUICE_KEY_CACHE_S)")
    return 0


def cmd_bootstrap(_args) -> int:
    from sluice.bootstrap import ensure_resources

    print(json.dumps(ensure_resources(_settings()), indent=2))
    return 0


def cmd_dlq(args) -> int:
    from sluice.adapters.queues import PriorityQueues
    from sluice.contract import Priority
    from sluice.adapters.task_store import TaskStore
    from sluice.dlq import dead_count, list_dead, redrive, settle_dead

    settings = _settings()
    queues = PriorityQueues(settings)
    priorities = [Priority(args.priority)] if args.priority else list(Priority)
    if args.action == "list":
        found = list_dead(queues, priorities, limit=args.limit, store=TaskStore(settings))
        for item in found:
            print(json.dumps(item))
        if not found:
            print("the dead-letter queues are empty" if not args.priority
                  else f"the {args.priority} dead-letter queue is empty", file=sys.stderr)
        return 0
    if args.action == "settle":
        counts = settle_dead(queues, TaskStore(settings), priorities, settings.max_attempts, limit=args.limit)
        done = f"failed {counts['failed']} tasks, requeued {counts['requeued']} messages"
    else:
        done = f"redrove {redrive(queues, priorities, limit=args.limit)} messages"
    # What the round left (past --limit, or held hidden by a worker's settling
    # round meanwhile) tells the operator whether to run it again.
    where = f"the {args.priority} dead-letter queue still holds" if args.priority else "the dead-letter queues still hold"
    print(f"{done}; {where} about {dead_count(queues, priorities)} messages")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="sluice", description="Sluice client and operator commands.")
    parser.add_argument("--url", help="API base URL (default: SLUICE_URL, or the running `make run`)")
    parser.add_argument("--api-key", help="API key (default: SLUICE_API_KEY, or the demo key of `make run`)")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("submit", help="submit one task", epilog="exit status: 0 submitted, or with --wait succeeded; "
                       "1 the API answered an error; with --wait, 2 still queued after --timeout, 3 failed, "
                       "expired or cancelled")
    p.add_argument("inputs", nargs="+")
    p.add_argument("--model", default="minilm-embed")
    p.add_argument("--priority", default="normal", choices=["high", "normal", "low"])
    p.add_argument("--deadline", type=int, help="seconds")
    p.add_argument("--wait", action="store_true", help="poll until the task is final (exit status: below)")
    p.add_argument("--timeout", type=float, default=60, help="seconds --wait waits (default: 60)")
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("get", help="show a task")
    p.add_argument("task_id")
    p.set_defaults(func=cmd_get)

    p = sub.add_parser("cancel", help="cancel a queued task")
    p.add_argument("task_id")
    p.set_defaults(func=cmd_cancel)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("create", help="create a key; prints it as the last word")
    p.add_argument("--tenant", required=True)
    p.set_defaults(func=cmd_keys_create)
    p = keys.add_parser("revoke", help="revoke a key, given itself or its id (as `keys create` printed it)")
    p.add_argument("key", help="the key (sk_…) or its id")
    p.set_defaults(func=cmd_keys_revoke)

    p = sub.add_parser("bootstrap", help="create queues, tables and bucket if missing")
    p.set_defaults(func=cmd_bootstrap)

    p = sub.add_parser("dlq", help="list or redrive dead-letter messages, or settle their unfinished tasks")
    p.add_argument("action", choices=["list", "redrive", "settle"])
    p.add_argument("--priority", choices=["high", "normal", "low"])
    p.add_argument("--limit", type=int, default=100)
    p.set_defaults(func=cmd_dlq)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `sluice get … | head`: the reader left, which is no error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except SettingsError as exc:
        print(f"sluice: refused settings:\n{exc}", file=sys.stderr)
        return 1
    except (BotoCoreError, ClientError) as exc:
        # A wrong prefix, table, region or credentials: one line with what was used, not a traceback.
        command = " ".join(filter(None, (args.command, getattr(args, "keys_command", None), getattr(args, "action", None))))
        error = str(exc) if isinstance(exc, ClientError) else f"{type(exc).__name__}: {exc}"
        print(f"sluice {command}: {error} ({_aws_context()})", file=sys.stderr)
        return 1


def _aws_context() -> str:
    from sluice.aws import client_config
    from sluice.settings import Settings

    settings = Settings()
    endpoint = os.environ.get("AWS_ENDPOINT_URL")
    return (f"queue prefix {settings.queue_prefix}, tasks table {settings.tasks_table}, keys table "
            f"{settings.keys_table}, region {client_config(settings).region_name}"
            + (f", endpoint {endpoint}" if endpoint else ""))


if __name__ == "__main__":
    sys.exit(main())
