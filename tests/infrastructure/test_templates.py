"""What the synthesized templates promise, checked on the templates themselves."""

from __future__ import annotations

import json
import re

from aws_cdk.assertions import Match

from cdk.config import PRIORITIES

DATA_SERVICES = ("dynamodb:", "sqs:", "s3:")
OWN_DATA_TYPES = {"AWS::DynamoDB::Table", "AWS::SQS::Queue", "AWS::S3::Bucket"}


def resources(template: dict, type_: str) -> dict[str, dict]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == type_}


def as_list(value) -> list:
    return value if isinstance(value, list) else [value]


def refs(value) -> set[str]:
    """Logical ids a CloudFormation expression refers to."""
    found: set[str] = set()
    if isinstance(value, dict):
        if "Ref" in value:
            found.add(value["Ref"])
        if "Fn::GetAtt" in value:
            found.add(value["Fn::GetAtt"][0])
        for v in value.values():
            found |= refs(v)
    elif isinstance(value, list):
        for v in value:
            found |= refs(v)
    return found


def expression_text(value) -> str:
    """A CloudFormation string expression as text, each reference in it as <Logical> or <Logical.Attribute>."""
    if isinstance(value, str):
        return value
    if "Ref" in value:
        return f"<{value['Ref']}>"
    if "Fn::GetAtt" in value:
        return "<{}.{}>".format(*value["Fn::GetAtt"])
    if "Fn::Join" in value:
        separator, parts = value["Fn::Join"]
        return separator.join(expression_text(part) for part in parts)
    raise AssertionError(f"not a string expression: {value}")


# ------------------------------------------------------------------ assembly


def test_both_backends_synthesize_with_nag_clean(synth):
    assert set(synth.stacks) == {"eks", "sagemaker"}
    assert (synth.outdir / "SluiceEks.template.json").exists()
    assert (synth.outdir / "SluiceSageMaker.template.json").exists()
    report = synth.outdir / "validation-report.json"
    if report.exists():
        violations = [v for p in json.loads(report.read_text())["pluginReports"] for v in p["violations"]]
        assert violations == []
    print(f"synth of both stacks: {synth.seconds:.1f} s")


# ----------------------------------------------------------------------- API


def method_paths(template: dict) -> dict[str, tuple[str, dict]]:
    """{logical id: ("GET /v1/tasks/{task_id}", properties)} for every API method."""
    api_resources = resources(template, "AWS::ApiGateway::Resource")
    root = next(iter(resources(template, "AWS::ApiGateway::RestApi")))

    def path(resource_id) -> str:
        if isinstance(resource_id, dict) and resource_id.get("Fn::GetAtt", [None])[0] == root:
            return ""
        logical = resource_id["Ref"]
        props = api_resources[logical]["Properties"]
        return path(props["ParentId"]) + "/" + props["PathPart"]

    return {
        k: (f"{v['Properties']['HttpMethod']} {path(v['Properties']['ResourceId']) or '/'}", v["Properties"])
        for k, v in resources(template, "AWS::ApiGateway::Method").items()
    }


def test_every_route_but_health_requires_an_api_key(synth, backend):
    methods = method_paths(synth.raw[backend])
    routes = {route: props for route, props in methods.values()}
    assert set(routes) == {
        "GET /health",
        "GET /ready",
        "GET /v1/models",
        "POST /v1/tasks",
        "POST /v1/tasks/batch",
        "GET /v1/tasks/{task_id}",
        "DELETE /v1/tasks/{task_id}",
    }
    for route, props in routes.items():
        assert props.get("ApiKeyRequired", False) is (route != "GET /health"), route
        assert props["Integration"]["Type"] == "AWS_PROXY"


def test_bodies_are_left_to_the_app_and_published_as_the_contract(synth, backend):
    """The gateway's refusal of a body could not name the field and the rule;
    the app's does. So the gateway validates parameters only, and publishes
    the contract's schemas as the routes' request models."""
    raw = synth.raw[backend]
    routes = {route: props for route, props in method_paths(raw).values()}
    validators = resources(raw, "AWS::ApiGateway::RequestValidator")
    assert [v["Properties"]["ValidateRequestBody"] for v in validators.values()] == [False]
    assert all(v["Properties"]["ValidateRequestParameters"] for v in validators.values())
    assert "BAD_REQUEST_BODY" not in {r["Properties"]["ResponseType"]
                                      for r in resources(raw, "AWS::ApiGateway::GatewayResponse").values()}
    models = {m["Properties"]["Name"]: m["Properties"]["Schema"] for m in resources(raw, "AWS::ApiGateway::Model").values()}
    for route, model in (("POST /v1/tasks", "SubmitRequest"), ("POST /v1/tasks/batch", "BatchSubmitRequest")):
        props = routes[route]
        assert props["RequestValidatorId"]["Ref"] in validators
        assert refs(props["RequestModels"]["application/json"])
        assert model in models
    submit = models["SubmitRequest"]
    assert submit["additionalProperties"] is False
    assert submit["required"] == ["model", "inputs"]
    assert submit["properties"]["inputs"]["maxItems"] == 64
    assert submit["properties"]["priority"]["enum"] == list(PRIORITIES)
    assert submit["properties"]["deadline_s"]["type"] == ["integer", "null"]
    batch = models["BatchSubmitRequest"]
    assert batch["properties"]["tasks"]["items"]["properties"]["inputs"]["items"]["maxLength"] == 8192


def test_usage_plans_throttle_and_cap_each_key(synth, backend):
    plans = resources(synth.raw[backend], "AWS::ApiGateway::UsagePlan")
    assert plans
    config = synth.config[backend]
    for plan, expected in zip(plans.values(), config.usage_plans):
        props = plan["Properties"]
        assert props["Throttle"] == {"RateLimit": expected.rate_per_s, "BurstLimit": expected.burst}
        assert props["Quota"] == {"Limit": expected.quota_per_day, "Period": "DAY"}
        assert props["ApiStages"]


def test_stage_traces_and_logs_access(synth, backend):
    synth.templates[backend].has_resource_properties(
        "AWS::ApiGateway::Stage",
        {
            "TracingEnabled": True,
            "AccessLogSetting": {"DestinationArn": Match.any_value(), "Format": Match.string_like_regexp("apiKeyId")},
            "MethodSettings": Match.array_with([Match.object_like({"LoggingLevel": "ERROR", "MetricsEnabled": True})]),
        },
    )


def test_api_lambda_runs_the_app_with_gateway_auth(synth, backend):
    functions = resources(synth.raw[backend], "AWS::Lambda::Function")
    (api,) = [f for f in functions.values() if f["Properties"].get("Handler") == "lambdas.api.handler.handler"]
    env = api["Properties"]["Environment"]["Variables"]
    assert env["SLUICE_AUTH_MODE"] == "apigateway"
    for name in ("SLUICE_TASKS_TABLE", "SLUICE_BUCKET", *(f"SLUICE_QUEUE_URL_{p.upper()}" for p in PRIORITIES)):
        assert refs(env[name]), name
    assert api["Properties"]["TracingConfig"] == {"Mode": "Active"}
    assert api["Properties"]["Layers"]


