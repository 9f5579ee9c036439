"""API Gateway REST API in front of the FastAPI app (Lambda + Mangum).

API Gateway checks the key, throttles per usage plan and validates bodies
against JSON schemas generated from sluice.contract; the app then trusts
requestContext.identity.apiKeyId as the tenant (SLUICE_AUTH_MODE=apigateway).
"""

from __future__ import annotations

import json
from typing import Any

from aws_cdk import Duration, RemovalPolicy, Stack
from aws_cdk import aws_apigateway as apigw
from aws_cdk import aws_logs as logs
from aws_cdk import aws_wafv2 as wafv2
from constructs import Construct
from pydantic import BaseModel

from cdk import access
from cdk.config import SluiceConfig
from cdk.functions import LambdaCode, PythonFunction
from cdk.log_retention import expire_service_log_group
from cdk.queues_construct import Queues
from cdk.storage_construct import Storage
from sluice.api.errors import ApiError, unavailable
from sluice.contract import BatchSubmitRequest, ErrorDetail, SubmitRequest
from sluice.settings import Settings

HEALTH_PATH = "/health"
# The routes that answer at once (the API's latency alarms watch these; a
# GET /v1/tasks/{id}?wait_s=N long poll takes up to 20 s by design).
SUBMIT_ROUTES = (("POST", "/v1/tasks"), ("POST", "/v1/tasks/batch"))

# The app's own body limit (SLUICE_MAX_BODY_BYTES), set on the function and
# enforced ahead of it by the WAF. API Gateway takes bodies up to 10 MB but a
# Lambda invoke at most 6 MB, the event included (the body as a JSON string,
# its quotes, backslashes and perhaps non-ASCII escaped: at most 3x for a body
# that is valid JSON; beside headers and context): 1 MiB leaves that room, so
# a body the WAF lets through the function can take.
MAX_BODY_BYTES: int = Settings.model_fields["max_body_bytes"].default

# API Gateway's own refusals, in the same error shape the app uses: type ->
# (status, or None to keep the gateway's own; code; message, or None for the
# gateway's own; Retry-After seconds, or None).
_GatewayError = tuple[str | None, str, str | None, int | None]
_UNAVAILABLE = unavailable("the API")  # what the app answers when a dependency fails
_GATEWAY_ERRORS: dict[apigw.ResponseType, _GatewayError] = {
    apigw.ResponseType.BAD_REQUEST_PARAMETERS: ("422", "validation_error", None, None),
    # No IAM auth is in use, so this is API Gateway's answer for a method or
    # path it does not serve: the app's 404 rather than "forbidden", which a
    # client would take for a bad key (README: treat 401 and 403 alike).
    apigw.ResponseType.MISSING_AUTHENTICATION_TOKEN: ("404", "not_found", "no such route: check the method and the path",
                                                      None),
    apigw.ResponseType.INVALID_API_KEY: ("403", "forbidden", None, None),
    apigw.ResponseType.ACCESS_DENIED: ("403", "forbidden", None, None),
    # A usage plan's rate refills its bucket every second. An exhausted quota
    # waits for the plan's period to end: no fixed Retry-After can say when.
    apigw.ResponseType.THROTTLED: ("429", "rate_limited", None, 1),
    apigw.ResponseType.QUOTA_EXCEEDED: ("429", "quota_exceeded", None, None),
    apigw.ResponseType.REQUEST_TOO_LARGE: ("413", "payload_too_large", None, None),
    # The managed known-bad-inputs rules (a Log4j lookup in a body, say): a
    # code of its own, so that a refused input does not read as a bad key.
    apigw.ResponseType.WAF_FILTERED: ("403", "request_blocked", "the request matched a rule of the API's web ACL",
                                      None),
    # The function did not answer within the integration's 29 s, or Lambda
    # refused the invoke (throttled; an event over its 6 MB) or the function
    # failed (a crash, its own timeout): the app's answer when a dependency
    # fails, since the request may or may not have been recorded and a retry
    # with the same Idempotency-Key resumes it. (503, not the gateway's
    # 500/502/504: the status the contract documents for this code; the access
    # log keeps the gateway's responseType and the integration's error.)
    apigw.ResponseType.INTEGRATION_TIMEOUT: (
        str(_UNAVAILABLE.status), _UNAVAILABLE.code, _UNAVAILABLE.message, int(_UNAVAILABLE.headers["Retry-After"])),
    apigw.ResponseType.INTEGRATION_FAILURE: (
        str(_UNAVAILABLE.status), _UNAVAILABLE.code, _UNAVAILABLE.message, int(_UNAVAILABLE.headers["Retry-After"])),
    # Any other 5xx or 4xx the gateway makes: the app's shape, each keeping its
    # own status (a status here would replace all of theirs).
    apigw.ResponseType.DEFAULT_5_XX: (
        None, "internal_error", "the request failed unexpectedly; it is safe to retry", 5),
    apigw.ResponseType.DEFAULT_4_XX: (None, "http_error", None, None),
}


