"""API overhead: POST /v1/tasks against the same DynamoDB put + SQS send done
directly with boto3 against the same emulators, at 1 and 32 concurrent clients.
No worker runs. The two paths take turns (every other submit at 1 client,
alternating rounds at 32), so both see the same machine load and queue depth."""

from __future__ import annotations

import json
import sys
import time

from bench.common import (Http, LoadResult, at_most, closed_loop, default_sqs, flag, log, pct, raise_if_flagged, save, sentence,
                          settings, stack)


def direct_submitter():
    """What the API does per submit, minus HTTP, auth and validation."""
    from sluice.adapters.queues import PriorityQueues
    from sluice.adapters.task_store import TaskStore
    from sluice.api.service import TaskService
    from sluice.contract import SubmitRequest, new_task_id

    s = settings()
    service = TaskService(s)
    store, queues = TaskStore(s), PriorityQueues(s)

    def one(_client, i):
        record, message = service._build("bench", SubmitRequest(model="minilm-embed", inputs=[sentence(i)]),
                                          new_task_id())
        store.create(record)
        queues.send(message)

    return one


def alternate(n: int, direct, api_one, client, pooled: dict, timeout_s: float = 150) -> None:
    """One client: submit i goes direct, then the same through the API, n times
    (or until timeout_s, which counts as an error of both paths)."""
    deadline = time.monotonic() + timeout_s
    for i in range(n):
        if time.monotonic() >= deadline:
            for name in ("direct", "api"):
                pooled[name].errors.append(f"timed out after {timeout_s}s, {i} of {n} turns done")
            return
        for name, fn in (("direct", direct), ("api", api_one)):
            t0 = time.perf_counter()
            try:
                fn(client, 2 * i + (name == "api"))
            except Exception as exc:  # counted, never fatal to the run
                pooled[name].errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            pooled[name].latencies.append(time.perf_counter() - t0)
            pooled[name].ended += time.perf_counter() - t0


def summarize(results: dict, pooled: dict[str, LoadResult], clients: int, asked: int) -> None:
    """Each path's figures and the ratios, into results; a path that did not
    complete every submit it was asked for is flagged (the figures of the
    submits that succeeded alone would hide the rest)."""
    for name, result in pooled.items():
        results["phases"][f"{name}_{clients}"] = result.summary()
        if result.errors or len(result.latencies) < asked:
            flag(results, f"{name}, {clients} client(s): {len(result.latencies)} of {asked} submits "
                          f"succeeded; {len(result.errors)} error(s), e.g. {result.errors[:2]}")
    # From the percentiles as measured (the phases' are rounded to 0.01 ms),
    # to four places rounded up: the report judges them against 1.25, which a
    # ratio rounded to nearest (7.50496 / 6.00004 = 1.25082 -> 7.5 / 6.0 = 1.25)
    # would pass.
    direct, api_ = pooled["direct"].latencies, pooled["api"].latencies
    for q in (50, 99):
        ratio = at_most(pct(api_, q), pct(direct, q)) if direct and api_ else None
        results[f"ratio_p{q}_{clients}"] = float("nan") if ratio is None else ratio


def purge() -> None:
    from sluice.adapters.queues import PriorityQueues
    from sluice.contract import Priority

    q = PriorityQueues(settings())
    for p in Priority:
        q.sqs.purge_queue(QueueUrl=q.url(p))
    time.sleep(0.5)


def main(quick: bool = False, sqs: str | None = None) -> dict:
    sqs = sqs or default_sqs()
    n1, n32 = (100, 320) if quick else (300, 960)
    results: dict = {"sqs": sqs, "phases": {}}
    with stack(workers=0, api=True, sqs=sqs) as s:
        results["dynamodb"] = s.ddb
        key = s.create_key("bench")
        direct = direct_submitter()

        def api_one(client, i):
            status, body = client.call("POST", "/v1/tasks", {"model": "minilm-embed", "inputs": [sentence(i)]})
            if status != 202:
                raise RuntimeError(f"{status} {body}")

        make_http = lambda: Http(s.url, {"x-api-key": key})  # noqa: E731
        # Warm both paths (connections, key cache, queue URL cache) before measuring.
        closed_loop(20, 4, make_http, api_one, 30)
        closed_loop(20, 4, lambda: None, direct, 30)
        # The machine is shared and its load drifts, so the two paths take turns
        # rather than running one after the other: at 1 client every other
        # submit is direct; at 32 clients they alternate in rounds.
        paths = {"direct": (lambda: None, direct), "api": (make_http, api_one)}
        for clients, n, rounds in ((1, n1, 1), (32, n32, 4)):
            # Pooled over the turns; `ended` sums each path's own time (its
            # `started` stays 0), so per_s is that path's rate while it ran.
            pooled = {name: LoadResult() for name in paths}
            for r in range(rounds):
                purge()
                if clients == 1:
                    log(f"api: direct and api alternating, 1 client, {n} submits each ({sqs} SQS)")
                    alternate(n, paths["direct"][1], paths["api"][1], make_http(), pooled)
                    continue
                for name, (make, fn) in paths.items():
                    log(f"api: {name}, {clients} clients, {n // rounds} submits, round {r + 1} of {rounds} ({sqs} SQS)")
                    part = closed_loop(n // rounds, clients, make, fn, timeout_s=150)
                    pooled[name].latencies += part.latencies
                    pooled[name].errors += part.errors
                    pooled[name].ended += part.seconds
            summarize(results, pooled, clients, asked=n if clients == 1 else n // rounds * rounds)
            d, a = results["phases"][f"direct_{clients}"], results["phases"][f"api_{clients}"]
            log(f"api: {clients} clients: API p50 {a['p50_ms']} ms p99 {a['p99_ms']} ms; "
                f"direct p50 {d['p50_ms']} ms p99 {d['p99_ms']} ms")
    save("api", results)
    raise_if_flagged("api", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv, sqs="moto" if "--moto" in sys.argv else None),
                     indent=1))
