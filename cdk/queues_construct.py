"""The three priority queues, each with its dead-letter queue."""

from __future__ import annotations

from aws_cdk import Duration
from aws_cdk import aws_iam as iam
from aws_cdk import aws_sqs as sqs
from constructs import Construct

from cdk.config import PRIORITIES, SluiceConfig
from sluice.contract import MESSAGE_RETENTION_S


class Queues(Construct):
    def __init__(self, scope: Construct, id: str, *, config: SluiceConfig) -> None:
        super().__init__(scope, id)
        self.queues: dict[str, sqs.Queue] = {}
        self.dlqs: dict[str, sqs.Queue] = {}
        for priority in PRIORITIES:
            name = f"{config.name_prefix}-{priority}"
            dlq = sqs.Queue(
                self,
                f"{priority.title()}Dlq",
                queue_name=f"{name}-dlq",
                encryption=sqs.QueueEncryption.SQS_MANAGED,
                enforce_ssl=True,
                retention_period=Duration.seconds(MESSAGE_RETENTION_S),
            )
            self.dlqs[priority] = dlq
            self.queues[priority] = sqs.Queue(
                self,
                priority.title(),
                queue_name=name,
                encryption=sqs.QueueEncryption.SQS_MANAGED,
                enforce_ssl=True,
                visibility_timeout=Duration.seconds(config.visibility_timeout_s),
                retention_period=Duration.seconds(MESSAGE_RETENTION_S),
                dead_letter_queue=sqs.DeadLetterQueue(queue=dlq, max_receive_count=config.max_attempts),
            )

    def grant(self, grantee: iam.IGrantable, actions: list[str]) -> None:
        """On the three priority queues."""
        _grant(grantee, actions, self.queues.values())

    def grant_dlqs(self, grantee: iam.IGrantable, actions: list[str]) -> None:
        """On the three dead-letter queues."""
        _grant(grantee, actions, self.dlqs.values())

    def env(self) -> dict[str, str]:
        """The environment the sluice settings read (explicit URLs win over names)."""
        return {f"SLUICE_QUEUE_URL_{p.upper()}": q.queue_url for p, q in self.queues.items()}


def _grant(grantee: iam.IGrantable, actions: list[str], queues) -> None:
    iam.Grant.add_to_principal(grantee=grantee, actions=actions, resource_arns=[q.queue_arn for q in queues])