def _error_template(code: str, message: str | None) -> str:
    if message is None:  # the gateway's own, already a quoted JSON string
        return '{"error":{"code":"%s","message":$context.error.messageString,"details":[]}}' % code
    template = json.dumps(ApiError(0, code, message).body(), separators=(",", ":"))
    assert "$" not in template and "#" not in template  # nothing a mapping template would evaluate
    return template


# The WAF counts an address's requests over a sliding 5 minutes and re-checks
# it about every 30 s (AWS's rate-based rule): the wait before a retry may pass.
_WAF_RETRY_AFTER_S = 30


def _too_large_body(max_bytes: int) -> str:
    """The app's 413 for a body over max_bytes (sluice.api.app.BodyLimit), word for word."""
    err = ApiError(413, "payload_too_large", f"request body is over {max_bytes} bytes",
                   [ErrorDetail(field="body", rule=f"at most {max_bytes} bytes")])
    return json.dumps(err.body(), separators=(",", ":"))


def decimal_over(limit: int) -> str:
    """A regex (PCRE, as WAF takes it: no capturing groups) matching a decimal
    number greater than limit, leading zeros allowed, and nothing else.

    A WAF size constraint on a header measures the value's length, not the
    number it spells, so a Content-Length over the limit is matched by its digits."""
    digits = str(limit)
    branches = [f"[1-9][0-9]{{{len(digits)},}}"]  # more digits than the limit has
    for i, d in enumerate(map(int, digits)):  # the same prefix, then a larger digit
        if d < 9:
            rest = len(digits) - i - 1
            tail = "" if rest == 0 else "[0-9]" if rest == 1 else f"[0-9]{{{rest}}}"
            branches.append(digits[:i] + (f"[{d + 1}-9]" if d < 8 else "9") + tail)
    return "^0*(?:" + "|".join(branches) + ")$"


