"""A table write that landed and is sent again: the SDK resends a write whose
answer was lost (a 5xx, a read timeout), and the resend meets the record the
first send changed. `marker`: a text in the request of the write to treat so
(the first such write only)."""

import json

import urllib3
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError


class _Body:
    def __init__(self, data: bytes):
        self.data = data

    def stream(self, **_):
        yield self.data


def lose_the_first_reply(ddb, marker: str) -> list[int]:
    """The write reaches the table and its answer is lost (a 500): the SDK
    sends it again. Returns the status of each send that landed unanswered."""
    http = urllib3.PoolManager()
    landed: list[int] = []

    def lose(request, **_):
        body = request.body.decode() if isinstance(request.body, bytes) else (request.body or "")
        if marker not in body or landed:
            return None
        landed.append(http.request(request.method, request.url, body=request.body,
                                   headers=dict(request.headers)).status)
        error = {"__type": "com.amazonaws.dynamodb.v20120810#InternalServerError", "message": "lost"}
        return AWSResponse(request.url, 500, {"x-amzn-RequestId": "lost"}, _Body(json.dumps(error).encode()))

    ddb.meta.events.register_first("before-send.dynamodb.UpdateItem", lose)
    return landed


def refused_without_the_old_item(ddb, marker: str) -> list[int]:
    """As above, on an emulator that answers a failed condition without the
    old item (dynalite): the write lands, then its resend is refused. `ddb`
    must be the caller's own client: its update_item is replaced."""
    landed: list[int] = []
    update_item = ddb.update_item

    def resent(**request):
        first = not landed and marker in json.dumps(request)
        response = update_item(**request)
        if not first:
            return response
        landed.append(200)
        raise ClientError({"Error": {"Code": "ConditionalCheckFailedException", "Message": "resent"}}, "UpdateItem")

    ddb.update_item = resent
    return landed


RESENDS = [lose_the_first_reply, refused_without_the_old_item]
