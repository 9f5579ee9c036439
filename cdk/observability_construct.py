"""One dashboard and the alarms that page: a DLQ not empty, and a DLQ grown
(each new dead letter), oldest message older than its SLO, API 5xx rate, the
submit routes' p99 latency, errors of the scheduled functions (the SageMaker
backend's settler) and the SageMaker endpoint's invocation 5xx errors, all to
one SNS topic. Every graphed metric has a one-minute period."""

from __future__ import annotations

from aws_cdk import ArnFormat, Duration, Stack
from aws_cdk import aws_cloudwatch as cw
from aws_cdk import aws_cloudwatch_actions as cw_actions
from aws_cdk import aws_iam as iam
from aws_cdk import aws_kms as kms
from aws_cdk import aws_lambda as lambda_
from aws_cdk import aws_sns as sns
from aws_cdk import aws_sns_subscriptions as subscriptions
from constructs import Construct

from cdk.api_construct import SUBMIT_ROUTES, Api
from cdk.config import PRIORITIES, SluiceConfig
from cdk.queues_construct import Queues
from sluice.worker.metrics import dimensions as worker_dimensions
from sluice.worker.metrics import METRICS as WORKER_METRICS
from sluice.worker.metrics import NAMESPACE as WORKER_NAMESPACE

MINUTE = Duration.minutes(1)
FIVE_MINUTES = Duration.minutes(5)
# The task read, long polls included (?wait_s=N holds up to 20 s by design):
# graphed apart from the submit routes, and watched by no latency alarm.
POLL_ROUTE = ("GET", "/v1/tasks/{task_id}")


def worker_metric(name: str, deployment: str, statistic: str = "Average", label: str | None = None) -> cw.Metric:
    """A metric the workers of `deployment` (the stack's name_prefix) emit
    (sluice.worker.metrics): the same namespace and dimensions."""
    if name not in WORKER_METRICS:
        raise ValueError(f"workers emit no metric {name!r}; they emit {', '.join(WORKER_METRICS)}")
    return cw.Metric(
        namespace=WORKER_NAMESPACE,
        metric_name=name,
        dimensions_map=worker_dimensions(deployment),
        statistic=statistic,
        period=MINUTE,
        label=label or name,
    )