class Api(Construct):
    def __init__(
        self,
        scope: Construct,
        id: str,
        *,
        config: SluiceConfig,
        code: LambdaCode,
        storage: Storage,
        queues: Queues,
    ) -> None:
        super().__init__(scope, id)

        self.handler = PythonFunction(
            self,
            "Handler",
            code=code,
            handler="lambdas.api.handler.handler",
            description="Sluice API: the FastAPI app through Mangum",
            timeout=Duration.seconds(29),  # API Gateway's integration limit
            memory_mb=config.api_memory_mb,
            environment={
                "SLUICE_AUTH_MODE": "apigateway",
                "SLUICE_TASKS_TABLE": storage.tasks.table_name,
                "SLUICE_KEYS_TABLE": storage.keys.table_name,
                "SLUICE_BUCKET": storage.bucket.bucket_name,
                "SLUICE_QUEUE_PREFIX": config.name_prefix,
                "SLUICE_MODELS": config.models,
                **config.lifecycle_env,
                "SLUICE_RATE_LIMIT_PER_S": "0",  # usage plans throttle on AWS
                "SLUICE_MAX_BODY_BYTES": str(MAX_BODY_BYTES),  # the WAF refuses the same bodies ahead of it
                **queues.env(),
            },
        )
        fn = self.handler.function
        storage.grant_tasks(fn, access.API_TASKS)
        storage.grant_inputs(fn, access.API_INPUTS)
        storage.grant_results(fn, access.API_RESULTS)
        storage.grant_bucket(fn, access.API_BUCKET)
        queues.grant(fn, access.API_QUEUES)

        self.access_logs = logs.LogGroup(
            self, "AccessLogs", retention=logs.RetentionDays.ONE_YEAR, removal_policy=RemovalPolicy.RETAIN
        )
        self.api = apigw.RestApi(
            self,
            "RestApi",
            rest_api_name=f"{config.name_prefix}-api",
            description="Sluice asynchronous inference API",
            endpoint_types=[apigw.EndpointType.REGIONAL],
            api_key_source_type=apigw.ApiKeySourceType.HEADER,
            cloud_watch_role=True,
            # The account-wide API Gateway logging role outlives this stack: other
            # APIs in the account may rely on it.
            cloud_watch_role_removal_policy=RemovalPolicy.RETAIN,
            deploy_options=apigw.StageOptions(
                stage_name=config.stage_name,
                tracing_enabled=True,
                metrics_enabled=True,
                logging_level=apigw.MethodLoggingLevel.ERROR,
                data_trace_enabled=False,  # bodies hold customer data
                access_log_destination=apigw.LogGroupLogDestination(self.access_logs),
                access_log_format=apigw.AccessLogFormat.custom(json.dumps(_ACCESS_LOG)),
                # A stage-wide ceiling over all keys together; each key is held to
                # its usage plan's (much lower) rate.
                throttling_rate_limit=max(p.rate_per_s for p in config.usage_plans) * 10,
                throttling_burst_limit=max(p.burst for p in config.usage_plans) * 10,
            ),
        )
        self.stage = self.api.deployment_stage
        # ERROR-level execution logging makes API Gateway create this group
        # itself, with no retention.
        expire_service_log_group(
            self, "ExecutionLogRetention",
            log_group_name=f"API-Gateway-Execution-Logs_{self.api.rest_api_id}/{self.stage.stage_name}",
        )

        integration = apigw.LambdaIntegration(fn, proxy=True)
        # Bodies are validated by the app, not here: the gateway's refusal can
        # only say "Invalid request body" (its template cannot carry the JSON
        # schema's message safely), where the app answers as in every profile,
        # naming the field and the rule (and 400 for JSON that does not parse).
        # The request models stay, as the API's published schema of its bodies.
        params_validator = self.api.add_request_validator(
            "ParamsOnly", validate_request_body=False, validate_request_parameters=True
        )
        submit_model = self._model("SubmitRequest", SubmitRequest)
        batch_model = self._model("BatchSubmitRequest", BatchSubmitRequest)
        idempotency = {"method.request.header.Idempotency-Key": False}

        def method(resource: apigw.IResource, verb: str, *, key: bool = True, model=None, params=None):
            return resource.add_method(
                verb,
                integration,
                api_key_required=key,
                request_validator=params_validator,
                request_models={"application/json": model} if model else None,
                request_parameters=params,
            )

        root = self.api.root
        method(root.add_resource("health"), "GET", key=False)  # the only route without a key
        method(root.add_resource("ready"), "GET")
        v1 = root.add_resource("v1")
        method(v1.add_resource("models"), "GET")
        tasks = v1.add_resource("tasks")
        method(tasks, "POST", model=submit_model, params=idempotency)
        method(tasks.add_resource("batch"), "POST", model=batch_model, params=idempotency)
        task = tasks.add_resource("{task_id}")
        task_param = {"method.request.path.task_id": True}
        method(task, "GET", params=task_param)
        method(task, "DELETE", params=task_param)

        for response_type, (status, code_name, message, retry_after_s) in _GATEWAY_ERRORS.items():
            self.api.add_gateway_response(
                f"Gw{response_type.response_type}",
                type=response_type,
                status_code=status,
                templates={"application/json": _error_template(code_name, message)},
                response_headers={"Retry-After": f"'{retry_after_s}'"} if retry_after_s is not None else None,
            )

        self.usage_plans = []
        for plan in config.usage_plans:
            self.usage_plans.append(
                self.api.add_usage_plan(
                    f"Plan{plan.name.title()}",
                    name=f"{config.name_prefix}-{plan.name}",
                    throttle=apigw.ThrottleSettings(rate_limit=plan.rate_per_s, burst_limit=plan.burst),
                    quota=apigw.QuotaSettings(limit=plan.quota_per_day, period=apigw.Period.DAY),
                    api_stages=[apigw.UsagePlanPerApiStage(api=self.api, stage=self.stage)],
                )
            )

        if config.waf:
            self._waf(config)

    def _model(self, name: str, model: type[BaseModel]) -> apigw.Model:
        return self.api.add_model(
            name,
            model_name=name,
            content_type="application/json",
            schema=json_schema(model.model_json_schema()),
        )

    def _waf(self, config: SluiceConfig) -> None:
        """Managed bad-input rules, a per-IP rate cap ahead of the usage plans, and
        the app's body limit on the declared Content-Length.

        The last answers exactly as the app would (413 payload_too_large, its
        body word for word; a WAF custom response takes precedence over the
        WAF_FILTERED gateway response), so a body API Gateway accepts (up to
        10 MB) but a Lambda invoke could not carry (6 MB) never reaches the
        function. WAF inspects at most the first 16 KB of a body (64 KB at extra
        cost), so the rule matches the header, not the body. A body sent without
        a Content-Length (chunked), if API Gateway takes one, passes it: up to
        Lambda's 6 MB the app's own 413 answers, past it the invoke fails and the
        client gets the gateway's 503 dependency_unavailable (10 MB: the
        gateway's 413)."""

        def rule(name: str, priority: int, statement: dict, *, managed: bool, block: dict | None = None) -> dict:
            extra = {"overrideAction": {"none": {}}} if managed else {"action": {"block": block or {}}}
            return {
                "name": name,
                "priority": priority,
                "statement": statement,
                "visibilityConfig": {
                    "cloudWatchMetricsEnabled": True,
                    "metricName": name,
                    "sampledRequestsEnabled": True,
                },
                **extra,
            }

        acl = wafv2.CfnWebACL(
            self,
            "WebAcl",
            scope="REGIONAL",
            default_action={"allow": {}},
            visibility_config={
                "cloudWatchMetricsEnabled": True,
                "metricName": f"{config.name_prefix}-api",
                "sampledRequestsEnabled": True,
            },
            rules=[
                rule(
                    "KnownBadInputs",
                    0,
                    {"managedRuleGroupStatement": {"vendorName": "AWS", "name": "AWSManagedRulesKnownBadInputsRuleSet"}},
                    managed=True,
                ),
                # Answered as the app answers a key over its rate: a 403 (the
                # WAF's default) would read as a bad key, and go unretried.
                rule(
                    "RatePerIp",
                    1,
                    {"rateBasedStatement": {"limit": config.waf_rate_limit_per_5min, "aggregateKeyType": "IP"}},
                    managed=False,
                    block={"customResponse": {
                        "responseCode": 429, "customResponseBodyKey": "rate_limited",
                        "responseHeaders": [{"name": "Retry-After", "value": str(_WAF_RETRY_AFTER_S)}]}},
                ),
                # After the rate cap, so that a flood of large bodies still counts against it.
                rule(
                    "BodyOverLimit",
                    2,
                    {
                        "regexMatchStatement": {
                            "regexString": decimal_over(MAX_BODY_BYTES),
                            # singleHeader is untyped in CDK: its keys go out as written (CloudFormation's "Name").
                            "fieldToMatch": {"singleHeader": {"Name": "content-length"}},
                            "textTransformations": [{"priority": 0, "type": "NONE"}],
                        }
                    },
                    managed=False,
                    block={"customResponse": {"responseCode": 413, "customResponseBodyKey": "payload_too_large"}},
                ),
            ],
            custom_response_bodies={
                "payload_too_large": {"contentType": "APPLICATION_JSON", "content": _too_large_body(MAX_BODY_BYTES)},
                "rate_limited": {"contentType": "APPLICATION_JSON", "content": json.dumps(ApiError(
                    429, "rate_limited", "too many requests from this address").body(), separators=(",", ":"))},
            },
        )
        stage_arn = Stack.of(self).format_arn(
            service="apigateway",
            account="",
            resource="/restapis",
            resource_name=f"{self.api.rest_api_id}/stages/{self.stage.stage_name}",
        )
        wafv2.CfnWebACLAssociation(self, "WebAclAssociation", resource_arn=stage_arn, web_acl_arn=acl.attr_arn)


