"""S3 store for large inputs (claim check) and large results."""

from __future__ import annotations

import json

from sluice.aws import client, new_client
from sluice.contract import INPUTS_PREFIX, RESULTS_PREFIX
from sluice.settings import Settings


class PayloadStore:
    def __init__(self, settings: Settings):
        self.bucket = settings.bucket
        self.presign_expiry_s = settings.presign_expiry_s
        self.s3 = client("s3", settings)
        # Presigned URLs name the public endpoint when one is set (on-prem);
        # puts and gets always use the endpoint the process itself reaches. The
        # signer makes no call (SigV4 presigning is local), so its endpoint may
        # be one only clients can reach, such as MinIO's port on the host.
        self.signer = (new_client("s3", settings, endpoint_url=settings.s3_public_endpoint)
                       if settings.s3_public_endpoint else self.s3)

    @staticmethod
    def inputs_key(tenant_id: str, task_id: str, request_hash: str) -> str:
        # Named by the request too: a request that reuses an Idempotency-Key
        # with another body (answered 409) must not overwrite the first's inputs.
        return f"{INPUTS_PREFIX}{tenant_id}/{task_id}-{request_hash[:16]}.json"

    @staticmethod
    def result_key(tenant_id: str, task_id: str, run: str) -> str:
        # One key per run: a duplicate run that loses the outcome's conditional
        # write has uploaded first, and must not replace the winner's object.
        return f"{RESULTS_PREFIX}{tenant_id}/{task_id}/{run}.json"

    def put_json(self, key: str, body: bytes) -> None:
        self.s3.put_object(Bucket=self.bucket, Key=key, Body=body, ContentType="application/json")

    def get_json(self, key: str):
        return json.loads(self.s3.get_object(Bucket=self.bucket, Key=key)["Body"].read())

    def delete(self, key: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=key)

    def presigned_get(self, key: str) -> str:
        return self.signer.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=self.presign_expiry_s
        )