def test_every_writer_of_task_records_shares_the_task_lifecycle_settings(synth, backend):
    # A final status renews its record's TTL from result_ttl_days, and attempts
    # count against max_attempts, in whichever process writes it: one that fell
    # back to the defaults would keep records for another TTL than the bucket's
    # results and the API's promise.
    config = synth.config[backend]
    envs = {name: f["Properties"].get("Environment", {}).get("Variables", {})
            for name, f in resources(synth.raw[backend], "AWS::Lambda::Function").items()}
    if backend == "eks":
        (container,) = worker_deployment(synth.raw["eks"])["spec"]["template"]["spec"]["containers"]
        envs["worker"] = {e["name"]: e.get("value") for e in container["env"]}
    writers = {name: env for name, env in envs.items() if "SLUICE_TASKS_TABLE" in env}
    assert len(writers) == {"eks": 2, "sagemaker": 3}[backend], sorted(writers)
    for name, env in writers.items():
        assert env.get("SLUICE_RESULT_TTL_DAYS") == str(config.result_ttl_days), name
        assert env.get("SLUICE_MAX_ATTEMPTS") == str(config.max_attempts), name


def test_lambda_bundle_has_no_torch():
    from cdk import bundling, functions

    assert functions.RUNTIME.name == f"python{bundling.LAMBDA_PYTHON}"  # wheels built for the runtime's Python
    layer, code = bundling.build()
    packages = {p.name.lower() for p in (layer / "python").iterdir()}
    assert "torch" not in packages and not any(p.startswith("torch-") for p in packages)
    assert {"fastapi", "mangum", "pydantic", "aws_lambda_powertools", "aws_xray_sdk"} <= packages
    assert not packages & {"uvicorn", "httptools", "uvloop"}  # the local server's; Lambda runs Mangum
    # The AWS SDK as one tested pair: the X-Ray SDK brings botocore, so boto3 comes too,
    # rather than the runtime's older boto3 beside a newer bundled botocore.
    assert {"boto3", "botocore", "s3transfer"} <= packages
    from importlib.metadata import version

    for sdk in ("boto3", "botocore"):  # the versions the tests ran with
        assert (layer / "python" / f"{sdk}-{version(sdk)}.dist-info").is_dir(), sdk
    assert (code / "lambdas" / "api" / "handler.py").exists()
    assert (code / "lambdas" / "dispatcher" / "handler.py").exists()
    assert sorted(p.name for p in (code / "models").iterdir()) == ["__init__.py", "base.py", "registry.py"]


def test_lambda_code_bundle_imports_on_its_own(tmp_path):
    """Every handler imports from the bundled first-party code alone (not the
    repository or its editable install), and importing them never loads torch."""
    import site
    import subprocess
    import sys

    from cdk import bundling

    _, code = bundling.build()
    probe = f"""
import sys
sys.path[:0] = [{str(code)!r}] + {site.getsitepackages()!r}
import lambdas.api.handler, lambdas.dispatcher.handler, lambdas.settler.handler, sluice, models.registry
assert sluice.__file__.startswith({str(code)!r}), sluice.__file__
assert "torch" not in sys.modules
print("ok")
"""
    env = {"AWS_REGION": "us-east-1", "SLUICE_AUTH_MODE": "apigateway", "PATH": "/usr/bin:/bin",
           # The settler's queues, as the stack names them (no call is made at import).
           **{f"SLUICE_QUEUE_URL_{p.upper()}": f"https://sqs.us-east-1.amazonaws.com/123456789012/sluice-{p}"
              for p in PRIORITIES}}
    # -S: no site processing, so the editable install's path hook is not loaded.
    result = subprocess.run([sys.executable, "-S", "-c", probe], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=60)
    assert result.stdout.strip() == "ok", result.stderr[-2000:]


# -------------------------------------------------------------------- queues


def test_three_queues_and_three_dlqs_dead_lettering_after_max_attempts(synth, backend):
    raw = synth.raw[backend]
    queues = resources(raw, "AWS::SQS::Queue")
    assert len(queues) == 6
    main = {k: v for k, v in queues.items() if "RedrivePolicy" in v["Properties"]}
    dlqs = {k for k in queues if k not in main}
    assert len(main) == 3 and len(dlqs) == 3
    assert {v["Properties"]["QueueName"] for v in main.values()} == {f"sluice-{p}" for p in PRIORITIES}
    targets = set()
    for q in main.values():
        policy = q["Properties"]["RedrivePolicy"]
        assert policy["maxReceiveCount"] == synth.config[backend].max_attempts == 3
        targets |= refs(policy["deadLetterTargetArn"])
        assert q["Properties"]["VisibilityTimeout"] == synth.config[backend].visibility_timeout_s
    assert targets == dlqs


def test_every_queue_keeps_a_message_longer_than_any_deadline(synth, backend):
    # SQS deletes an expired message unseen: it never reaches a DLQ or settling.
    from sluice.contract import MAX_DEADLINE_S

    for q in resources(synth.raw[backend], "AWS::SQS::Queue").values():
        assert q["Properties"]["MessageRetentionPeriod"] == 14 * 24 * 3600 > MAX_DEADLINE_S


def test_max_receive_count_follows_max_attempts():
    # A task's last attempt releases its message for the next receive to dead-letter it.
    from aws_cdk import App, Stack
    from aws_cdk.assertions import Template

    from cdk.config import SluiceConfig
    from cdk.queues_construct import Queues

    stack = Stack(App(), "QueuesOnly")
    Queues(stack, "Queues", config=SluiceConfig(max_attempts=5))
    queues = resources(Template.from_stack(stack).to_json(), "AWS::SQS::Queue").values()
    assert [q["Properties"]["RedrivePolicy"]["maxReceiveCount"] for q in queues if "RedrivePolicy" in q["Properties"]] == [5] * 3


def test_queue_visibility_covers_the_longest_batch(synth, backend):
    config = synth.config[backend]
    assert config.visibility_timeout_s > config.longest_batch_s
    if backend == "sagemaker":
        functions = resources(synth.raw[backend], "AWS::Lambda::Function")
        (dispatcher,) = [f for f in functions.values() if "dispatcher" in f["Properties"].get("Handler", "")]
        assert config.longest_batch_s < dispatcher["Properties"]["Timeout"] <= config.visibility_timeout_s


def test_queues_only_accept_tls(synth, backend):
    raw = synth.raw[backend]
    queues = set(resources(raw, "AWS::SQS::Queue"))
    covered = set()
    for policy in resources(raw, "AWS::SQS::QueuePolicy").values():
        statements = policy["Properties"]["PolicyDocument"]["Statement"]
        assert any(
            s["Effect"] == "Deny" and s["Condition"] == {"Bool": {"aws:SecureTransport": "false"}} for s in statements
        )
        covered |= refs(policy["Properties"]["Queues"])
    assert covered == queues


# ---------------------------------------------------------------- encryption


def test_encryption_everywhere(synth, backend):
    raw = synth.raw[backend]
    for q in resources(raw, "AWS::SQS::Queue").values():
        assert q["Properties"].get("SqsManagedSseEnabled") is True or "KmsMasterKeyId" in q["Properties"]
    for t in resources(raw, "AWS::DynamoDB::Table").values():
        assert t["Properties"]["SSESpecification"]["SSEEnabled"] is True
    for b in resources(raw, "AWS::S3::Bucket").values():
        assert b["Properties"]["BucketEncryption"]["ServerSideEncryptionConfiguration"]
        assert b["Properties"]["PublicAccessBlockConfiguration"] == {
            "BlockPublicAcls": True, "BlockPublicPolicy": True, "IgnorePublicAcls": True, "RestrictPublicBuckets": True,
        }
    for policy in resources(raw, "AWS::S3::BucketPolicy").values():
        assert any(
            s["Effect"] == "Deny" and s.get("Condition") == {"Bool": {"aws:SecureTransport": "false"}}
            for s in policy["Properties"]["PolicyDocument"]["Statement"]
        )
    for topic in resources(raw, "AWS::SNS::Topic").values():
        assert refs(topic["Properties"]["KmsMasterKeyId"])
    for key in resources(raw, "AWS::KMS::Key").values():
        assert key["Properties"]["EnableKeyRotation"] is True


