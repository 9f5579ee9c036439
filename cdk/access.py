"""Exactly which data-plane actions each principal gets: the calls the sluice
adapters make on its code path, nothing else, never a wildcard.

tests/unit/test_lambda_*.py record the AWS calls the Lambda handlers really
make (against moto) and check each one against these lists, so a new call in
the adapters fails a test rather than a deployment.
"""

from __future__ import annotations

# The API: create/read/cancel tasks (long polls read in batches), claim-check
# inputs, presign results, enqueue, read queue depth; /ready describes the
# table and heads the bucket.
API_TASKS = [
    "dynamodb:GetItem",
    "dynamodb:BatchGetItem",
    "dynamodb:PutItem",
    "dynamodb:BatchWriteItem",
    "dynamodb:UpdateItem",
    "dynamodb:DeleteItem",
    "dynamodb:DescribeTable",
]
# Objects by prefix (sluice.contract): the API writes inputs/ (claim checks),
# deleting those of a submit it refused (409) or rolled back, and reads
# results/ (the presigned result URLs are signed as this role).
API_INPUTS = ["s3:PutObject", "s3:DeleteObject"]
API_RESULTS = ["s3:GetObject"]
API_OBJECTS = API_INPUTS + API_RESULTS  # whatever the prefix
API_BUCKET = ["s3:ListBucket"]  # HeadBucket
API_QUEUES = ["sqs:SendMessage", "sqs:GetQueueAttributes"]

# Workers (EKS pods and the SageMaker dispatcher): claim and finish tasks,
# read claim-checked inputs, write large results.
WORKER_TASKS = ["dynamodb:GetItem", "dynamodb:BatchGetItem", "dynamodb:UpdateItem"]
# Objects by prefix (sluice.contract): workers read inputs/ and write results/;
# a run whose outcome lost the conditional write deletes the result it uploaded
# under its own key (sluice.lifecycle.record_outcomes).
WORKER_INPUTS = ["s3:GetObject"]
WORKER_RESULTS = ["s3:PutObject", "s3:DeleteObject"]
WORKER_OBJECTS = WORKER_INPUTS + WORKER_RESULTS  # whatever the prefix
# Without it S3 answers a missing inputs object 403, not 404, and the task would
# be retried until dead-lettered rather than failed at once (sluice.lifecycle).
WORKER_BUCKET = ["s3:ListBucket"]
WORKER_QUEUES = [
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",
    "sqs:ChangeMessageVisibility",
    "sqs:GetQueueAttributes",
]
# EKS workers put their metrics (SLUICE_METRICS_SINK=cloudwatch): EKS's log
# agent does not turn EMF lines into metrics. PutMetricData takes no resource,
# so the grant is on "*" limited by a cloudwatch:namespace condition.
WORKER_METRICS = ["cloudwatch:PutMetricData"]

# Settling dead-lettered tasks (sluice.dlq.settle_dead: each EKS worker, and the
# SageMaker backend's scheduled settler): find each DLQ from its queue's
# redrive policy, read its messages and the tasks', fail or requeue them.
SETTLE_TASKS = ["dynamodb:GetItem", "dynamodb:BatchGetItem", "dynamodb:UpdateItem"]
SETTLE_QUEUES = ["sqs:GetQueueAttributes", "sqs:SendMessage"]
SETTLE_DLQS = [
    "sqs:GetQueueUrl",
    "sqs:ReceiveMessage",
    "sqs:DeleteMessage",
    "sqs:ChangeMessageVisibility",
]

# A task's message that SQS would not dead-letter (a requeued task's, failed
# or past max_attempts below maxReceiveCount): the EKS worker and the SageMaker
# dispatcher send it to its DLQ, found from its queue's redrive policy
# (GetQueueAttributes, which both have on the queues). The worker then deletes
# it from its queue; Lambda does for the dispatcher.
DEAD_LETTER_DLQS = ["sqs:GetQueueUrl", "sqs:SendMessage"]

# Batch calls are authorized as their single-message action.
_SQS_BATCH = {
    "SendMessageBatch": "SendMessage",
    "DeleteMessageBatch": "DeleteMessage",
    "ChangeMessageVisibilityBatch": "ChangeMessageVisibility",
}
_S3 = {"HeadBucket": "ListBucket", "ListObjectsV2": "ListBucket"}


def iam_action(service: str, operation: str) -> str:
    """The IAM action that authorizes one API call (botocore's operation name)."""
    if service == "sqs":
        return f"sqs:{_SQS_BATCH.get(operation, operation)}"
    if service == "s3":
        return f"s3:{_S3.get(operation, operation)}"
    if service == "monitoring":  # CloudWatch's endpoint prefix
        return f"cloudwatch:{operation}"
    if service in ("runtime.sagemaker", "sagemaker-runtime"):
        return f"sagemaker:{operation}"
    return f"{service}:{operation}"
