"""onprem/compose.yaml against the Compose Specification JSON schema, raw and with
its variables interpolated, plus the wiring the on-prem profile relies on.

compose-spec.json is the Compose Specification's schema (compose-spec project,
Apache-2.0) as shipped in the npm package dclint 3.1.0 (schemas/compose.schema.json),
vendored so the check runs offline.
"""

from __future__ import annotations

import ipaddress
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

_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^${}]*))?\}")
# Variables that hold a secret: none may have a default, which anyone can read here.
SECRET = re.compile(r"SECRET|PASSWORD|TOKEN")
# The least a fresh checkout must set (compose refuses to start without them).
REQUIRED = {"SLUICE_S3_SECRET_KEY": "a-test-secret-0123"}


class MissingVariable(Exception):
    pass


def interpolate(text: str, values: dict[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default} and ${VAR:?error} (unset or empty refuses
    to start, with the error), innermost first so nested defaults work."""

    def one(match: re.Match) -> str:
        name, operator, argument = match.groups()
        if operator and operator.endswith("?"):
            if not values.get(name):
                raise MissingVariable(f"required variable {name} is missing a value: {argument}")
            return values[name]
        return values.get(name) or (argument or "")

    while True:
        new = _VAR.sub(one, text)
        if new == new.replace("${", "") or new == text:
            return new
        text = new


def variables(text: str) -> dict[str, str | None]:
    """Each ${VAR:-default} used, with its default as written (it may nest another);
    None for a required ${VAR:?error}."""
    found: dict[str, str | None] = {}
    for name, operator, argument in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}", text):
        found.setdefault(name, None if operator.endswith("?") else argument)
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
    document = load() if how == "raw" else load(REQUIRED if how == "defaults" else {**env_example(), **REQUIRED})
    validate(document)


def test_the_schema_check_rejects_a_broken_file():
    broken = load(REQUIRED)
    broken["services"]["api"]["deploy"] = {"resources": {"reservations": {"devices": [{"count": "one"}]}}}
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    broken = load(REQUIRED)
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


def test_every_variable_but_the_secret_has_a_default():
    text = COMPOSE.read_text()
    bare = [m.group(0) for m in re.finditer(r"\$\{[A-Za-z_][A-Za-z0-9_]*\}", text)]
    assert bare == []
    assert [name for name, default in variables(text).items() if default is None] == list(REQUIRED)
    assert "${" not in json.dumps(load(REQUIRED))


def test_no_secret_has_a_default_and_compose_refuses_to_start_without_it():
    used = variables(COMPOSE.read_text())
    secrets = {name for name in used if SECRET.search(name)}
    assert "SLUICE_S3_SECRET_KEY" in secrets
    for name in secrets:
        # Required (${VAR:?...}), or optional and empty (LOCALSTACK_AUTH_TOKEN: only newer tags need one).
        assert not used[name], f"{name} has the default {used[name]!r}, readable by anyone with this file"
        assert env_example()[name] == "", f".env.example gives {name} a value that copies would keep"
    for env in ({}, env_example()):
        with pytest.raises(MissingVariable, match="SLUICE_S3_SECRET_KEY"):
            load(env)
    services = load(REQUIRED)["services"]
    assert services["minio"]["environment"]["MINIO_ROOT_PASSWORD"] == REQUIRED["SLUICE_S3_SECRET_KEY"]
    for name in SLUICE_SERVICES:
        assert services[name]["environment"]["AWS_SECRET_ACCESS_KEY"] == REQUIRED["SLUICE_S3_SECRET_KEY"]


def published(service: dict) -> list[tuple[str, str, str]]:
    """(host IP, host port, container port) of each short-syntax port; the host IP
    is "" when the port is published on every interface."""
    out = []
    for entry in service.get("ports", []):
        assert isinstance(entry, str), entry
        parts = entry.rsplit(":", 2)
        out.append(("" if len(parts) < 3 else parts[0].strip("[]"), *parts[-2:]))
    return out


@pytest.mark.parametrize("how", ["defaults", "env-example"])
def test_published_ports_bind_to_loopback_unless_told_otherwise(how):
    services = load(REQUIRED if how == "defaults" else {**env_example(), **REQUIRED})["services"]
    ports = {name: published(service) for name, service in services.items() if service.get("ports")}
    assert set(ports) == {"api", "minio", "localstack"}
    for name, entries in ports.items():
        for host_ip, host_port, container_port in entries:
            assert host_ip, f"{name} publishes {host_port} on every interface"
            assert ipaddress.ip_address(host_ip).is_loopback, f"{name}: {host_ip}:{host_port}"
    # SLUICE_PUBLISH_ADDRESS serves other machines: the API and MinIO's S3 port,
    # never LocalStack (no authentication) or the MinIO console.
    services = load({**REQUIRED, "SLUICE_PUBLISH_ADDRESS": "10.0.0.5"})["services"]
    assert published(services["api"]) == [("10.0.0.5", "8000", "8000")]
    assert published(services["minio"]) == [("10.0.0.5", "9000", "9000"), ("127.0.0.1", "9001", "9001")]
    assert published(services["localstack"]) == [("127.0.0.1", "4566", "4566")]


def test_one_gpu_per_worker_and_each_worker_its_own_gpu():
    services = load(REQUIRED)["services"]
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
    services = load(REQUIRED)["services"]
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
    # The emulated CloudWatch gets the workers' metrics: as EMF lines on stdout
    # (the default sink) nothing here would turn them into metrics.
    assert all(services[w]["environment"]["SLUICE_METRICS_SINK"] == "cloudwatch" for w in WORKERS)


def test_init_bootstraps_before_api_and_workers_start():
    services = load(REQUIRED)["services"]
    assert services["init"]["command"] == ["sluice", "bootstrap", "--apply-settings"]
    assert services["init"]["depends_on"]["localstack"]["condition"] == "service_healthy"
    assert services["init"]["depends_on"]["minio"] == {"condition": "service_healthy", "required": False}
    for name in ["api", *WORKERS]:
        assert services[name]["depends_on"] == {"init": {"condition": "service_completed_successfully"}}


def test_services_build_the_repository_images():
    services = load(REQUIRED)["services"]
    for name, dockerfile in [("init", "containers/api/Dockerfile"), ("api", "containers/api/Dockerfile"),
                             *[(w, "containers/worker/Dockerfile") for w in WORKERS]]:
        build = services[name]["build"]
        assert (COMPOSE.parent / build["context"]).resolve() == ROOT
        assert (ROOT / build["dockerfile"]).is_file() and build["dockerfile"] == dockerfile
    assert services["api"]["ports"] == ["127.0.0.1:8000:8000"]


def test_only_presigned_urls_name_the_public_endpoint():
    # Every S3 call, the API's included, goes to MinIO inside the Docker network;
    # only the URLs handed to clients name an address they can reach.
    def s3_endpoints(values):
        services = load({**values, **REQUIRED})["services"]
        assert all(services[n]["environment"]["AWS_ENDPOINT_URL_S3"] == services["api"]["environment"]["AWS_ENDPOINT_URL_S3"]
                   for n in SLUICE_SERVICES)
        assert all("SLUICE_S3_PUBLIC_ENDPOINT" not in services[n]["environment"] for n in ["init", *WORKERS])
        return services["api"]["environment"]["AWS_ENDPOINT_URL_S3"], services["api"]["environment"]["SLUICE_S3_PUBLIC_ENDPOINT"]

    # Default: MinIO's port as published on this host.
    assert s3_endpoints({}) == ("http://minio:9000", "http://localhost:9000")
    assert s3_endpoints(env_example()) == ("http://minio:9000", "http://localhost:9000")
    assert s3_endpoints({"SLUICE_MINIO_PORT": "19000"}) == ("http://minio:9000", "http://localhost:19000")
    assert s3_endpoints({**env_example(), "SLUICE_S3_PUBLIC_ENDPOINT": "http://10.0.0.5:9000"}) == (
        "http://minio:9000", "http://10.0.0.5:9000")
    # An existing store that clients reach as Sluice does.
    assert s3_endpoints({"SLUICE_S3_ENDPOINT": "https://s3.example.internal"}) == (
        "https://s3.example.internal", "https://s3.example.internal")


def test_localstack_expires_task_records_and_restarts_heal_missing_resources():
    services = load(REQUIRED)["services"]
    # Task records carry a TTL; LocalStack deletes expired items only when told to.
    assert services["localstack"]["environment"]["DYNAMODB_REMOVE_EXPIRED_ITEMS"] == "1"
    # LocalStack keeps its state in memory and init runs once ("no" restart): the
    # long-running services create whatever is missing as they start.
    assert services["init"]["restart"] == "no"
    for name in ["api", *WORKERS]:
        assert services[name]["environment"]["SLUICE_BOOTSTRAP_ON_START"] == "1"
        assert services[name]["restart"] == "unless-stopped"


def seconds(duration: str) -> float:
    """A Compose duration (`30s`, `1m30s`, `1h`, `500ms`) in seconds."""
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, f"not a Compose duration: {duration!r}"
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6}[u] for n, u in parts)


def test_seconds_reads_compose_durations():
    assert [seconds(d) for d in ("30s", "1m30s", "1h", "500ms")] == [30, 90, 3600, 0.5]
    with pytest.raises(AssertionError):
        seconds("30")


def test_the_api_outlives_its_longest_long_poll_when_stopped():
    # Docker's default is 10 s; a long poll lasts up to MAX_WAIT_S (20 s), and
    # uvicorn lets it finish after SIGTERM if the SIGKILL comes late enough.
    from sluice.contract import MAX_WAIT_S

    api = load(REQUIRED)["services"]["api"]
    assert "stop_grace_period" in api, "Docker's default (10 s) cuts long polls short"
    assert seconds(api["stop_grace_period"]) >= MAX_WAIT_S + 5


def test_workers_get_the_grace_period_kubernetes_gives_them():
    # One grace period for the same worker image wherever it runs: onprem/k8s's
    # terminationGracePeriodSeconds (the CDK stack's termination_grace_s).
    deployment = yaml.safe_load((ROOT / "onprem" / "k8s" / "common" / "worker-deployment.yaml").read_text())
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    services = load(REQUIRED)["services"]
    for name in WORKERS:
        assert seconds(services[name]["stop_grace_period"]) == grace, name


def test_the_api_limits_each_key_s_rate_as_make_run_does():
    # Compose's API serves other machines: with the limit off, one key could
    # take every request the API and its emulators can answer.
    for values in (REQUIRED, {**env_example(), **REQUIRED}):
        api = load(values)["services"]["api"]
        assert float(api["environment"]["SLUICE_RATE_LIMIT_PER_S"]) == 100, values


# Settings an operator has no reason to set in onprem/.env: what this profile
# fixes itself (auth by the keys table, the workers' metrics sink, the
# bootstrap at start), the queue URLs the CDK stack sets (here they are looked
# up by name), AWS_REGION, and a knob of the test suite's.
_FIXED_HERE = {"auth_mode", "queue_url_high", "queue_url_normal", "queue_url_low", "region", "metrics_sink",
               "bootstrap_on_start", "synthetic_faults"}
# Defaults this profile chooses on purpose over Settings' own (docs/onprem.md).
_ONPREM_DEFAULTS = {"device": "cuda", "rate_limit_per_s": "100", "s3_public_endpoint": None}


def _shown(value) -> str:
    return "" if value is None else str(value)


def test_every_setting_reaches_every_sluice_container_from_the_env_file():
    # A variable set in onprem/.env reaches a container only where compose.yaml
    # passes it on; one that is not (SLUICE_MAX_ATTEMPTS) did nothing at all,
    # and the next start's bootstrap kept the queues' maxReceiveCount at 3.
    from sluice.settings import Settings

    used = variables(COMPOSE.read_text())
    services = load(REQUIRED)["services"]
    marker = "set-in-env-file"
    passed = load({**REQUIRED, **{name: marker for name in used}})["services"]
    for name, field in Settings.model_fields.items():
        if name in _FIXED_HERE:
            continue
        var = f"SLUICE_{name.upper()}"
        assert var in used, f"{var} is not read from onprem/.env"
        for service in SLUICE_SERVICES:
            if var == "SLUICE_S3_PUBLIC_ENDPOINT" and service != "api":
                continue  # only the API presigns URLs
            assert passed[service]["environment"].get(var) == marker, f"{var} does not reach {service}"
        if name in _ONPREM_DEFAULTS:
            continue
        assert str(services["api"]["environment"][var]) == _shown(field.default), f"{var}: compose's default differs"