_ACCESS_LOG = {
    "requestId": "$context.requestId",
    "apiKeyId": "$context.identity.apiKeyId",
    "ip": "$context.identity.sourceIp",
    "method": "$context.httpMethod",
    "resource": "$context.resourcePath",
    "path": "$context.path",
    "status": "$context.status",
    "latencyMs": "$context.responseLatency",
    "integrationLatencyMs": "$context.integrationLatency",
    "responseLength": "$context.responseLength",
    "error": "$context.error.message",
    "errorType": "$context.error.responseType",  # e.g. INTEGRATION_FAILURE, answered as 503 in the app's shape
    "integrationError": "$context.integration.error",
    "validationError": "$context.error.validationErrorString",
    "xrayTraceId": "$context.xrayTraceId",
    "requestTime": "$context.requestTimeEpoch",
}

_TYPES = {
    "string": apigw.JsonSchemaType.STRING,
    "integer": apigw.JsonSchemaType.INTEGER,
    "number": apigw.JsonSchemaType.NUMBER,
    "boolean": apigw.JsonSchemaType.BOOLEAN,
    "object": apigw.JsonSchemaType.OBJECT,
    "array": apigw.JsonSchemaType.ARRAY,
    "null": apigw.JsonSchemaType.NULL,
}
_KEYWORDS = {
    "description": "description",
    "enum": "enum",
    "pattern": "pattern",
    "minLength": "min_length",
    "maxLength": "max_length",
    "minimum": "minimum",
    "maximum": "maximum",
    "minItems": "min_items",
    "maxItems": "max_items",
    "maxProperties": "max_properties",
    "required": "required",
}