def test_tasks_table_and_bucket_lifecycle(synth, backend):
    raw = synth.raw[backend]
    tables = list(resources(raw, "AWS::DynamoDB::Table").values())
    (tasks,) = [t for t in tables if t["Properties"]["KeySchema"][0]["AttributeName"] == "task_id"]
    (keys,) = [t for t in tables if t["Properties"]["KeySchema"][0]["AttributeName"] == "key_hash"]
    props = tasks["Properties"]
    assert props["BillingMode"] == "PAY_PER_REQUEST"
    assert props["PointInTimeRecoverySpecification"]["PointInTimeRecoveryEnabled"] is True
    assert props["TimeToLiveSpecification"] == {"AttributeName": "expires_at", "Enabled": True}
    assert keys["Properties"]["BillingMode"] == "PAY_PER_REQUEST"
    ttl_days = synth.config[backend].result_ttl_days
    (payloads,) = [b for b in resources(raw, "AWS::S3::Bucket").values()
                   if "payloads/" == b["Properties"].get("LoggingConfiguration", {}).get("LogFilePrefix")]
    expiries = {rule["Prefix"]: rule["ExpirationInDays"]
                for rule in payloads["Properties"]["LifecycleConfiguration"]["Rules"]}
    # A queued task's inputs must outlast its message's 14 days in SQS, or it fails unrun.
    assert expiries == {"inputs/": max(ttl_days, 14), "results/": ttl_days}


# ------------------------------------------------------------- observability


def test_dashboard_and_alarms(synth, backend):
    raw = synth.raw[backend]
    assert len(resources(raw, "AWS::CloudWatch::Dashboard")) == 1
    body = json.dumps(next(iter(resources(raw, "AWS::CloudWatch::Dashboard").values()))["Properties"]["DashboardBody"])
    for metric in (
        "ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesNotVisible", "ApproximateAgeOfOldestMessage",
        "5XXError", "4XXError", "Latency", "Throttles", "Errors", "Duration", "BatchSize", "InferenceLatency",
        "Throughput", "TasksSucceeded", "TaskAttemptsFailed",
        # Torch on a GPU emits these: the EKS workers, never the SageMaker dispatcher (a Lambda).
        *(("GpuUtilization", "GpuMemoryUsed") if backend == "eks" else ("Invocations", "ModelLatency")),
    ):
        assert metric in body, metric
    alarms = list(resources(raw, "AWS::CloudWatch::Alarm").values())
    (topic,) = resources(raw, "AWS::SNS::Topic")
    for alarm in alarms:
        assert refs(alarm["Properties"]["AlarmActions"]) == {topic}
    described = " ".join(a["Properties"]["AlarmDescription"] for a in alarms)
    for p in PRIORITIES:
        assert f"The {p} dead-letter queue" in described
        assert f"A {p} queue's oldest message has waited over" in described
    assert "5xx" in described and "p99 latency" in described
    dlq_alarms = [a for a in alarms if "dead-letter" in a["Properties"]["AlarmDescription"]]
    assert all(a["Properties"]["Threshold"] == 0 for a in dlq_alarms)
    assert all(a["Properties"]["ComparisonOperator"] == "GreaterThanThreshold" for a in dlq_alarms)
    for a in dlq_alarms:
        # Settling rounds hide DLQ messages while they read: hidden ones count too.
        names = {q["MetricStat"]["Metric"]["MetricName"] for q in a["Properties"]["Metrics"] if "MetricStat" in q}
        assert names == {"ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesNotVisible"}


def dashboard_widgets(raw: dict) -> list[dict]:
    """The dashboard's widgets' properties, each CloudFormation reference written <LogicalId>."""
    (dashboard,) = resources(raw, "AWS::CloudWatch::Dashboard").values()
    return [w["properties"] for w in json.loads(arn_text(dashboard["Properties"]["DashboardBody"]))["widgets"]]


def graphed(raw: dict) -> list[tuple[str, str, str, dict, dict]]:
    """(widget title, namespace, metric name, dimensions, options) of every metric a
    graph draws, math expressions' hidden inputs included; expressions themselves as
    (title, "", expression, {}, options)."""
    rows = []
    for widget in dashboard_widgets(raw):
        for row in widget.get("metrics", []):
            options = row[-1] if isinstance(row[-1], dict) else {}
            if "expression" in options:
                rows.append((widget["title"], "", options["expression"], {}, options))
                continue
            namespace, name, *dims = row[:-1] if isinstance(row[-1], dict) else row
            rows.append((widget["title"], namespace, name, dict(zip(dims[::2], dims[1::2])), options))
    return rows


POLL_ROUTE = "GET /v1/tasks/{task_id}"


def test_the_log_groups_the_services_create_expire_as_the_stacks_own_do(synth, backend):
    from cdk.log_retention import RETENTION_FUNCTION_ID

    # EKS (control-plane logging, the Container Insights add-on) and SageMaker
    # (the endpoint's container logs) create their log groups themselves, with
    # no retention: kept forever.
    raw = synth.raw[backend]
    functions = resources(raw, "AWS::Lambda::Function").values()
    (api,) = [f["Properties"] for f in functions if f["Properties"].get("Handler") == "lambdas.api.handler.handler"]
    (api_logs,) = refs(api["LoggingConfig"]["LogGroup"])
    retention = resources(raw, "AWS::Logs::LogGroup")[api_logs]["Properties"]["RetentionInDays"]
    assert retention == 30
    if backend == "eks":
        (cluster,) = resources(raw, "AWS::EKS::Cluster")  # Ref: the cluster's name
        # The control plane's, and Container Insights' (the worker logs among them).
        service_groups = {f"/aws/eks/<{cluster}>/cluster"} | {
            f"/aws/containerinsights/<{cluster}>/{kind}" for kind in ("application", "dataplane", "host", "performance")}
    else:
        (endpoint,) = resources(raw, "AWS::SageMaker::Endpoint")
        service_groups = {f"/aws/sagemaker/Endpoints/<{endpoint}.EndpointName>"}
    # API Gateway's execution logs (ERROR level), in the group it names after the API and stage.
    (rest_api,) = resources(raw, "AWS::ApiGateway::RestApi")
    (stage,) = resources(raw, "AWS::ApiGateway::Stage")
    service_groups.add(f"API-Gateway-Execution-Logs_<{rest_api}>/<{stage}>")
    # Lambda creates the group of a function that names none, with no retention:
    # aws-cdk-lib's own functions (the kubectl provider's two, CfnUtils').
    for name, function in resources(raw, "AWS::Lambda::Function").items():
        named = function["Properties"].get("LoggingConfig", {}).get("LogGroup")
        if named is not None:
            (group,) = refs(named)
            assert resources(raw, "AWS::Logs::LogGroup")[group]["Properties"]["RetentionInDays"] == retention
        elif not name.startswith(RETENTION_FUNCTION_ID):  # that one sets its own group's when it runs
            service_groups.add(f"/aws/lambda/<{name}>")
    # Set whether or not the service has created the group yet: a LogGroup of
    # the same name would fail on a stack whose service already made it.
    retained = {
        expression_text(r["Properties"]["LogGroupName"]): r["Properties"]["RetentionInDays"]
        for r in resources(raw, "Custom::LogRetention").values()
    }
    assert retained == dict.fromkeys(service_groups, retention)
    for group in resources(raw, "AWS::Logs::LogGroup").values():
        assert group["Properties"].get("RetentionInDays"), group


