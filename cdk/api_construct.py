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
from cdk.queues_construct import Queues
from cdk.storage_construct import Storage
from sluice.contract import BatchSubmitRequest, SubmitRequest

HEALTH_PATH = "/health"
# The routes that answer at once (the API's latency alarms watch these; a
# GET /v1/tasks/{id}?wait_s=N long poll takes up to 20 s by design).
SUBMIT_ROUTES = (("POST", "/v1/tasks"), ("POST", "/v1/tasks/batch"))

# API Gateway's own refusals, in the same error shape the app uses.
_GATEWAY_ERRORS = {
    apigw.ResponseType.BAD_REQUEST_PARAMETERS: ("422", "validation_error"),
    apigw.ResponseType.MISSING_AUTHENTICATION_TOKEN: ("403", "forbidden"),
    apigw.ResponseType.INVALID_API_KEY: ("403", "forbidden"),
    apigw.ResponseType.ACCESS_DENIED: ("403", "forbidden"),
    apigw.ResponseType.THROTTLED: ("429", "rate_limited"),
    apigw.ResponseType.QUOTA_EXCEEDED: ("429", "quota_exceeded"),
    apigw.ResponseType.REQUEST_TOO_LARGE: ("413", "payload_too_large"),
    apigw.ResponseType.WAF_FILTERED: ("403", "forbidden"),
}


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
                "SLUICE_RESULT_TTL_DAYS": str(config.result_ttl_days),
                "SLUICE_RATE_LIMIT_PER_S": "0",  # usage plans throttle on AWS
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

        for response_type, (status, code_name) in _GATEWAY_ERRORS.items():
            self.api.add_gateway_response(
                f"Gw{response_type.response_type}",
                type=response_type,
                status_code=status,
                templates={
                    "application/json": (
                        '{"error":{"code":"%s","message":$context.error.messageString,"details":[]}}' % code_name
                    )
                },
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
        """Managed bad-input rules and a per-IP rate cap ahead of the usage plans."""

        def rule(name: str, priority: int, statement: dict, *, managed: bool) -> dict:
            extra = {"overrideAction": {"none": {}}} if managed else {"action": {"block": {}}}
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
                rule(
                    "RatePerIp",
                    1,
                    {"rateBasedStatement": {"limit": config.waf_rate_limit_per_5min, "aggregateKeyType": "IP"}},
                    managed=False,
                ),
            ],
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

