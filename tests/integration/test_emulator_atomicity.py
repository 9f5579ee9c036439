"""The embedded emulator keeps DynamoDB's one promise that exactly-once outcomes
rest on: a conditional write to one item is atomic. Stock moto checks the
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