def test_the_dashboard_graphs_latency_per_route_as_the_alarms_watch_it(synth, backend):
    # A stage-wide p99 is the long polls' (up to 20 s by design): the dashboard shows
    # each submit route, with the very dimensions its alarm reads, and the poll apart.
    from cdk.api_construct import SUBMIT_ROUTES

    raw = synth.raw[backend]
    submit = {f"{method} {path}" for method, path in SUBMIT_ROUTES}
    assert submit | {POLL_ROUTE} <= {route for route, _ in method_paths(raw).values()}
    latency = [(title, dims, options) for title, ns, name, dims, options in graphed(raw)
               if (ns, name) == ("AWS/ApiGateway", "Latency")]
    for _, dims, _ in latency:
        assert set(dims) == {"ApiName", "Stage", "Resource", "Method"}, dims  # none stage-wide
    drawn = {(f"{dims['Method']} {dims['Resource']}", options["stat"]) for _, dims, options in latency}
    assert drawn == {(route, stat) for route in submit | {POLL_ROUTE} for stat in ("p50", "p99")}
    # The poll in a graph of its own: its 20 s would flatten the submit routes' lines.
    (poll_title,) = {title for title, dims, _ in latency if f"{dims['Method']} {dims['Resource']}" == POLL_ROUTE}
    assert {f"{d['Method']} {d['Resource']}" for t, d, _ in latency if t == poll_title} == {POLL_ROUTE}
    # Each latency alarm's metric, dimensions and period are graphed as they are.
    alarmed = 0
    for alarm in resources(raw, "AWS::CloudWatch::Alarm").values():
        props = alarm["Properties"]
        for namespace, name, dims in alarm_metrics(props):
            if (namespace, name) == ("AWS/ApiGateway", "Latency"):
                alarmed += 1
                dims = {k: arn_text(v) for k, v in dims.items()}
                assert any(d == dims and (o["stat"], o["period"]) == alarm_statistic(props)
                           for _, d, o in latency), dims
    assert alarmed == len(SUBMIT_ROUTES)


def test_the_sagemaker_endpoint_is_graphed_and_alarms_on_invocation_5xx(synth):
    raw = synth.raw["sagemaker"]
    (endpoint,) = resources(raw, "AWS::SageMaker::Endpoint")
    (endpoint_config,) = resources(raw, "AWS::SageMaker::EndpointConfig").values()
    (variant,) = endpoint_config["Properties"]["ProductionVariants"]
    dims = {"EndpointName": f"<{endpoint}>", "VariantName": variant["VariantName"]}
    assert dims["VariantName"] == "AllTraffic"
    rows = graphed(raw)
    sagemaker = {name for _, ns, name, d, _ in rows if ns == "AWS/SageMaker" and d == dims}
    assert sagemaker == {"Invocations", "Invocation5XXErrors", "ModelLatency", "OverheadLatency"}
    assert not [r for r in rows if r[1] == "AWS/SageMaker" and r[3] != dims]
    # The instances' own GPU figures stay.
    assert {"GPUUtilization", "GPUMemoryUtilization"} <= {
        name for _, ns, name, d, _ in rows if ns == "/aws/sagemaker/Endpoints" and d == dims}

    (topic,) = resources(raw, "AWS::SNS::Topic")
    (alarm,) = [a["Properties"] for a in resources(raw, "AWS::CloudWatch::Alarm").values()
                if any(name == "Invocation5XXErrors" for _, name, _ in alarm_metrics(a["Properties"]))]
    ((namespace, _, alarm_dims),) = alarm_metrics(alarm)
    assert namespace == "AWS/SageMaker"
    assert {k: arn_text(v) for k, v in alarm_dims.items()} == dims
    statistic, period = alarm_statistic(alarm)
    assert statistic == "Sum" and period >= 60
    assert (alarm["ComparisonOperator"], alarm["Threshold"]) == ("GreaterThanThreshold", 0)
    assert alarm["TreatMissingData"] == "notBreaching"
    assert refs(alarm["AlarmActions"]) == refs(alarm["OKActions"]) == {topic}


def test_gpu_series_are_graphed_only_where_they_are_emitted(synth, backend):
    # The workers' GPU figures come from torch in the worker process; on SageMaker
    # the Sluice metrics come from the dispatcher Lambda, which has no torch.
    rows = graphed(synth.raw[backend])
    worker_gpu = {name for _, ns, name, _, _ in rows if ns == "Sluice" and name.startswith("Gpu")}
    namespaces = {ns for _, ns, _, _, _ in rows}
    if backend == "eks":
        assert worker_gpu == {"GpuUtilization", "GpuMemoryUsed"}
        assert "ContainerInsights" in namespaces and "AWS/SageMaker" not in namespaces
    else:
        assert worker_gpu == set()
        assert "/aws/sagemaker/Endpoints" in namespaces


def test_each_dlq_alarms_on_growth_as_well_as_depth(synth, backend):
    # Dead letters of final tasks stay in the DLQ for operators: the depth alarm
    # stays in ALARM, so only an alarm on growth notifies of each later one.
    # (A redrive-policy move does not count in NumberOfMessagesSent.)
    raw = synth.raw[backend]
    (topic,) = resources(raw, "AWS::SNS::Topic")
    dlqs = [k for k, q in resources(raw, "AWS::SQS::Queue").items() if "RedrivePolicy" not in q["Properties"]]
    assert len(dlqs) == len(PRIORITIES)
    alarms = [a["Properties"] for a in resources(raw, "AWS::CloudWatch::Alarm").values()]
    assert not [a for a in alarms if any(name == "NumberOfMessagesSent" for _, name, _ in alarm_metrics(a))]
    for dlq in dlqs:
        on_dlq = [a for a in alarms if any(refs(d.get("QueueName")) == {dlq} for _, _, d in alarm_metrics(a))]
        kinds = {}
        for a in on_dlq:
            assert {name for _, name, _ in alarm_metrics(a)} == {
                "ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesNotVisible"}
            assert (a["ComparisonOperator"], a["Threshold"]) == ("GreaterThanThreshold", 0)
            assert a["TreatMissingData"] == "notBreaching"
            assert refs(a["AlarmActions"]) == refs(a["OKActions"]) == {topic}
            expressions = " ".join(q["Expression"] for q in a["Metrics"] if "Expression" in q)
            (returned,) = [q for q in a["Metrics"] if q.get("ReturnData", True)]
            growth = re.match(r"(DIFF|RATE)\(", returned["Expression"]) is not None
            kinds[growth] = kinds.get(growth, 0) + 1
            if growth:
                assert "+" in expressions  # of visible and hidden together
        assert kinds == {False: 1, True: 1}, (dlq, kinds)


def test_the_backlog_graph_shows_in_flight_messages_beside_the_visible_ones(synth, backend):
    # KEDA scales on visible and in-flight messages both.
    raw = synth.raw[backend]
    queues = [k for k, q in resources(raw, "AWS::SQS::Queue").items() if "RedrivePolicy" in q["Properties"]]
    drawn = {}
    for title, ns, name, dims, options in graphed(raw):
        if ns == "AWS/SQS" and options.get("visible", True) and dims.get("QueueName", "")[1:-1] in queues:
            drawn.setdefault(title, set()).add((name, dims["QueueName"][1:-1]))
    assert {(name, q) for name in ("ApproximateNumberOfMessagesVisible", "ApproximateNumberOfMessagesNotVisible")
            for q in queues} in drawn.values()


