"""The embedded emulator keeps the promises that exactly-once outcomes rest on.
DynamoDB's: a conditional write to one item is atomic. Stock moto checks the
condition and then applies the update with no lock between, so of writers
racing from `queued`, several could win (seen in CI as a task whose final
record changed after it was final)."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

from sluice.aws import client

WRITERS = 16
ITEMS = 20
# A wide update, like an outcome write, widens moto's window between its check and its write.
FIELDS = 30


def test_of_conditional_writes_racing_on_one_item_exactly_one_wins(settings):
    ddb = client("dynamodb", settings)  # a pool of 32 connections: every writer has its own
    table = f"race-{uuid.uuid4().hex[:8]}"
    ddb.create_table(TableName=table, BillingMode="PAY_PER_REQUEST",
                     KeySchema=[{"AttributeName": "k", "KeyType": "HASH"}],
                     AttributeDefinitions=[{"AttributeName": "k", "AttributeType": "S"}])
    sets = ", ".join(f"f{j} = :me" for j in range(FIELDS))

    def write(key: str, me: int, start: threading.Barrier) -> int | None:
        start.wait(10)
        try:
            ddb.update_item(TableName=table, Key={"k": {"S": key}},
                            UpdateExpression=f"SET #s = :done, winner = :me, {sets}",
                            ConditionExpression="#s IN (:queued)",
                            ExpressionAttributeNames={"#s": "status"},
                            ExpressionAttributeValues={":done": {"S": "succeeded"}, ":me": {"N": str(me)},
                                                       ":queued": {"S": "queued"}})
            return me
        except ddb.exceptions.ConditionalCheckFailedException:
            return None

    with ThreadPoolExecutor(WRITERS) as pool:
        for i in range(ITEMS):
            key = str(i)
            ddb.put_item(TableName=table, Item={"k": {"S": key}, "status": {"S": "queued"}})
            start = threading.Barrier(WRITERS)
            winners = [w for w in pool.map(lambda me: write(key, me, start), range(WRITERS)) if w is not None]
            assert len(winners) == 1, f"item {i}: {len(winners)} conditional writes from `queued` all succeeded"
            item = ddb.get_item(TableName=table, Key={"k": {"S": key}}, ConsistentRead=True)["Item"]
            assert {item[f"f{j}"]["N"] for j in range(FIELDS)} == {item["winner"]["N"]} == {str(winners[0])}


RECEIVERS = 16
MESSAGES = 100
ROUNDS = 12


def test_of_receivers_racing_on_one_queue_each_message_goes_to_one(settings):
    """SQS hides a message from every other receiver once it hands it out.
    Stock moto checks that a message is visible and then marks it received,
    with no lock between, so two receivers could both take it: a task then ran
    twice, and its attempts counted the second receive (seen in CI as a refused
    input recorded with 2 attempts)."""
    sqs = client("sqs", settings)
    url = sqs.create_queue(QueueName=f"race-{uuid.uuid4().hex[:8]}")["QueueUrl"]

    def receive_all(start: threading.Barrier) -> list[str]:
        start.wait(10)
        got: list[str] = []
        while True:
            messages = sqs.receive_message(QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=300,
                                           WaitTimeSeconds=0).get("Messages", [])
            if not messages:
                return got
            got += [m["Body"] for m in messages]
            # As a worker does: moto's receive recounts the queue per message, in flight included.
            sqs.delete_message_batch(QueueUrl=url, Entries=[
                {"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)])

    with ThreadPoolExecutor(RECEIVERS) as pool:
        for r in range(ROUNDS):
            for i in range(0, MESSAGES, 10):
                sqs.send_message_batch(QueueUrl=url, Entries=[
                    {"Id": str(j), "MessageBody": f"{r}-{i + j}"} for j in range(10)])
            start = threading.Barrier(RECEIVERS)
            bodies = [b for got in pool.map(lambda _: receive_all(start), range(RECEIVERS)) for b in got]
            twice = sorted(b for b in set(bodies) if bodies.count(b) > 1)
            assert not twice, f"round {r}: {len(twice)} messages went to two receivers: {twice[:5]}"
            assert len(bodies) == MESSAGES