class Observability(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: SluiceConfig,
        queues: Queues,
        api: Api,
        functions: dict[str, lambda_.IFunction],
        gpu_metrics: list[cw.IMetric],
        dashboard_name: str,
        scheduled: dict[str, lambda_.IFunction] | None = None,
        worker_gpu: bool = True,
        endpoint: dict[str, str] | None = None,
    ) -> None:
        """`scheduled`: functions run on a schedule, which no caller sees fail:
        graphed with `functions`, and each alarms on its errors.
        `gpu_metrics`: the platform's GPU figures (one-minute period, like every graphed metric).
        `worker_gpu`: whether the workers report GpuUtilization and GpuMemoryUsed
        (torch on a GPU in the worker process: not the SageMaker dispatcher Lambda).
        `endpoint`: a SageMaker endpoint's dimensions (EndpointName, VariantName):
        its invocations, errors and latencies are graphed, its 5xx errors alarm."""
        super().__init__(scope, id)
        scheduled = scheduled or {}
        stack = Stack.of(self)
        cloudwatch = iam.ServicePrincipal("cloudwatch.amazonaws.com")
        this_account = {"aws:SourceAccount": stack.account}  # on behalf of this account's alarms only

        key = kms.Key(self, "AlarmTopicKey", enable_key_rotation=True, description="Sluice alarm topic")
        # CloudWatch alarms publish to the encrypted topic.
        key.add_to_resource_policy(
            iam.PolicyStatement(
                actions=["kms:Decrypt", "kms:GenerateDataKey*"],
                principals=[cloudwatch],
                resources=["*"],  # in a key policy, "*" is this key
                conditions={"StringEquals": this_account},
            )
        )
        self.topic = sns.Topic(self, "Alarms", display_name="Sluice alarms", master_key=key, enforce_ssl=True)
        # enforce_ssl gives the topic a policy of its own, which replaces SNS's
        # default one (the account's principals may publish): without this
        # statement CloudWatch may not publish the alarms to it.
        self.topic.add_to_resource_policy(
            iam.PolicyStatement(
                sid="AllowCloudWatchAlarms",
                actions=["sns:Publish"],
                principals=[cloudwatch],
                resources=[self.topic.topic_arn],
                conditions={
                    "StringEquals": this_account,
                    "ArnLike": {
                        "aws:SourceArn": stack.format_arn(
                            service="cloudwatch",
                            resource="alarm",
                            resource_name="*",
                            arn_format=ArnFormat.COLON_RESOURCE_NAME,
                        )
                    },
                },
            )
        )
        if config.alarm_email:
            self.topic.add_subscription(subscriptions.EmailSubscription(config.alarm_email))
        action = cw_actions.SnsAction(self.topic)

        self.alarms: list[cw.Alarm] = []

        def graph(title: str, left: list, right: list | None = None, width: int = 8, **kwargs) -> cw.GraphWidget:
            return cw.GraphWidget(title=title, left=left, right=right or [], width=width, height=6, **kwargs)

        def workers(name: str, statistic: str = "Average", label: str | None = None) -> cw.Metric:
            """This stack's workers' metric: its name_prefix is their deployment dimension."""
            return worker_metric(name, config.name_prefix, statistic, label)

        def alarm(
            id: str, metric: cw.IMetric, threshold: float, description: str, periods: int = 1, datapoints: int | None = None
        ) -> cw.Alarm:
            a = cw.Alarm(
                self,
                id,
                metric=metric,
                threshold=threshold,
                evaluation_periods=periods,
                datapoints_to_alarm=datapoints,
                comparison_operator=cw.ComparisonOperator.GREATER_THAN_THRESHOLD,
                treat_missing_data=cw.TreatMissingData.NOT_BREACHING,
                alarm_description=description,
            )
            a.add_alarm_action(action)
            a.add_ok_action(action)
            self.alarms.append(a)
            return a

        # ------------------------------------------------------------ queues
        backlog, in_flight, age, dlq_depth = [], [], [], []
        for p in PRIORITIES:
            queue, dlq = queues.queues[p], queues.dlqs[p]
            backlog.append(queue.metric_approximate_number_of_messages_visible(period=MINUTE, statistic="Maximum", label=p))
            # KEDA scales on visible and in-flight messages both.
            in_flight.append(queue.metric_approximate_number_of_messages_not_visible(
                period=MINUTE, statistic="Maximum", label=f"{p} in flight"))
            oldest = queue.metric_approximate_age_of_oldest_message(period=MINUTE, statistic="Maximum", label=p)
            age.append(oldest)
            # Visible and hidden: a settling round hides the DLQ's messages while it reads past them.
            depth = cw.MathExpression(
                expression=f"visible_{p} + hidden_{p}",  # ids unique across the dashboard's graph
                using_metrics={
                    f"visible_{p}": dlq.metric_approximate_number_of_messages_visible(period=MINUTE, statistic="Maximum"),
                    f"hidden_{p}": dlq.metric_approximate_number_of_messages_not_visible(period=MINUTE, statistic="Maximum"),
                },
                period=MINUTE,
                label=f"{p} DLQ",
            )
            dlq_depth.append(depth)
            alarm(f"Dlq{p.title()}NotEmpty", depth, 0, f"The {p} dead-letter queue holds messages: inspect with `sluice dlq`.")
            # Dead letters of tasks already final are left in the DLQ for operators
            # (sluice/dlq.py), so the depth alarm above may stay in ALARM and say
            # nothing of a later one: this one fires on each rise of the depth.
            # (SQS counts no redrive-policy move in NumberOfMessagesSent.) It reads
            # either of the last two differences: DIFF gives none for the first
            # point of the range it is handed. OK again two quiet minutes later.
            alarm(
                f"Dlq{p.title()}Grew",
                cw.MathExpression(
                    expression=f"DIFF(depth_{p})",
                    using_metrics={f"depth_{p}": depth},
                    period=MINUTE,
                    label=f"{p} DLQ growth",
                ),
                0,
                f"A message was dead-lettered to the {p} dead-letter queue: inspect with `sluice dlq`.",
                periods=2,
                datapoints=1,
            )
            slo = config.oldest_message_slo_s[p]
            alarm(
                f"Oldest{p.title()}OverSlo",
                oldest,
                slo,
                # SQS leaves out of this age a message received 3 times or more, and a requeue's
                # message starts at 0: tasks handed back again and again show in the DLQ alarms.
                f"A {p} queue's oldest message has waited over {slo} s: workers are behind or down.",
                periods=3,
            )

        # --------------------------------------------------------------- api
        stage = api.stage
        count = stage.metric_count(period=MINUTE, statistic="Sum")
        errors_4xx = stage.metric_client_error(period=MINUTE, statistic="Sum")
        errors_5xx = stage.metric_server_error(period=MINUTE, statistic="Sum")
        rate_5xx = cw.MathExpression(
            expression="IF(requests > 0, 100 * errors / requests, 0)",
            using_metrics={"errors": errors_5xx, "requests": count},
            period=MINUTE,
            label="5xx %",
        )
        alarm("Api5xxRate", rate_5xx, config.api_5xx_rate_pct, f"Over {config.api_5xx_rate_pct}% of API calls end in 5xx.", periods=3)

        def route_latency(method: str, path: str, statistic: str) -> cw.Metric:
            """One route's latency: per method (the stage's method settings enable per-method metrics)."""
            latency = stage.metric_latency(period=MINUTE, statistic=statistic, label=f"{method} {path} {statistic}")
            return latency.with_(dimensions_map={**(latency.dimensions or {}), "Resource": path, "Method": method})

        # The stage's latency includes the long polls (GET /v1/tasks/{id}?wait_s=N),
        # which hold up to 20 s by design: the alarm watches the submit routes,
        # and the dashboard graphs those and the poll apart, never the stage's.
        submit_latency = [route_latency(m, path, stat) for m, path in SUBMIT_ROUTES for stat in ("p50", "p99")]
        poll_latency = [route_latency(*POLL_ROUTE, stat) for stat in ("p50", "p99")]
        for method, path in SUBMIT_ROUTES:
            alarm(
                "ApiP99Latency" + "".join(part.title() for part in (method, *path.split("/"))),  # ...PostV1Tasks
                route_latency(method, path, "p99"),
                config.api_p99_latency_ms,
                f"{method} {path} p99 latency over {config.api_p99_latency_ms} ms.",
                periods=3,
            )

        # ------------------------------------------------------------ lambda
        fn_errors, fn_throttles, fn_duration = [], [], []
        for name, fn in {**functions, **scheduled}.items():
            fn_errors.append(fn.metric_errors(period=MINUTE, statistic="Sum", label=name))
            fn_throttles.append(fn.metric_throttles(period=MINUTE, statistic="Sum", label=name))
            fn_duration.append(fn.metric_duration(period=MINUTE, statistic="p99", label=f"{name} p99"))
        for name, fn in scheduled.items():
            # Errors in 3 periods running, not one: a single failed run is retried by the next.
            alarm(
                f"{name.title()}Errors",
                fn.metric_errors(period=FIVE_MINUTES, statistic="Sum"),
                0,
                f"The {name} function had errors in each of the last three 5-minute periods: see its logs.",
                periods=3,
            )

        # ---------------------------------------------------------- sagemaker
        endpoint_graphs = []
        if endpoint:
            def endpoint_metric(name: str, statistic: str, label: str, period: Duration = MINUTE) -> cw.Metric:
                return cw.Metric(namespace="AWS/SageMaker", metric_name=name, dimensions_map=dict(endpoint),
                                 statistic=statistic, period=period, label=label)

            # Errors in two 5-minute periods running: one the dispatcher retried is no page.
            alarm(
                "EndpointInvocation5xxErrors",
                endpoint_metric("Invocation5XXErrors", "Sum", "invocation 5xx", FIVE_MINUTES),
                0,
                "The SageMaker endpoint answered invocations with 5xx errors in each of the last two 5-minute "
                "periods: see its logs (/aws/sagemaker/Endpoints/<endpoint>).",
                periods=2,
            )
            endpoint_graphs = [
                graph(
                    "Endpoint invocations",
                    [endpoint_metric("Invocations", "Sum", "invocations")],
                    [endpoint_metric("Invocation5XXErrors", "Sum", "5xx errors")],
                    width=12,
                ),
                graph(
                    "Endpoint latency (µs)",
                    [endpoint_metric(name, stat, f"{label} {stat}")
                     for name, label in (("ModelLatency", "model"), ("OverheadLatency", "overhead"))
                     for stat in ("p50", "p99")],
                    width=12,
                ),
            ]

        # ----------------------------------------------------------- workers
        outcomes = [
            workers("TasksSucceeded", "Sum", "succeeded"),
            workers("TaskAttemptsFailed", "Sum", "failed attempts"),
            workers("TaskAttemptsDropped", "Sum", "dropped (task final already, or past its deadline)"),
            workers("TasksHandedBack", "Sum", "handed back unrun"),
        ]
        # Every batch's size summed over all workers, per second: an Average of
        # a per-worker figure would show one worker's rate however many run.
        inputs_per_s = cw.MathExpression(
            expression="inputs / PERIOD(inputs)",
            using_metrics={"inputs": workers("BatchSize", "Sum")},
            period=MINUTE,
            label="all workers",
        )

        self.dashboard = cw.Dashboard(self, "Dashboard", dashboard_name=dashboard_name)
        self.dashboard.add_widgets(
            graph("Backlog: visible (left), in flight (right)", backlog, in_flight),
            graph("Oldest message age (s)", age),
            graph("DLQ depth", dlq_depth),
        )
        self.dashboard.add_widgets(
            graph("API requests", [count], [errors_4xx, errors_5xx], width=6),
            graph(
                "Submit latency (ms)",
                submit_latency,
                width=6,
                left_annotations=[cw.HorizontalAnnotation(value=config.api_p99_latency_ms, label="p99 alarm")],
            ),
            graph(f"{' '.join(POLL_ROUTE)} latency (ms, long polls)", poll_latency, width=6),
            graph("API 5xx rate (%)", [rate_5xx], width=6),
        )
        self.dashboard.add_widgets(
            graph("Lambda errors", fn_errors),
            graph("Lambda throttles", fn_throttles),
            graph("Lambda duration (ms)", fn_duration),
        )
        self.dashboard.add_widgets(
            graph("Batch size", [workers("BatchSize", "Average", "avg"), workers("BatchSize", "Maximum", "max")]),
            graph(
                "Inference latency (ms)",
                [workers("InferenceLatency", "p50", "p50"), workers("InferenceLatency", "p99", "p99")],
            ),
            graph("Throughput (inputs/s)", [inputs_per_s],
                  [workers("Throughput", "Average", "per worker, while inferring")]),
        )
        if endpoint_graphs:
            self.dashboard.add_widgets(*endpoint_graphs)
        gpu_left, gpu_right = list(gpu_metrics), []
        if worker_gpu:
            gpu_left.insert(0, workers("GpuUtilization", "Average"))
            gpu_right.append(workers("GpuMemoryUsed", "Maximum", "GpuMemoryUsed (MB)"))
        self.dashboard.add_widgets(
            graph("GPU utilization (%) and memory" if worker_gpu else "GPU utilization and memory (%)",
                  gpu_left, gpu_right, width=12),
            graph("Task outcomes", outcomes, width=12),
        )