def test_every_graphed_metric_has_an_explicit_one_minute_period(synth, backend):
    # A metric without one falls back to the dashboard's 300 s beside the rest's 60 s.
    for title, _, name, _, options in graphed(synth.raw[backend]):
        assert options.get("period") == 60, (title, name)


# ----------------------------------------------------------------------- IAM


def policy_statements(raw: dict):
    for logical, res in raw["Resources"].items():
        if res["Type"] == "AWS::IAM::Policy":
            for s in res["Properties"]["PolicyDocument"]["Statement"]:
                yield logical, s
        if res["Type"] == "AWS::IAM::Role":
            for policy in res["Properties"].get("Policies", []):
                for s in policy["PolicyDocument"]["Statement"]:
                    yield logical, s


def test_data_grants_are_scoped_to_the_stacks_own_resources(synth, backend):
    raw = synth.raw[backend]
    own = {k for k, v in raw["Resources"].items() if v["Type"] in OWN_DATA_TYPES}
    checked = 0
    for logical, statement in policy_statements(raw):
        actions = as_list(statement["Action"])
        data = [a for a in actions if a.startswith(DATA_SERVICES) or a == "*"]
        if not data or statement["Effect"] != "Allow":
            continue
        checked += 1
        assert not any("*" in a for a in data), (logical, data)
        for resource in as_list(statement["Resource"]):
            assert resource != "*", (logical, data)
            assert refs(resource) and refs(resource) <= own, (logical, resource)
    assert checked >= 3


def test_no_wildcard_actions_on_data_services_anywhere(synth, backend):
    for logical, statement in policy_statements(synth.raw[backend]):
        for action in as_list(statement["Action"]):
            if action.startswith(DATA_SERVICES):
                assert "*" not in action, (logical, action)


# ----------------------------------------------------------------------- EKS


def manifests(raw: dict) -> str:
    return json.dumps(
        [r["Properties"]["Manifest"] for r in resources(raw, "Custom::AWSCDK-EKS-KubernetesResource").values()]
    )


def test_eks_gpu_nodegroup_and_worker_deployment(synth):
    raw = synth.raw["eks"]
    config = synth.config["eks"]
    groups = [g["Properties"] for g in resources(raw, "AWS::EKS::Nodegroup").values()]
    (gpu,) = [g for g in groups if "NVIDIA" in g["AmiType"]]
    assert gpu["InstanceTypes"] == list(config.gpu_instance_types)
    assert gpu["Taints"] == [{"Effect": "NO_SCHEDULE", "Key": "nvidia.com/gpu", "Value": "true"}]
    # What the Cluster Autoscaler reads to wait for a new node's GPUs rather than add another node.
    assert gpu["Labels"]["k8s.amazonaws.com/accelerator"] == "nvidia"
    text = manifests(raw)
    for kind in ("Namespace", "ServiceAccount", "Deployment", "PodDisruptionBudget", "ScaledObject", "TriggerAuthentication"):
        assert f'\\"kind\\":\\"{kind}\\"' in text, kind
    grace = int(re.search(r'terminationGracePeriodSeconds\\":(\d+)', text).group(1))
    assert grace > config.longest_batch_s
    assert re.search(r'minReplicaCount\\":0\b', text)
    assert text.count("aws-sqs-queue") == 3
    assert '\\"nvidia.com/gpu\\":\\"1\\"' in text
    assert "eks.amazonaws.com/role-arn" in text
    charts = resources(raw, "Custom::AWSCDK-EKS-HelmChart")
    assert {c["Properties"]["Chart"] for c in charts.values()} == {"keda", "cluster-autoscaler"}
    (system,) = [k for k, g in resources(raw, "AWS::EKS::Nodegroup").items() if "NVIDIA" not in g["Properties"]["AmiType"]]
    for chart in charts.values():  # their pods need somewhere to run before Helm's wait ends
        assert system in chart["DependsOn"]


def chart_values(chart: dict) -> dict:
    """A Helm chart's values as the stack passes them, CloudFormation references as "TOKEN"."""
    values = chart["Properties"]["Values"]
    parts = values["Fn::Join"][1] if isinstance(values, dict) else [values]
    return json.loads("".join(p if isinstance(p, str) else "TOKEN" for p in parts))


def test_eks_autoscalers_match_the_clusters_kubernetes_version(synth):
    # The Cluster Autoscaler supports only the Kubernetes minor it was built
    # for, and KEDA three minors per release: chart 9.46.6 (autoscaler 1.32)
    # and KEDA 2.17 (1.30-1.32) would run out of support on a 1.35 cluster.
    raw = synth.raw["eks"]
    config = synth.config["eks"]
    (cluster,) = resources(raw, "AWS::EKS::Cluster").values()
    assert cluster["Properties"]["Version"] == config.kubernetes_version
    charts = {c["Properties"]["Chart"]: c for c in resources(raw, "Custom::AWSCDK-EKS-HelmChart").values()}
    autoscaler = charts["cluster-autoscaler"]
    assert autoscaler["Properties"]["Version"] == config.cluster_autoscaler_chart_version
    assert chart_values(autoscaler)["image"]["tag"] == f"v{config.kubernetes_version}.0"
    assert charts["keda"]["Properties"]["Version"] == config.keda_chart_version
    assert (config.kubernetes_version, config.keda_chart_version, config.cluster_autoscaler_chart_version) == (
        "1.35", "2.21.0", "9.59.0")


def worker_deployment(raw: dict) -> dict:
    """The worker Deployment as the stack applies it, CloudFormation references as "TOKEN"."""
    for res in resources(raw, "Custom::AWSCDK-EKS-KubernetesResource").values():
        manifest = res["Properties"]["Manifest"]
        parts = manifest["Fn::Join"][1] if isinstance(manifest, dict) else [manifest]
        for document in json.loads("".join(p if isinstance(p, str) else "TOKEN" for p in parts)):
            if document["kind"] == "Deployment" and document["metadata"]["name"] == "sluice-worker":
                return document
    raise AssertionError("no worker Deployment")


