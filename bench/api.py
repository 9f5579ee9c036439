"""API overhead: POST /v1/tasks against the same DynamoDB put + SQS send done
directly with boto3 against the same emulators, at 1 and 32 concurrent clients.
No worker runs; the queue is purged between phases so both see the same depth."""

from __future__ import annotations

import json
import sys
import time

from bench.common import Http, closed_loop, log, save, sentence, settings, stack


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


def purge() -> None:
    from sluice.adapters.queues import PriorityQueues
    from sluice.contract import Priority

    q = PriorityQueues(settings())
    for p in Priority:
        q.sqs.purge_queue(QueueUrl=q.url(p))
    time.sleep(0.5)


def main(quick: bool = False, sqs: str = "localstack") -> dict:
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
        for clients, n in ((1, n1), (32, n32)):
            for name, make, fn in (("direct", lambda: None, direct), ("api", make_http, api_one)):
                purge()
                log(f"api: {name}, {clients} clients, {n} submits ({sqs} SQS)")
                r = closed_loop(n, clients, make, fn, timeout_s=150)
                results["phases"][f"{name}_{clients}"] = r.summary()
            d, a = results["phases"][f"direct_{clients}"], results["phases"][f"api_{clients}"]
            results[f"ratio_p50_{clients}"] = round(a["p50_ms"] / d["p50_ms"], 2)
            results[f"ratio_p99_{clients}"] = round(a["p99_ms"] / d["p99_ms"], 2)
            log(f"api: {clients} clients: API p50 {a['p50_ms']} ms p99 {a['p99_ms']} ms; "
                f"direct p50 {d['p50_ms']} ms p99 {d['p99_ms']} ms")
    save("api", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv, sqs="moto" if "--moto" in sys.argv else "localstack"),
                     indent=1))
