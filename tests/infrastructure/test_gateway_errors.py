"""What a client gets when the gateway or the WAF answers instead of the app:
the app's error contract (`{"error": {"code", "message", "details"}}`, the same
codes the app uses for the same situation), never API Gateway's `{"message": ...}`."""

from __future__ import annotations

import asyncio
import json
import random
import re

import pytest

from sluice.api.errors import unavailable
from sluice.settings import Settings

APP_MAX_BODY = Settings.model_fields["max_body_bytes"].default


def resources(template: dict, type_: str) -> dict[str, dict]:
    return {k: v for k, v in template["Resources"].items() if v["Type"] == type_}


def gateway_responses(raw: dict) -> dict[str, dict]:
    return {r["Properties"]["ResponseType"]: r["Properties"] for r in resources(raw, "AWS::ApiGateway::GatewayResponse").values()}


def rendered(props: dict) -> dict:
    """The response's JSON body, the gateway's own message standing in for $context.error.messageString."""
    template = props["ResponseTemplates"]["application/json"]
    return json.loads(template.replace("$context.error.messageString", json.dumps("Some gateway message")))


def app_413(max_bytes: int) -> tuple[int, bytes]:
    """What the app's own BodyLimit answers for a declared body over max_bytes."""
    from sluice.api.app import BodyLimit

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():  # never read: a declared length over the limit is refused unread
        raise AssertionError("read the body")

    scope = {"type": "http", "method": "POST", "path": "/v1/tasks",
             "headers": [(b"content-length", str(max_bytes + 1).encode())]}
    asyncio.run(BodyLimit(None, max_bytes)(scope, receive, send))
    start, body = sent[0], b"".join(m.get("body", b"") for m in sent[1:])
    return start["status"], body


# ------------------------------------------------------------------ gateway responses


def test_every_gateway_response_has_the_apps_error_shape(synth, backend):
    responses = gateway_responses(synth.raw[backend])
    for kind, props in responses.items():
        body = rendered(props)
        assert set(body) == {"error"}, kind
        assert set(body["error"]) == {"code", "message", "details"}, kind
        assert re.fullmatch(r"[a-z_]+", body["error"]["code"]), kind
        assert isinstance(body["error"]["message"], str) and body["error"]["message"], kind
        assert body["error"]["details"] == [], kind


def test_a_lambda_timeout_or_failure_reaches_the_client_as_the_apps_503(synth, backend):
    """INTEGRATION_TIMEOUT (the function did not answer within 29 s) and
    INTEGRATION_FAILURE (Lambda refused the invoke: throttled, payload over 6 MB;
    or the function crashed) answer as the app does when a dependency fails:
    503 dependency_unavailable with Retry-After, saying nothing of whether the
    request was recorded, so a retry with the same Idempotency-Key resumes it."""
    responses = gateway_responses(synth.raw[backend])
    expected = unavailable("the API")
    for kind in ("INTEGRATION_TIMEOUT", "INTEGRATION_FAILURE"):
        assert kind in responses, f"no gateway response for {kind}: clients would get {{'message': ...}}"
        props = responses[kind]
        assert props["StatusCode"] == str(expected.status) == "503"
        assert rendered(props) == expected.body()
        assert rendered(props)["error"]["code"] == "dependency_unavailable"
        assert props["ResponseParameters"] == {
            "gatewayresponse.header.Retry-After": "'%s'" % expected.headers["Retry-After"]
        }


def test_a_usage_plan_throttle_is_the_apps_429_rate_limited_with_retry_after(synth, backend):
    # As the app's own rate limit and the WAF's answer: a client that waits on
    # Retry-After (README) must get one. A plan's rate refills every second; an
    # exhausted quota waits for its period to end, which no fixed header can say.
    responses = gateway_responses(synth.raw[backend])
    throttled = responses["THROTTLED"]
    assert throttled["StatusCode"] == "429" and rendered(throttled)["error"]["code"] == "rate_limited"
    assert throttled["ResponseParameters"] == {"gatewayresponse.header.Retry-After": "'1'"}
    quota = responses["QUOTA_EXCEEDED"]
    assert quota["StatusCode"] == "429" and rendered(quota)["error"]["code"] == "quota_exceeded"
    assert "ResponseParameters" not in quota


def test_any_other_gateway_5xx_is_the_apps_internal_error_keeping_its_status(synth, backend):
    responses = gateway_responses(synth.raw[backend])
    assert "DEFAULT_5XX" in responses, "no DEFAULT_5XX: other gateway 5xx reach clients as {'message': ...}"
    props = responses["DEFAULT_5XX"]
    assert "StatusCode" not in props  # a status here would replace every other 5xx's own
    body = rendered(props)["error"]
    assert body["code"] == "internal_error"
    assert "retry" in body["message"]
    assert props["ResponseParameters"]["gatewayresponse.header.Retry-After"] == "'5'"


def test_any_other_gateway_4xx_is_in_the_apps_shape_keeping_its_status(synth, backend):
    responses = gateway_responses(synth.raw[backend])
    props = responses["DEFAULT_4XX"]
    assert "StatusCode" not in props
    assert rendered(props)["error"] == {"code": "http_error", "message": "Some gateway message", "details": []}


# ------------------------------------------------------------------ bodies over the limit


def content_length_rule(raw: dict) -> tuple[dict, dict]:
    (acl,) = resources(raw, "AWS::WAFv2::WebACL").values()
    props = acl["Properties"]
    rules = [r for r in props["Rules"]
             if r["Statement"].get("RegexMatchStatement", {}).get("FieldToMatch") == {"SingleHeader": {"Name": "content-length"}}]
    assert len(rules) == 1, "no WAF rule on the declared Content-Length"
    return props, rules[0]