def test_eks_workers_put_their_metrics_in_the_sluice_namespace(synth):
    # The observability add-on ships container logs, not EMF: a worker printing
    # its metrics would leave every worker graph on the dashboard blank.
    from cdk import access
    from sluice.worker.metrics import NAMESPACE

    raw = synth.raw["eks"]
    (container,) = worker_deployment(raw)["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["SLUICE_METRICS_SINK"] == "cloudwatch"

    (worker,) = [r for r in resources(raw, "AWS::IAM::Role") if "sqs:ReceiveMessage" in role_actions(raw, r)]
    puts = [s for res in resources(raw, "AWS::IAM::Policy").values() if worker in refs(res["Properties"]["Roles"])
            for s in res["Properties"]["PolicyDocument"]["Statement"]
            if "cloudwatch:PutMetricData" in as_list(s["Action"])]
    assert access.WORKER_METRICS == ["cloudwatch:PutMetricData"]
    assert puts == [{"Action": "cloudwatch:PutMetricData", "Effect": "Allow", "Resource": "*",
                     "Condition": {"StringEquals": {"cloudwatch:namespace": NAMESPACE}}}]
    assert NAMESPACE == "Sluice"


def test_eks_workers_give_up_a_hung_batch_after_twice_the_longest_batch(synth):
    # Without it a hung GPU held its messages for the worker's default 900 s,
    # where the stack is sized for batches of longest_batch_s (60 s).
    from cdk.config import SluiceConfig

    (container,) = worker_deployment(synth.raw["eks"])["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    config = SluiceConfig()
    assert env["SLUICE_INFERENCE_TIMEOUT_S"] == str(2 * config.longest_batch_s) == "120"
    assert int(env["SLUICE_INFERENCE_TIMEOUT_S"]) < int(env["SLUICE_VISIBILITY_TIMEOUT_S"])


def test_eks_cluster_is_private_and_logs_everything(synth):
    (cluster,) = resources(synth.raw["eks"], "AWS::EKS::Cluster").values()
    props = cluster["Properties"]
    assert props["ResourcesVpcConfig"]["EndpointPublicAccess"] is False
    assert props["ResourcesVpcConfig"]["EndpointPrivateAccess"] is True
    types = {t["Type"] for t in props["Logging"]["ClusterLogging"]["EnabledTypes"]}
    assert types == {"api", "audit", "authenticator", "controllerManager", "scheduler"}
    assert props["EncryptionConfig"][0]["Resources"] == ["secrets"]


def test_irsa_roles_trust_one_service_account_each(synth):
    raw = synth.raw["eks"]
    (oidc,) = resources(raw, "AWS::IAM::OIDCProvider")
    federated = [
        r for r in resources(raw, "AWS::IAM::Role").values()
        if any(refs(s["Principal"].get("Federated")) == {oidc} for s in r["Properties"]["AssumeRolePolicyDocument"]["Statement"])
    ]
    assert len(federated) == 4  # worker, KEDA, Cluster Autoscaler, CloudWatch agent
    for role in federated:
        (statement,) = role["Properties"]["AssumeRolePolicyDocument"]["Statement"]
        assert statement["Action"] == "sts:AssumeRoleWithWebIdentity"
        assert "StringEquals" in statement["Condition"]


# ----------------------------------------------------------------- SageMaker


def test_sagemaker_endpoint_autoscaling_and_dispatcher(synth):
    raw = synth.raw["sagemaker"]
    config = synth.config["sagemaker"]
    (model,) = resources(raw, "AWS::SageMaker::Model").values()
    assert model["Properties"]["EnableNetworkIsolation"] is True
    (endpoint_config,) = resources(raw, "AWS::SageMaker::EndpointConfig").values()
    (variant,) = endpoint_config["Properties"]["ProductionVariants"]
    assert variant["InstanceType"] == config.sagemaker_instance_type
    # SageMaker's default AMI for ml.g5 has NVIDIA driver 470: the image's CUDA 12 torch would find no GPU.
    assert variant["InferenceAmiVersion"] == config.sagemaker_inference_ami == "al2-ami-sagemaker-inference-gpu-3-1"
    (endpoint,) = resources(raw, "AWS::SageMaker::Endpoint").values()
    # An update keeps the instance count autoscaling reached.
    assert endpoint["Properties"]["RetainAllVariantProperties"] is True
    (target,) = resources(raw, "AWS::ApplicationAutoScaling::ScalableTarget").values()
    assert target["Properties"]["MinCapacity"] == config.min_instances
    assert target["Properties"]["MaxCapacity"] == config.max_instances
    assert target["Properties"]["ScalableDimension"] == "sagemaker:variant:DesiredInstanceCount"
    assert len(resources(raw, "AWS::ApplicationAutoScaling::ScalingPolicy")) == 1

    mappings = [m["Properties"] for m in resources(raw, "AWS::Lambda::EventSourceMapping").values()]
    assert len(mappings) == 3
    assert sorted(m["ScalingConfig"]["MaximumConcurrency"] for m in mappings) == sorted(
        config.dispatcher_max_concurrency.values()
    )
    for m in mappings:
        assert m["FunctionResponseTypes"] == ["ReportBatchItemFailures"]
        assert m["MaximumBatchingWindowInSeconds"] == config.dispatcher_batching_window_s
        assert m["BatchSize"] == config.dispatcher_batch_size
    # At worst one endpoint call per task, all at once: a batch takes one call's time.
    functions = resources(raw, "AWS::Lambda::Function").values()
    (dispatcher,) = [f["Properties"] for f in functions if "dispatcher" in f["Properties"].get("Handler", "")]
    env = dispatcher["Environment"]["Variables"]
    assert int(env["SLUICE_DISPATCH_CONCURRENCY"]) >= config.dispatcher_batch_size
    assert int(env["SLUICE_INVOKE_TIMEOUT_S"]) + 5 < dispatcher["Timeout"]
    # Its metrics' deployment dimension: the one the stack's dashboard reads.
    assert env["SLUICE_QUEUE_PREFIX"] == config.name_prefix
    # Never throttled while its event sources run at their most: a throttled
    # batch would spend a receive, which counts as an attempt.
    assert dispatcher["ReservedConcurrentExecutions"] == sum(config.dispatcher_max_concurrency.values())
    from cdk.config import SluiceConfig

    assert SluiceConfig(reserve_dispatcher_concurrency=False).dispatcher_reserved_concurrency is None
    # The endpoint's container makes no AWS call: its role may put SageMaker's own metrics only.
    (put_metrics,) = [s for _, s in policy_statements(raw) if "cloudwatch:PutMetricData" in as_list(s["Action"])
                      and "/aws/sagemaker/Endpoints" in json.dumps(s.get("Condition"))]
    assert put_metrics["Condition"] == {"StringEquals": {"cloudwatch:namespace": "/aws/sagemaker/Endpoints"}}

    invoke = [s for _, s in policy_statements(raw) if "sagemaker:InvokeEndpoint" in as_list(s["Action"])]
    (statement,) = invoke
    assert refs(statement["Resource"]) == set(resources(raw, "AWS::SageMaker::Endpoint"))


def test_the_endpoint_scales_out_on_calls_waiting_in_its_container(synth):
    raw = synth.raw["sagemaker"]
    config = synth.config["sagemaker"]
    (policy,) = resources(raw, "AWS::ApplicationAutoScaling::ScalingPolicy").values()
    tracking = policy["Properties"]["TargetTrackingScalingPolicyConfiguration"]
    # serve.py runs one call per model at a time: once a call takes longer than
    # 60 s / target, an invocations-per-minute target is never reached and the
    # endpoint never scales out. Calls held (running or waiting), every 10 s:
    assert tracking["PredefinedMetricSpecification"] == {
        "PredefinedMetricType": "SageMakerVariantConcurrentRequestsPerModelHighResolution"
    }
    assert tracking["TargetValue"] == config.concurrent_requests_per_instance
    # One call running and the next one waiting: past that, calls queue into
    # SageMaker's 60 s invocation timeout, and an instance is added.
    assert config.concurrent_requests_per_instance == 2
    assert (tracking["ScaleOutCooldown"], tracking["ScaleInCooldown"]) == (60, 300)
    (target,) = resources(raw, "AWS::ApplicationAutoScaling::ScalableTarget")
    assert refs(policy["Properties"]["ScalingTargetId"]) == {target}


def role_actions(raw: dict, role: str) -> set[str]:
    actions: set[str] = set()
    for res in resources(raw, "AWS::IAM::Policy").values():
        if role in refs(res["Properties"]["Roles"]):
            for s in res["Properties"]["PolicyDocument"]["Statement"]:
                actions |= {a for a in as_list(s["Action"]) if a.startswith(DATA_SERVICES)}
    return actions


def function_role(raw: dict, handler: str) -> str:
    (fn,) = [f for f in resources(raw, "AWS::Lambda::Function").values() if f["Properties"].get("Handler") == handler]
    (role,) = refs(fn["Properties"]["Role"])
    return role


def test_each_principal_gets_exactly_its_data_actions(synth, backend):
    from cdk import access

    raw = synth.raw[backend]
    api = role_actions(raw, function_role(raw, "lambdas.api.handler.handler"))
    assert api == set(access.API_TASKS + access.API_OBJECTS + access.API_BUCKET + access.API_QUEUES)
    worker_data = set(access.WORKER_TASKS + access.WORKER_OBJECTS + access.WORKER_RESULTS + access.WORKER_BUCKET)
    settling = set(access.SETTLE_TASKS + access.SETTLE_QUEUES + access.SETTLE_DLQS)
    if backend == "sagemaker":
        settler = role_actions(raw, function_role(raw, "lambdas.settler.handler.handler"))
        assert settler == settling
        dispatcher = role_actions(raw, function_role(raw, "lambdas.dispatcher.handler.handler"))
        # Plus what the SQS event source mapping needs to poll (granted by CDK).
        assert worker_data | set(access.DEAD_LETTER_DLQS) <= dispatcher
        assert dispatcher - worker_data - set(access.DEAD_LETTER_DLQS) <= {
            "sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:ChangeMessageVisibility",
            "sqs:GetQueueAttributes", "sqs:GetQueueUrl",
        }
    else:
        consumers = [r for r in resources(raw, "AWS::IAM::Role") if "sqs:ReceiveMessage" in role_actions(raw, r)]
        (worker,) = consumers
        assert role_actions(raw, worker) == (worker_data | set(access.WORKER_QUEUES) | settling
                                             | set(access.DEAD_LETTER_DLQS))


def test_only_settling_and_dead_lettering_reach_the_dead_letter_queues(synth, backend):
    """The DLQs' actions go to the DLQs alone, and only settlers and the
    workers that fail tasks (sending a message SQS would not move) get any."""
    from cdk import access

    raw = synth.raw[backend]
    dlqs = {r for r, q in resources(raw, "AWS::SQS::Queue").items() if q["Properties"]["QueueName"].endswith("-dlq")}
    on_dlqs: set[str] = set()
    for _, statement in policy_statements(raw):
        targets = refs(statement["Resource"])
        if targets & dlqs:
            assert targets <= dlqs, statement
            on_dlqs |= set(as_list(statement["Action"]))
    assert on_dlqs == set(access.SETTLE_DLQS + access.DEAD_LETTER_DLQS)


def test_the_dispatcher_can_find_and_reach_the_dead_letter_queues(synth):
    """A requeued task's message, failed or spent below maxReceiveCount, is sent
    to its DLQ by the dispatcher: the DLQ's URL comes from the queue's redrive
    policy (GetQueueAttributes on each queue, which its event source grants),
    then GetQueueUrl and SendMessage on each DLQ."""
    from cdk import access

    raw = synth.raw["sagemaker"]
    role = function_role(raw, "lambdas.dispatcher.handler.handler")
    queues = resources(raw, "AWS::SQS::Queue")
    dlqs = {r for r, q in queues.items() if q["Properties"]["QueueName"].endswith("-dlq")}
    granted: dict[str, set[str]] = {}
    for logical, statement in policy_statements(raw):
        if role in refs(raw["Resources"][logical]["Properties"].get("Roles", [])):
            for action in as_list(statement["Action"]):
                granted.setdefault(action, set()).update(refs(statement["Resource"]))
    assert granted["sqs:GetQueueAttributes"] >= set(queues) - dlqs
    for action in access.DEAD_LETTER_DLQS:
        assert granted[action] >= dlqs, action


def test_the_sagemaker_backend_settles_on_a_schedule(synth):
    raw = synth.raw["sagemaker"]
    (rule,) = resources(raw, "AWS::Events::Rule").values()
    assert rule["Properties"]["ScheduleExpression"] == "rate(1 minute)"
    (target,) = rule["Properties"]["Targets"]
    (fn,) = refs(target["Arn"])
    assert resources(raw, "AWS::Lambda::Function")[fn]["Properties"]["Handler"] == "lambdas.settler.handler.handler"


# ------------------------------------------------- alarm delivery and scope


def alarm_metrics(props: dict) -> list[tuple[str, str, dict]]:
    """(namespace, name, dimensions) of each metric an alarm reads, in either of its forms."""
    stats = [q["MetricStat"]["Metric"] for q in props.get("Metrics", []) if "MetricStat" in q]
    if "MetricName" in props:
        stats.append(props)
    return [(m["Namespace"], m["MetricName"], {d["Name"]: d["Value"] for d in m.get("Dimensions", [])}) for m in stats]


def alarm_statistic(props: dict) -> tuple[str, int]:
    """(statistic, period) of an alarm on one metric, in either of its forms."""
    if "MetricName" in props:
        return props.get("Statistic") or props["ExtendedStatistic"], props["Period"]
    (query,) = props["Metrics"]
    return query["MetricStat"]["Stat"], query["MetricStat"]["Period"]


def test_cloudwatch_may_publish_the_alarms_to_the_topic(synth, backend):
    # The topic's own policy (enforce_ssl) replaces SNS's default one, which let
    # the account's principals publish: CloudWatch needs a statement of its own.
    raw = synth.raw[backend]
    (topic,) = resources(raw, "AWS::SNS::Topic")
    (policy,) = resources(raw, "AWS::SNS::TopicPolicy").values()
    assert refs(policy["Properties"]["Topics"]) == {topic}
    account = {"Ref": "AWS::AccountId"}
    (allow,) = [s for s in policy["Properties"]["PolicyDocument"]["Statement"] if s["Effect"] == "Allow"]
    assert allow["Principal"] == {"Service": "cloudwatch.amazonaws.com"}
    assert as_list(allow["Action"]) == ["sns:Publish"]
    assert refs(allow["Resource"]) == {topic}
    assert allow["Condition"] == {
        "StringEquals": {"aws:SourceAccount": account},
        "ArnLike": {"aws:SourceArn": {"Fn::Join": ["", [
            "arn:", {"Ref": "AWS::Partition"}, ":cloudwatch:", {"Ref": "AWS::Region"}, ":", account, ":alarm:*",
        ]]}},
    }
    # ... and to use the topic's key, on behalf of this account only.
    (key,) = refs(resources(raw, "AWS::SNS::Topic")[topic]["Properties"]["KmsMasterKeyId"])
    statements = resources(raw, "AWS::KMS::Key")[key]["Properties"]["KeyPolicy"]["Statement"]
    (for_cloudwatch,) = [s for s in statements if s["Principal"] == {"Service": "cloudwatch.amazonaws.com"}]
    assert for_cloudwatch["Condition"] == {"StringEquals": {"aws:SourceAccount": account}}


def test_the_latency_alarms_watch_the_submit_routes_not_the_long_polls(synth, backend):
    # GET /v1/tasks/{id}?wait_s=N holds up to 20 s by design: a stage-wide p99 would always be over.
    raw = synth.raw[backend]
    (api_name,) = [a["Properties"]["Name"] for a in resources(raw, "AWS::ApiGateway::RestApi").values()]
    ((stage, stage_res),) = resources(raw, "AWS::ApiGateway::Stage").items()
    # Per-method metrics exist where the stage's method settings enable them: here, every method.
    assert any(
        s["HttpMethod"] == "*" and s["ResourcePath"] == "/*" and s["MetricsEnabled"] is True
        for s in stage_res["Properties"]["MethodSettings"]
    )
    watched = set()
    for alarm in resources(raw, "AWS::CloudWatch::Alarm").values():
        for namespace, name, dims in alarm_metrics(alarm["Properties"]):
            if (namespace, name) == ("AWS/ApiGateway", "Latency"):
                assert set(dims) == {"ApiName", "Stage", "Resource", "Method"}, dims
                assert dims["ApiName"] == api_name and refs(dims["Stage"]) == {stage}
                watched.add(f"{dims['Method']} {dims['Resource']}")
    assert watched == {"POST /v1/tasks", "POST /v1/tasks/batch"}
    assert watched <= {route for route, _ in method_paths(raw).values()}


def test_the_settler_alarms_on_its_errors_and_is_graphed_beside_the_dispatcher(synth):
    raw = synth.raw["sagemaker"]
    functions = resources(raw, "AWS::Lambda::Function")
    (settler,) = [k for k, f in functions.items() if f["Properties"].get("Handler") == "lambdas.settler.handler.handler"]
    (dispatcher,) = [k for k, f in functions.items()
                     if f["Properties"].get("Handler") == "lambdas.dispatcher.handler.handler"]
    (topic,) = resources(raw, "AWS::SNS::Topic")
    (alarm,) = [a["Properties"] for a in resources(raw, "AWS::CloudWatch::Alarm").values()
                if ("AWS/Lambda", "Errors", {"FunctionName": {"Ref": settler}}) in alarm_metrics(a["Properties"])]
    # At least one error in each of 3 five-minute periods running; no runs, no alarm.
    assert (alarm["Statistic"], alarm["Period"]) == ("Sum", 300)
    assert (alarm["ComparisonOperator"], alarm["Threshold"]) == ("GreaterThanThreshold", 0)
    assert alarm["EvaluationPeriods"] == alarm.get("DatapointsToAlarm", 3) == 3
    assert alarm["TreatMissingData"] == "notBreaching"
    assert refs(alarm["AlarmActions"]) == refs(alarm["OKActions"]) == {topic}
    (dashboard,) = resources(raw, "AWS::CloudWatch::Dashboard").values()
    assert {settler, dispatcher} <= refs(dashboard["Properties"]["DashboardBody"])


# ------------------------------------------------------- payload prefixes


def arn_text(value) -> str:
    """An ARN expression as text, each resource attribute written <LogicalId>."""
    if isinstance(value, str):
        return value
    if "Fn::GetAtt" in value:
        return f"<{value['Fn::GetAtt'][0]}>"
    if "Fn::Join" in value:
        return value["Fn::Join"][0].join(arn_text(part) for part in value["Fn::Join"][1])
    if "Ref" in value:
        return f"<{value['Ref']}>"
    raise AssertionError(f"unexpected ARN expression {value}")


def s3_grants(raw: dict) -> dict[str, dict[str, set[str]]]:
    """{role: {S3 action: resources}} over every role's policies."""
    grants: dict[str, dict[str, set[str]]] = {}
    for res in resources(raw, "AWS::IAM::Policy").values():
        for s in res["Properties"]["PolicyDocument"]["Statement"]:
            actions = [a for a in as_list(s["Action"]) if a.startswith("s3:")]
            if not actions or s["Effect"] != "Allow":
                continue
            for role in refs(res["Properties"]["Roles"]):
                for a in actions:
                    grants.setdefault(role, {}).setdefault(a, set()).update(arn_text(r) for r in as_list(s["Resource"]))
    return grants


def test_payload_grants_are_scoped_to_the_prefixes_each_principal_uses(synth, backend):
    # The API (internet-facing) writes claim-checked inputs (deleting those of a
    # submit it refused or rolled back) and signs result URLs;
    # workers read inputs and write (or delete their own) results. Nobody else
    # touches the bucket, and nobody gets an action on the other prefix.
    from sluice.contract import INPUTS_PREFIX, RESULTS_PREFIX

    raw = synth.raw[backend]
    functions = resources(raw, "AWS::Lambda::Function").values()
    (api_fn,) = [f for f in functions if f["Properties"].get("Handler") == "lambdas.api.handler.handler"]
    (bucket,) = refs(api_fn["Properties"]["Environment"]["Variables"]["SLUICE_BUCKET"])
    inputs, results = f"<{bucket}>/{INPUTS_PREFIX}*", f"<{bucket}>/{RESULTS_PREFIX}*"
    api = function_role(raw, "lambdas.api.handler.handler")
    if backend == "sagemaker":
        worker = function_role(raw, "lambdas.dispatcher.handler.handler")
    else:
        (worker,) = [r for r in resources(raw, "AWS::IAM::Role") if "sqs:ReceiveMessage" in role_actions(raw, r)]
    assert s3_grants(raw) == {
        api: {"s3:PutObject": {inputs}, "s3:DeleteObject": {inputs}, "s3:GetObject": {results},
              "s3:ListBucket": {f"<{bucket}>"}},
        worker: {
            "s3:GetObject": {inputs},
            "s3:PutObject": {results},
            "s3:DeleteObject": {results},
            "s3:ListBucket": {f"<{bucket}>"},
        },
    }


def test_the_eks_worker_rollout_replaces_pods_in_place(synth):
    """At max_workers every GPU node may be taken and the autoscaler stops at
    max_nodes: a surge pod would never schedule and the rollout would stall."""
    strategy = worker_deployment(synth.raw["eks"])["spec"]["strategy"]
    assert strategy == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}}


