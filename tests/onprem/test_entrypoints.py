"""The image entrypoints create whatever is missing before they start when
SLUICE_BOOTSTRAP_ON_START=1, which onprem/compose.yaml sets on the api and the
workers: LocalStack keeps its state in memory, and after a host reboot Docker
restarts the containers without compose's `init` step. Here both entrypoints
start together, as they do then, against a server that holds nothing."""

from __future__ import annotations

import json
import sys
import urllib.request

import boto3
from dockerfile_reader import ROOT, cmd, env
from servers import BIN, CREDENTIALS, REGION, Processes, clean_env, free_port, http_ok, start_moto, wait_for

API_DOCKERFILE = ROOT / "containers" / "api" / "Dockerfile"
WORKER_DOCKERFILE = ROOT / "containers" / "worker" / "Dockerfile"


def image_command(dockerfile_args: list[str]) -> list[str]:
    program, *rest = dockerfile_args
    return [sys.executable if program == "python" else str(BIN / program), *rest]


def test_api_and_worker_create_missing_resources_as_they_start(tmp_path):
    procs = Processes(tmp_path)
    try:
        moto, endpoint = start_moto(procs)
        wait_for(lambda: http_ok(f"{endpoint}/moto-api/"), 30, "moto server", moto)
        base = {
            **clean_env(), **CREDENTIALS, "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            **{f"AWS_ENDPOINT_URL_{service}": endpoint for service in ("SQS", "S3", "DYNAMODB")},
            "SLUICE_MODELS": "synthetic", "SLUICE_STATE_DIR": str(tmp_path / "state"),
            "SLUICE_BOOTSTRAP_ON_START": "1",
        }
        port = free_port()
        api = procs.start("api", image_command(cmd(API_DOCKERFILE)),
                          {**base, **env(API_DOCKERFILE), "SLUICE_HOST": "127.0.0.1", "SLUICE_PORT": str(port)})
        worker = procs.start("worker", image_command(cmd(WORKER_DOCKERFILE)), {**base, **env(WORKER_DOCKERFILE)})
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 60, "API /health", api)
        # The API serves only once its resources exist, so it is ready at once.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=10) as response:
            assert json.loads(response.read())["checks"] == {"tasks_table": "ok", "queues": "ok", "bucket": "ok"}
        wait_for(lambda: "worker ready" in worker.log.read_text(errors="replace"), 90, "worker 'ready' log line", worker)
        assert api.popen.poll() is None and worker.popen.poll() is None
        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION,
                           aws_access_key_id="x", aws_secret_access_key="x")
        names = sorted(url.rsplit("/", 1)[1] for url in sqs.list_queues(QueueNamePrefix="sluice-")["QueueUrls"])
        assert names == sorted(f"sluice-{p}{d}" for p in ("high", "normal", "low") for d in ("", "-dlq"))
    finally:
        procs.stop_all(first=("worker", "api"))


def test_without_the_setting_an_entrypoint_creates_nothing(tmp_path):
    # AWS and Kubernetes: the stack or an operator owns the resources, and the
    # roles may not create them.
    procs = Processes(tmp_path)
    try:
        moto, endpoint = start_moto(procs)
        wait_for(lambda: http_ok(f"{endpoint}/moto-api/"), 30, "moto server", moto)
        port = free_port()
        api = procs.start("api", image_command(cmd(API_DOCKERFILE)), {
            **clean_env(), **CREDENTIALS, "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
            **{f"AWS_ENDPOINT_URL_{service}": endpoint for service in ("SQS", "S3", "DYNAMODB")},
            "SLUICE_STATE_DIR": str(tmp_path / "state"), **env(API_DOCKERFILE),
            "SLUICE_HOST": "127.0.0.1", "SLUICE_PORT": str(port)})
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/health"), 60, "API /health", api)
        sqs = boto3.client("sqs", endpoint_url=endpoint, region_name=REGION,
                           aws_access_key_id="x", aws_secret_access_key="x")
        assert sqs.list_queues().get("QueueUrls", []) == []
    finally:
        procs.stop_all(first=("api",))
