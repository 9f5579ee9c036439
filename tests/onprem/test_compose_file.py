"""onprem/compose.yaml against the Compose Specification JSON schema, raw and with
its variables interpolated, plus the wiring the on-prem profile relies on.

compose-spec.json is the Compose Specification's schema (compose-spec project,
Apache-2.0) as shipped in the npm package dclint 3.1.0 (schemas/compose.schema.json),
vendored so the check runs offline.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from dockerfile_reader import ROOT

COMPOSE = ROOT / "onprem" / "compose.yaml"
ENV_EXAMPLE = ROOT / "onprem" / ".env.example"
SCHEMA = json.loads((Path(__file__).with_name("compose-spec.json")).read_text())
WORKERS = ["worker-0", "worker-1", "worker-2", "worker-3"]
SLUICE_SERVICES = ["init", "api", *WORKERS]
ENDPOINTS = ["AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL_DYNAMODB", "AWS_ENDPOINT_URL_CLOUDWATCH", "AWS_ENDPOINT_URL_S3"]

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^${}]*))?\}")


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's ${VAR} and ${VAR:-default}, innermost first so nested defaults work."""
    while True:
        new = _VAR.sub(lambda m: values.get(m.group(1)) or (m.group(2) or ""), text)
        if new == new.replace("${", "") or new == text:
            return new
        text = new


def variables(text: str) -> dict[str, str]:
    """Each ${VAR:-default} used, with its default as written (it may nest another)."""
    found: dict[str, str] = {}
    for name, default in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::?-([^}]*))?\}", text):
        found.setdefault(name, default)
    return found


def env_example() -> dict[str, str]:
    values = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def load(values: dict[str, str] | None = None) -> dict:
    text = COMPOSE.read_text()
    return yaml.safe_load(interpolate(text, values) if values is not None else text)


def validate(document: dict) -> None:
    jsonschema.Draft7Validator(SCHEMA, format_checker=jsonschema.FormatChecker()).validate(document)


@pytest.mark.parametrize("how", ["raw", "defaults", "env-example"])
def test_matches_the_compose_specification(how):
    document = load() if how == "raw" else load({} if how == "defaults" else env_example())
    validate(document)


def test_the_schema_check_rejects_a_broken_file():
    broken = load({})
    broken["services"]["api"]["deploy"] = {"resources": {"reservations": {"devices": [{"count": "one"}]}}}
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = load({})
    broken["services"]["api"]["not_a_key"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)


def test_env_example_lists_every_variable_with_the_compose_default():
    used = variables(COMPOSE.read_text())
    example = env_example()
    assert set(used) - {"COMPOSE_PROFILES"} <= set(example), "variables missing from .env.example"
    assert set(example) - {"COMPOSE_PROFILES"} <= set(used), ".env.example lists variables compose.yaml never uses"
    for name, default in used.items():
        if example[name]:  # an empty example value means "use the default"
            assert example[name] == default, f"{name}: .env.example {example[name]!r} vs compose default {default!r}"


def test_every_variable_has_a_default_so_no_env_file_is_needed():
    text = COMPOSE.read_text()
    bare = [m.group(0) for m in re.finditer(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", text)]
    assert bare == []
    assert "${" not in json.dumps(load({}))


def test_one_gpu_per_worker_and_each_worker_its_own_gpu():
    services = load({})["services"]
    gpus = []
    for name in WORKERS:
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]
        # `count: 1` would give every worker GPU 0; device_ids pins one each.
        assert "count" not in devices[0] and len(devices[0]["device_ids"]) == 1
        gpus.append(devices[0]["device_ids"][0])
    assert gpus == ["0", "1", "2", "3"]
    assert "profiles" not in services["worker-0"]
    assert services["worker-1"]["profiles"] == ["gpus-2", "gpus-4"]
    assert all(services[w]["profiles"] == ["gpus-4"] for w in ("worker-2", "worker-3"))


def test_the_stack_emulates_sqs_dynamodb_cloudwatch_and_s3():
    services = load({})["services"]
    localstack = services["localstack"]
    image, tag = localstack["image"].split(":")
    assert image == "localstack/localstack" and re.fullmatch(r"4\.\d+\.\d+", tag)
    # No later than the last release that starts without an auth token.
    assert tuple(map(int, tag.split("."))) <= (4, 14, 0)
    assert set(localstack["environment"]["SERVICES"].split(",")) == {"sqs", "dynamodb", "cloudwatch"}
    # AWS-shaped queue URLs (.../<account>/<queue>), as KEDA's SQS scaler needs.
    assert localstack["environment"]["SQS_ENDPOINT_STRATEGY"] == "off"
    assert services["minio"]["image"].startswith("minio/minio:RELEASE.")
    for name in SLUICE_SERVICES:
        environment = services[name]["environment"]
        assert environment["AWS_ENDPOINT_URL_SQS"] == "http://localstack:4566"
        assert environment["AWS_ENDPOINT_URL_DYNAMODB"] == "http://localstack:4566"
        assert environment["AWS_ENDPOINT_URL_CLOUDWATCH"] == "http://localstack:4566"
        assert environment["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
        # The generic endpoint would send every service to one server.
        assert "AWS_ENDPOINT_URL" not in environment


def test_init_bootstraps_before_api_and_workers_start():
    services = load({})["services"]
    assert services["init"]["command"] == ["sluice", "bootstrap"]
    assert services["init"]["depends_on"]["localstack"]["condition"] == "service_healthy"
    assert services["init"]["depends_on"]["minio"] == {"condition": "service_healthy", "required": False}
    for name in ["api", *WORKERS]:
        assert services[name]["depends_on"] == {"init": {"condition": "service_completed_successfully"}}


def test_services_build_the_repository_images():
    services = load({})["services"]
    for name, dockerfile in [("init", "containers/api/Dockerfile"), ("api", "containers/api/Dockerfile"),
                             *[(w, "containers/worker/Dockerfile") for w in WORKERS]]:
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).is_file() and build["dockerfile"] == dockerfile
    assert services["api"]["ports"] == ["8000:8000"]


def test_the_api_presigns_for_a_public_endpoint_when_one_is_given():
    services = load({**env_example(), "SLUICE_S3_PUBLIC_ENDPOINT": "http://10.0.0.5:9000"})["services"]
    assert services["api"]["environment"]["AWS_ENDPOINT_URL_S3"] == "http://10.0.0.5:9000"
    assert services["worker-0"]["environment"]["AWS_ENDPOINT_URL_S3"] == "http://minio:9000"
    services = load({"SLUICE_S3_ENDPOINT": "https://s3.example.internal"})["services"]
    assert services["api"]["environment"]["AWS_ENDPOINT_URL_S3"] == "https://s3.example.internal"