def test_the_stack_synthesizes_without_the_web_acl_when_told_to(tmp_path):
    # -c sluice.waf=false, as docs/deploy.md shows it: cdk-nag's finding on a
    # stage without a web ACL is acknowledged as the configuration's choice.
    from cdk.build import build_app, new_app

    image = tmp_path / "image"
    (image / "containers" / "worker").mkdir(parents=True)
    (image / "containers" / "worker" / "Dockerfile").write_text("FROM scratch\n")
    app = new_app(context={"sluice.image_directory": str(image), "sluice.backends": "eks", "sluice.waf": "false"},
                  outdir=str(tmp_path / "out"))
    app, stacks = build_app(app)
    template = app.synth().get_stack_by_name(stacks["eks"].stack_name).template
    assert resources(template, "AWS::WAFv2::WebACL") == {}
    assert resources(template, "AWS::ApiGateway::Stage")


def test_another_instance_type_brings_a_new_endpoint_rather_than_updating_the_scaled_one(synth, tmp_path):
    # SageMaker refuses to update an endpoint whose variant is an autoscaling
    # target to another instance type: the stack's update would fail and roll
    # back. A new endpoint (and scaling target) is made instead, then the old removed.
    from cdk.build import build_app, new_app

    image = tmp_path / "image"
    (image / "containers" / "worker").mkdir(parents=True)
    (image / "containers" / "worker" / "Dockerfile").write_text("FROM scratch\n")
    app = new_app(context={"sluice.image_directory": str(image), "sluice.backends": "sagemaker",
                           "sluice.sagemaker_instance_type": "ml.g6.2xlarge"}, outdir=str(tmp_path / "out"))
    app, stacks = build_app(app)
    other = app.synth().get_stack_by_name(stacks["sagemaker"].stack_name).template

    def logical_ids(template, type_):
        return set(resources(template, type_))

    for type_ in ("AWS::SageMaker::Endpoint", "AWS::ApplicationAutoScaling::ScalableTarget"):
        before, after = logical_ids(synth.raw["sagemaker"], type_), logical_ids(other, type_)
        assert len(before) == len(after) == 1 and before != after, type_
    # The default type keeps the id of stacks deployed before: an upgrade replaces no endpoint.
    assert logical_ids(synth.raw["sagemaker"], "AWS::SageMaker::Endpoint") == {"WorkersEndpointF46CFCAD"}
    # Nothing else is replaced by it but what names the endpoint.
    assert logical_ids(synth.raw["sagemaker"], "AWS::SageMaker::Model") == logical_ids(other, "AWS::SageMaker::Model")