def json_schema(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> apigw.JsonSchema:
    """A pydantic (draft 2020-12) schema as an API Gateway (draft 4) model schema.

    $refs are inlined and `anyOf [X, null]` becomes a type list, which draft 4
    understands; keywords draft 4 lacks (propertyNames) are checked by the app.
    """
    top = defs is None
    defs = schema.get("$defs", {}) if top else defs
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return json_schema(merged, defs)
    variants = schema.get("anyOf")
    if variants and any(v.get("type") == "null" for v in variants):
        (other,) = [v for v in variants if v.get("type") != "null"]
        resolved = defs[other["$ref"].rsplit("/", 1)[-1]] if "$ref" in other else other
        merged = {**resolved, **{k: v for k, v in schema.items() if k != "anyOf"}}
        merged["type"] = [resolved["type"], "null"]
        return json_schema(merged, defs)
    kwargs: dict[str, Any] = {}
    if "type" in schema:
        t = schema["type"]
        kwargs["type"] = [_TYPES[x] for x in t] if isinstance(t, list) else _TYPES[t]
    for key, arg in _KEYWORDS.items():
        if key in schema:
            kwargs[arg] = schema[key]
    if "properties" in schema:
        kwargs["properties"] = {k: json_schema(v, defs) for k, v in schema["properties"].items()}
    if "items" in schema:
        kwargs["items"] = json_schema(schema["items"], defs)
    extra = schema.get("additionalProperties")
    if isinstance(extra, bool):
        kwargs["additional_properties"] = extra
    elif isinstance(extra, dict):
        kwargs["additional_properties"] = json_schema(extra, defs)
    if top:
        kwargs["schema"] = apigw.JsonSchemaVersion.DRAFT4
    return apigw.JsonSchema(**kwargs)