def test_the_waf_refuses_a_declared_body_over_the_apps_limit_with_the_apps_413(synth, backend):
    """API Gateway takes bodies up to 10 MB, Lambda's invoke at most 6 MB: a body
    between the two would reach the client as a gateway 5xx. The WAF refuses any
    declared Content-Length over the app's own limit, answering exactly what the
    app answers (413 payload_too_large), so the function is never invoked with it."""
    raw = synth.raw[backend]
    props, rule = content_length_rule(raw)
    block = rule["Action"]["Block"]["CustomResponse"]
    assert block["ResponseCode"] == 413
    custom = props["CustomResponseBodies"][block["CustomResponseBodyKey"]]
    assert custom["ContentType"] == "APPLICATION_JSON"
    status, app_body = app_413(APP_MAX_BODY)
    assert status == 413
    assert json.loads(custom["Content"]) == json.loads(app_body)
    assert json.loads(custom["Content"])["error"]["code"] == "payload_too_large"

    # The function is held to the same limit, whatever the app's default becomes.
    functions = resources(raw, "AWS::Lambda::Function")
    (api,) = [f for f in functions.values() if f["Properties"].get("Handler") == "lambdas.api.handler.handler"]
    assert api["Properties"]["Environment"]["Variables"]["SLUICE_MAX_BODY_BYTES"] == str(APP_MAX_BODY)

    pattern = re.compile(rule["Statement"]["RegexMatchStatement"]["RegexString"])
    for length in (0, 1, 1024, APP_MAX_BODY - 1, APP_MAX_BODY):
        assert not pattern.search(str(length)), length
    for length in (APP_MAX_BODY + 1, 6 * 1024 * 1024, 7_000_000, 10 * 1024 * 1024, 10**12):
        assert pattern.search(str(length)), length


def test_the_waf_body_limit_sits_under_lambdas_invoke_limit_and_counts_after_the_rate_cap(synth, backend):
    props, rule = content_length_rule(synth.raw[backend])
    # The event wraps the body as a JSON string (a valid JSON body's quotes and
    # backslashes doubled, a 4-byte character perhaps as a 12-byte surrogate
    # pair: 3x at worst) beside headers and context: within Lambda's 6 MB.
    assert 3 * APP_MAX_BODY + 64 * 1024 < 6 * 1024 * 1024
    rate = [r for r in props["Rules"] if "RateBasedStatement" in r["Statement"]]
    assert rate and all(r["Priority"] < rule["Priority"] for r in rate)  # a flood of big bodies still counts
    assert rule["VisibilityConfig"]["CloudWatchMetricsEnabled"] is True


@pytest.mark.parametrize("limit", [0, 1, 9, 10, 99, 100, 1000, 4096, 65_536, 999_999, 1_000_000, 1_048_576, 6_291_456, 9_999_999])
def test_the_content_length_pattern_matches_exactly_the_numbers_over_the_limit(limit):
    from cdk.api_construct import decimal_over

    pattern = decimal_over(limit)
    assert len(pattern) <= 512  # RegexMatchStatement's limit
    assert "(?:" in pattern and not re.search(r"\((?!\?:)", pattern)  # WAF refuses capturing groups
    compiled = re.compile(pattern)
    rng = random.Random(limit)
    near = range(max(0, limit - 1100), limit + 1100)
    spread = [rng.randrange(0, 10 ** rng.randint(1, 13)) for _ in range(3000)]
    for n in [*near, *spread, 10**20]:
        assert bool(compiled.search(str(n))) is (n > limit), n
        assert bool(compiled.search("00" + str(n))) is (n > limit), n  # leading zeros are still the number
    for junk in ("", "abc", "-5", "1e9", "12 34", str(limit + 1) + "x"):
        assert not compiled.search(junk), junk


def test_the_waf_rate_cap_answers_the_apps_429_not_a_403(synth, backend):
    """A client over the WAF's per-IP cap is throttled, not refused: a 403
    would read as a bad key, and the client would not retry."""
    (acl,) = resources(synth.raw[backend], "AWS::WAFv2::WebACL").values()
    props = acl["Properties"]
    (rule,) = [r for r in props["Rules"] if "RateBasedStatement" in r["Statement"]]
    block = rule["Action"]["Block"]["CustomResponse"]
    assert block["ResponseCode"] == 429
    assert {h["Name"]: h["Value"] for h in block["ResponseHeaders"]}["Retry-After"].isdigit()
    body = json.loads(props["CustomResponseBodies"][block["CustomResponseBodyKey"]]["Content"])
    assert body["error"]["code"] == "rate_limited" and body["error"]["details"] == []


def test_an_unknown_route_is_the_apps_404_and_a_waf_refusal_is_no_bad_key(synth, backend):
    # MISSING_AUTHENTICATION_TOKEN is how a REST API without IAM auth answers a
    # method or path it does not serve; WAF_FILTERED, a managed rule's block.
    # Neither may read as "forbidden", which clients take for a bad key.
    responses = gateway_responses(synth.raw[backend])
    unknown = responses["MISSING_AUTHENTICATION_TOKEN"]
    assert unknown["StatusCode"] == "404" and rendered(unknown)["error"]["code"] == "not_found"
    blocked = responses["WAF_FILTERED"]
    assert blocked["StatusCode"] == "403" and rendered(blocked)["error"]["code"] == "request_blocked"
