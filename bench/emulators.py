"""What one AWS call costs on each emulator: the floor under every other figure.

Runs each call Sluice makes on its hot path, sequentially (latency) and from 16
threads (throughput), against moto and, where `make install` built them,
against dynalite's DynamoDB and LocalStack's and fauxqs's SQS.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from bench.common import lat_summary, log, reset_clients, save, settings, stack
from onprem.embedded import DYNALITE, FAUXQS_MODULES, LOCALSTACK_PYTHON


def _measure(fn, n: int, threads: int) -> dict:
    lat: list[float] = []

    def one(i):
        t0 = time.perf_counter()
        fn(i)
        lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    if threads == 1:
        for i in range(n):
            one(i)
    else:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(n)))
    return {**lat_summary(lat), "calls_per_s": round(n / (time.perf_counter() - t0), 1)}


def run_sqs(n: int) -> dict:
    from sluice.aws import client

    s = settings()
    sqs = client("sqs", s)
    url = sqs.create_queue(QueueName=f"bench-{uuid.uuid4().hex[:6]}")["QueueUrl"]
    out = {}
    # Depth grows during the send runs, as it does in a real backlog.
    out["send_message"] = _measure(lambda i: sqs.send_message(QueueUrl=url, MessageBody="x" * 300), n, 1)
    out["send_message_16_threads"] = _measure(lambda i: sqs.send_message(QueueUrl=url, MessageBody="x" * 300), n, 16)
    out["send_message_batch_10"] = _measure(
        lambda i: sqs.send_message_batch(QueueUrl=url, Entries=[{"Id": str(j), "MessageBody": "x" * 300} for j in range(10)]),
        n // 10, 1)

    def drain(_):
        msgs = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=0).get("Messages", [])
        if msgs:
            sqs.delete_message_batch(QueueUrl=url, Entries=[{"Id": str(j), "ReceiptHandle": m["ReceiptHandle"]}
                                                            for j, m in enumerate(msgs)])
    out["receive_10_plus_delete_batch"] = _measure(drain, n // 10, 1)
    out["depth_at_end"] = int(sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages"])
                              ["Attributes"]["ApproximateNumberOfMessages"])
    sqs.delete_queue(QueueUrl=url)
    return out


def run_ddb(n: int) -> dict:
    from sluice.aws import client

    s = settings()
    ddb = client("dynamodb", s)
    table = s.tasks_table
    ids = [uuid.uuid4().hex for _ in range(n)]
    item = lambda t: {"task_id": {"S": t}, "status": {"S": "queued"}, "tenant_id": {"S": "b"},  # noqa: E731
                      "created_at": {"N": "1"}, "model": {"S": "minilm-embed"}}
    out = {}
    out["put_item_conditional"] = _measure(
        lambda i: ddb.put_item(TableName=table, Item=item(ids[i]), ConditionExpression="attribute_not_exists(task_id)"),
        n, 1)
    out["get_item"] = _measure(lambda i: ddb.get_item(TableName=table, Key={"task_id": {"S": ids[i]}},
                                                      ConsistentRead=True), n, 1)
    out["get_item_16_threads"] = _measure(lambda i: ddb.get_item(TableName=table, Key={"task_id": {"S": ids[i]}},
                                                                 ConsistentRead=True), n, 16)
    upd = lambda i: ddb.update_item(  # noqa: E731
        TableName=table, Key={"task_id": {"S": ids[i]}}, UpdateExpression="SET #s = :r ADD attempts :one",
        ConditionExpression="#s IN (:q, :r)", ExpressionAttributeNames={"#s": "status"},
        ExpressionAttributeValues={":q": {"S": "queued"}, ":r": {"S": "queued"}, ":one": {"N": "1"}})
    out["update_item_conditional"] = _measure(upd, n, 1)
    out["update_item_conditional_16_threads"] = _measure(upd, n, 16)
    out["batch_get_item_32"] = _measure(
        lambda i: ddb.batch_get_item(RequestItems={table: {"Keys": [{"task_id": {"S": t}} for t in ids[:32]],
                                                           "ConsistentRead": True}}), n // 10, 1)
    out["batch_write_item_25"] = _measure(
        lambda i: ddb.batch_write_item(RequestItems={table: [{"PutRequest": {"Item": item(uuid.uuid4().hex)}}
                                                             for _ in range(25)]}), n // 10, 1)
    return out


def main(quick: bool = False) -> dict:
    n = 100 if quick else 300
    results = {}
    log("emulators: moto (SQS, DynamoDB)")
    with stack(workers=0, api=False, sqs="moto", ddb="moto"):
        reset_clients()
        results["moto"] = {"sqs": run_sqs(n), "dynamodb": run_ddb(n)}
    if DYNALITE.exists():
        log("emulators: dynalite (DynamoDB)")
        with stack(workers=0, api=False, sqs="moto", ddb="dynalite"):
            reset_clients()
            results["dynalite"] = {"dynamodb": run_ddb(n)}
    if LOCALSTACK_PYTHON.exists():
        log("emulators: LocalStack (SQS)")
        with stack(workers=0, api=False, sqs="localstack"):
            reset_clients()
            results["localstack"] = {"sqs": run_sqs(n)}
    if FAUXQS_MODULES.exists():
        log("emulators: fauxqs (SQS)")
        with stack(workers=0, api=False, sqs="fauxqs"):
            reset_clients()
            results["fauxqs"] = {"sqs": run_sqs(n)}
    reset_clients()
    save("emulators", {"n": n, "results": results})
    return results


if __name__ == "__main__":
    import json

    print(json.dumps(main(), indent=1))
