"""What one AWS call costs the caller's CPU: botocore's default client config
against Sluice's (`sluice.aws.client_config`: a fixed User-Agent, no client-side
parameter validation), for the calls made once per task on the hot paths.

CPU time of this process only (the emulators run in their own), per call, the
configs taking turns over several rounds; the median round is reported.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from bench.common import log, save, sentence, settings, stack

ROUNDS = 5


def main(quick: bool = False) -> dict:
    import boto3
    from botocore.config import Config

    from sluice.adapters.queues import PriorityQueues
    from sluice.adapters.task_store import Change, TaskStore, to_item
    from sluice.api.service import TaskService
    from sluice.aws import client_config
    from sluice.contract import Priority, SubmitRequest, TaskStatus, new_task_id

    n = 100 if quick else 300
    results: dict = {"calls_per_round": n, "rounds": ROUNDS}
    with stack(workers=0, api=False, sqs="localstack") as s:
        results["dynamodb"] = s.ddb
        st = settings()
        service = TaskService(st)
        url = PriorityQueues(st).url(Priority.low)
        sluice_config = client_config(st)
        # The same timeouts and retries, with botocore's own User-Agent and validation.
        default_config = sluice_config.merge(Config(user_agent=None, parameter_validation=True))
        result_json = json.dumps([[0.1234567] * 384])  # one embedding, as a worker writes it
        cpu: dict[str, dict[str, list[float]]] = {}
        for r in range(ROUNDS):
            for name, config in (("botocore_default", default_config), ("sluice", sluice_config)):
                ddb = boto3.session.Session().client("dynamodb", config=config)
                sqs = boto3.session.Session().client("sqs", config=config)
                store = TaskStore(st, ddb=ddb)
                records = [service._build("bench", SubmitRequest(model="minilm-embed", inputs=[sentence(i)]),
                                          new_task_id())[0] for i in range(n + 10)]
                calls = {
                    "put_item": lambda i: ddb.put_item(TableName=store.table, Item=to_item(records[i])),
                    "update_item_outcome": lambda i: ddb.update_item(**Change(
                        records[i].task_id, {"status": TaskStatus.succeeded.value, "result_json": result_json},
                        (TaskStatus.queued,)).update(store.table)),
                    "send_message_batch_10": lambda i: sqs.send_message_batch(
                        QueueUrl=url, Entries=[{"Id": str(j), "MessageBody": "x" * 300} for j in range(10)]),
                }
                for call, fn in calls.items():
                    fn(n)  # the first call of a client builds its endpoint and connection
                    t0 = time.process_time()
                    for i in range(n):
                        fn(i)
                    cpu.setdefault(call, {}).setdefault(name, []).append((time.process_time() - t0) / n * 1000)
                sqs.purge_queue(QueueUrl=url)
            log(f"sdk: round {r + 1} of {ROUNDS}")
        for call, by_config in cpu.items():
            medians = {name: round(statistics.median(v), 3) for name, v in by_config.items()}
            results[call] = {"cpu_ms_per_call": medians,
                             "ratio": round(medians["sluice"] / medians["botocore_default"], 2)}
            log(f"sdk: {call}: {medians} ratio {results[call]['ratio']}")
    save("sdk_cpu", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv), indent=1))
