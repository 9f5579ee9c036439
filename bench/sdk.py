"""What one AWS call costs the caller's CPU: botocore's default client config
against Sluice's clients (`sluice.aws.new_client`: a fixed User-Agent, no
client-side parameter validation, and `Connection: keep-alive` asked for), for
the calls made once per task on the hot paths.

CPU time of this process, and of the emulator that answered (dynalite for
DynamoDB, LocalStack for SQS), per call, the two kinds of client taking turns
over several rounds; the median round is reported.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

from bench.common import cpu_s, log, save, sentence, settings, stack

ROUNDS = 5


def main(quick: bool = False) -> dict:
    import boto3
    from botocore.config import Config

    from sluice.adapters.queues import PriorityQueues
    from sluice.adapters.task_store import Change, TaskStore, to_item
    from sluice.api.service import TaskService
    from sluice.aws import client_config, new_client
    from sluice.contract import Priority, SubmitRequest, TaskStatus, new_task_id

    n = 100 if quick else 300
    results: dict = {"calls_per_round": n, "rounds": ROUNDS}
    with stack(workers=0, api=False) as s:
        results["dynamodb"] = s.ddb
        st = settings()
        service = TaskService(st)
        url = PriorityQueues(st).url(Priority.low)
        # The same timeouts and retries, with botocore's own User-Agent and validation.
        default_config = client_config(st).merge(Config(user_agent=None, parameter_validation=True))
        kinds = {
            "botocore_default": lambda service: boto3.session.Session().client(service, config=default_config),
            "sluice": lambda service: new_client(service, st),
        }
        ddb_server, sqs_server = s.procs["ddb" if s.ddb == "dynalite" else "emulator"].pid, s.procs["sqs"].pid
        result_json = json.dumps([[0.1234567] * 384])  # one embedding, as a worker writes it
        cpu: dict[str, dict[str, list[float]]] = {}
        server_cpu: dict[str, dict[str, list[float]]] = {}
        for r in range(ROUNDS):
            for name, make in kinds.items():
                ddb, sqs = make("dynamodb"), make("sqs")
                store = TaskStore(st, ddb=ddb)
                records = [service._build("bench", SubmitRequest(model="minilm-embed", inputs=[sentence(i)]),
                                          new_task_id())[0] for i in range(n + 10)]
                # call: (the emulator process that answers it, one call)
                calls = {
                    "put_item": (ddb_server, lambda i: ddb.put_item(TableName=store.table, Item=to_item(records[i]))),
                    "update_item_outcome": (ddb_server, lambda i: ddb.update_item(**Change(
                        records[i].task_id, {"status": TaskStatus.succeeded.value, "finished_at": 1, "result_json": result_json},
                        (TaskStatus.queued,)).update(store.table, store.result_ttl_s))),
                    "send_message_batch_10": (sqs_server, lambda i: sqs.send_message_batch(
                        QueueUrl=url, Entries=[{"Id": str(j), "MessageBody": "x" * 300} for j in range(10)])),
                }
                for call, (server, fn) in calls.items():
                    fn(n)  # the first call of a client builds its endpoint and connection
                    t0, s0 = time.process_time(), cpu_s(server)
                    for i in range(n):
                        fn(i)
                    cpu.setdefault(call, {}).setdefault(name, []).append((time.process_time() - t0) / n * 1000)
                    server_cpu.setdefault(call, {}).setdefault(name, []).append((cpu_s(server) - s0) / n * 1000)
                sqs.purge_queue(QueueUrl=url)
            log(f"sdk: round {r + 1} of {ROUNDS}")
        for call, by_config in cpu.items():
            medians = {name: round(statistics.median(v), 3) for name, v in by_config.items()}
            server = {name: round(statistics.median(v), 3) for name, v in server_cpu[call].items()}
            results[call] = {"cpu_ms_per_call": medians,
                             "ratio": round(medians["sluice"] / medians["botocore_default"], 2),
                             "server_cpu_ms_per_call": server,
                             "server_ratio": round(server["sluice"] / max(1e-9, server["botocore_default"]), 2)}
            log(f"sdk: {call}: client {medians} ratio {results[call]['ratio']}; "
                f"server {server} ratio {results[call]['server_ratio']}")
    save("sdk_cpu", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv), indent=1))
