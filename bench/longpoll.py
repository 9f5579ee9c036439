"""Plain polling against the long poll, one run: 600 one-sentence requests,
64 clients, 1 worker x 2 threads, SQS and DynamoDB on what `make run` uses
(onprem.embedded.default_sqs() and default_ddb(); SLUICE_EMBEDDED_SQS and
SLUICE_EMBEDDED_DDB choose others). The emulators used are printed.
`.venv/bin/python -m bench.longpoll`"""

from bench.common import default_ddb, default_sqs, log
from bench.e2e import sluice


def main() -> dict:
    out = {"sqs": default_sqs(), "dynamodb": default_ddb()}
    log(f"longpoll: {out['sqs']} SQS, {out['dynamodb']} DynamoDB")
    for name, poll in (("poll every 100 ms", 0.1), ("long poll", None)):
        r = sluice(600, 64, 1, 2, out["sqs"], poll_s=poll)
        out[name] = {k: r[k] for k in ("per_s", "p50_ms", "p99_ms", "completed", "errors")}
        log(f"longpoll: {name}: {out[name]}")
    return out


if __name__ == "__main__":
    main()
