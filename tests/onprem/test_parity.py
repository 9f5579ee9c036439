"""On-prem parity: the API and worker entrypoints, run exactly as their images run
them (each Dockerfile's CMD, ENV and HEALTHCHECK, read from the file), against three
separate real servers, one per AWS service, each reached through its own
AWS_ENDPOINT_URL_<SERVICE>:

  SQS       LocalStack core 4.13.1 (the image tag onprem/compose.yaml pins)
  S3        SeaweedFS `weed mini` (standing in for MinIO; no registry ships MinIO)
  DynamoDB  moto server (LocalStack's DynamoDB downloads Java at run time)

The resources are made by the command onprem/compose.yaml's init service runs.
One stack serves the whole module; the last test stops it and checks the exits.
"""

from __future__ import annotations

import hashlib
import json
import math
import signal
import subprocess
import sys
import urllib.request

import boto3
import httpx
import pytest
import yaml
from botocore.config import Config
from dockerfile_reader import ROOT, cmd, env, healthcheck
from sluice.aws import client
from sluice.settings import Settings
from servers import (
    BIN,
    CREDENTIALS,
    REGION,
    Processes,
    clean_env,
    free_port,
    http_ok,
    start_localstack,
    start_moto,
    start_seaweedfs,
    wait_for,
)

API_DOCKERFILE = ROOT / "containers" / "api" / "Dockerfile"
WORKER_DOCKERFILE = ROOT / "containers" / "worker" / "Dockerfile"
COMPOSE = ROOT / "onprem" / "compose.yaml"
TENANT = "onprem-parity"
# Low thresholds so a modest task crosses them: inputs over 4 KiB go to S3 as a
# claim check, results over 16 KiB are stored in S3 and fetched by presigned URL.
INLINE_PAYLOAD_MAX = 4096
INLINE_RESULT_MAX = 16384
TASK_TIMEOUT_S = 60


def image_command(dockerfile_args: list[str]) -> list[str]:
    """An image's exec-form command with `python` being this venv's (WORKDIR /app is the repo root)."""
    program, *rest = dockerfile_args
    return [sys.executable if program == "python" else str(BIN / program), *rest]


class Stack:
    def __init__(self, log_dir):
        self.procs = Processes(log_dir)
        self.log_dir = log_dir
        self.endpoints: dict[str, str] = {}
        self.api = self.worker = None
        self.api_url = ""
        self.public_s3 = ""
        self.key = ""

    def base_env(self) -> dict[str, str]:
        return {
            **clean_env(),
            **CREDENTIALS,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",
            # One server per service; deliberately no generic AWS_ENDPOINT_URL.
            "AWS_ENDPOINT_URL_SQS": self.endpoints["sqs"],
            "AWS_ENDPOINT_URL_S3": self.endpoints["s3"],
            "AWS_ENDPOINT_URL_DYNAMODB": self.endpoints["dynamodb"],
            "SLUICE_MODELS": "minilm-embed,synthetic",
            "SLUICE_INLINE_PAYLOAD_MAX_BYTES": str(INLINE_PAYLOAD_MAX),
            "SLUICE_INLINE_RESULT_MAX_BYTES": str(INLINE_RESULT_MAX),
            "SLUICE_STATE_DIR": str(self.log_dir / "state"),  # never the developer's .sluice/
            "SLUICE_TORCH_THREADS": "1",
        }

    def image_env(self, dockerfile) -> dict[str, str]:
        return {**self.base_env(), **env(dockerfile)}

    def client(self, service: str):
        return boto3.client(service, endpoint_url=self.endpoints[service], region_name=REGION,
                            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                            config=Config(signature_version="s3v4", s3={"addressing_style": "path"},
                                          retries={"max_attempts": 1}))

    def run(self, args: list[str], timeout_s: float = 60) -> str:
        done = subprocess.run(args, env=self.base_env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"{args} exited {done.returncode}\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def start(self, data_dir) -> None:
        # The three servers start together; each is then waited for on its own terms.
        localstack, self.endpoints["sqs"] = start_localstack(self.procs, data_dir / "localstack")
        seaweed, self.endpoints["s3"] = start_seaweedfs(self.procs, data_dir / "seaweedfs")
        moto, self.endpoints["dynamodb"] = start_moto(self.procs)
        wait_for(lambda: "sqs" in json.loads(urllib.request.urlopen(
            f"{self.endpoints['sqs']}/_localstack/health", timeout=2).read())["services"], 60,
            "LocalStack health", localstack)
        wait_for(lambda: http_ok(f"{self.endpoints['dynamodb']}/moto-api/"), 30, "moto server", moto)
        wait_for(self._s3_round_trip, 60, "SeaweedFS S3 put/get", seaweed)

        # The on-prem init step, as compose runs it.
        init = yaml.safe_load(COMPOSE.read_text())["services"]["init"]["command"]
        self.run(image_command(init))
        self.key = self.run([str(BIN / "sluice"), "keys", "create", "--tenant", TENANT]).split()[-1]

        port = free_port()
        # As in compose: the API reaches the store by one name (there minio:9000)
        # and signs result URLs for the name clients use (there localhost:9000).
        self.public_s3 = self.endpoints["s3"].replace("127.0.0.1", "localhost")
        api_env = {**self.image_env(API_DOCKERFILE), "SLUICE_HOST": "127.0.0.1", "SLUICE_PORT": str(port),
                   "SLUICE_S3_PUBLIC_ENDPOINT": self.public_s3}
        self.api = self.procs.start("api", image_command(cmd(API_DOCKERFILE)), api_env)
        self.api_url = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_ok(f"{self.api_url}/health"), 60, "API /health", self.api)

        self.worker = self.procs.start("worker", image_command(cmd(WORKER_DOCKERFILE)),
                                       self.image_env(WORKER_DOCKERFILE))
        wait_for(lambda: "worker ready" in self.worker.log.read_text(errors="replace"), 90,
                 "worker 'ready' log line", self.worker)

    def _s3_round_trip(self) -> bool:
        s3 = self.client("s3")
        try:
            s3.head_bucket(Bucket="readiness-probe")
        except Exception:
            s3.create_bucket(Bucket="readiness-probe")
        s3.put_object(Bucket="readiness-probe", Key="probe", Body=b"ok")
        return s3.get_object(Bucket="readiness-probe", Key="probe")["Body"].read() == b"ok"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("onprem-data")
    logs = tmp_path_factory.mktemp("onprem-logs")
    s = Stack(logs)
    try:
        s.start(data)
        yield s
    finally:
        s.procs.stop_all(first=("worker", "api"))


@pytest.fixture(scope="module")
def api(stack):
    with httpx.Client(base_url=stack.api_url, headers={"x-api-key": stack.key}, timeout=15) as client:
        yield client


def wait_task(stack, api, task_id: str) -> dict:
    def final():
        view = api.get(f"/v1/tasks/{task_id}").json()
        return view if view["status"] != "queued" else None

    return wait_for(final, TASK_TIMEOUT_S, f"task {task_id} to finish", stack.worker)


def cosine(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def test_each_service_lives_on_its_own_server(stack):
    queues = stack.client("sqs").list_queues(QueueNamePrefix="sluice-").get("QueueUrls", [])
    names = sorted(url.rsplit("/", 1)[1] for url in queues)
    assert names == sorted(f"sluice-{p}{d}" for p in ("high", "normal", "low") for d in ("", "-dlq"))
    assert all(url.startswith(stack.endpoints["sqs"] + "/000000000000/") for url in queues)
    tables = stack.client("dynamodb").list_tables()["TableNames"]
    assert {"sluice-tasks", "sluice-api-keys"} <= set(tables)
    buckets = [b["Name"] for b in stack.client("s3").list_buckets()["Buckets"]]
    assert "sluice-payloads" in buckets
    # And nothing landed on the wrong server: moto also speaks SQS and S3.
    moto_sqs = boto3.client("sqs", endpoint_url=stack.endpoints["dynamodb"], region_name=REGION,
                            aws_access_key_id="x", aws_secret_access_key="x")
    assert moto_sqs.list_queues().get("QueueUrls", []) == []


def test_the_init_step_gives_the_store_s_bucket_its_expiry_rules(stack):
    # bootstrap only warns when a store refuses lifecycle rules: read them back
    # from SeaweedFS (MinIO's stand-in), so that payloads are known to expire.
    from sluice.bootstrap import lifecycle_rules

    rules = stack.client("s3").get_bucket_lifecycle_configuration(Bucket="sluice-payloads")["Rules"]
    expiry = {r["Filter"]["Prefix"]: r["Expiration"]["Days"] for r in rules if r.get("Status") == "Enabled"}
    assert expiry == {r["Filter"]["Prefix"]: r["Expiration"]["Days"] for r in lifecycle_rules(Settings())}


def test_sluice_clients_keep_their_connection_to_localstack(stack, monkeypatch):
    # LocalStack's hypercorn gateway closes every connection a client does not
    # ask to keep; Sluice's clients ask, so a call does not open a new one.
    for name, value in stack.base_env().items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    ours = client("sqs", Settings()).list_queues(QueueNamePrefix="sluice-")
    plain = stack.client("sqs").list_queues(QueueNamePrefix="sluice-")
    assert plain["ResponseMetadata"]["HTTPHeaders"].get("connection") == "close"
    assert ours["ResponseMetadata"]["HTTPHeaders"].get("connection") != "close"


def test_ready_and_both_image_healthchecks_pass(stack, api):
    ready = api.get("/ready")
    assert ready.status_code == 200, ready.text
    assert ready.json()["checks"] == {"tasks_table": "ok", "queues": "ok", "bucket": "ok"}
    api_env = {**stack.image_env(API_DOCKERFILE), "SLUICE_PORT": stack.api_url.rsplit(":", 1)[1]}
    for dockerfile, environment in ((API_DOCKERFILE, api_env), (WORKER_DOCKERFILE, stack.image_env(WORKER_DOCKERFILE))):
        _, check = healthcheck(dockerfile)
        done = subprocess.run(image_command(check), env=environment, cwd=ROOT, capture_output=True, text=True,
                              timeout=30)
        assert done.returncode == 0, f"{dockerfile.parent.name} HEALTHCHECK failed: {done.stderr}"


def test_the_worker_healthcheck_fails_when_the_queue_is_unreachable(stack):
    _, check = healthcheck(WORKER_DOCKERFILE)
    broken = {**stack.image_env(WORKER_DOCKERFILE), "AWS_ENDPOINT_URL_SQS": f"http://127.0.0.1:{free_port()}"}
    done = subprocess.run(image_command(check), env=broken, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0


def test_minilm_embeddings_round_trip(stack, api):
    texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Quarterly revenue grew by four percent."]
    accepted = api.post("/v1/tasks", json={"model": "minilm-embed", "inputs": texts, "priority": "high"})
    assert accepted.status_code == 202, accepted.text
    view = wait_task(stack, api, accepted.json()["task_id"])
    assert view["status"] == "succeeded", view
    vectors = view["result"]["embeddings"]
    assert view["result"]["dim"] == 384 and [len(v) for v in vectors] == [384] * 3
    assert all(abs(math.sqrt(cosine(v, v)) - 1) < 1e-3 for v in vectors)
    assert cosine(vectors[0], vectors[1]) > cosine(vectors[0], vectors[2]) + 0.2
    assert view["result_url"] is None  # small enough to come back inline


def test_large_inputs_travel_through_the_object_store(stack, api):
    texts = [f"{i:02d} " + "lorem ipsum dolor sit amet " * 40 for i in range(6)]
    assert len(json.dumps(texts)) > INLINE_PAYLOAD_MAX
    accepted = api.post("/v1/tasks", json={"model": "synthetic", "inputs": texts})
    assert accepted.status_code == 202, accepted.text
    task_id = accepted.json()["task_id"]
    # The claim check sits in SeaweedFS, where the API put it ...
    s3 = stack.client("s3")
    (key,) = [o["Key"] for o in s3.list_objects_v2(Bucket="sluice-payloads", Prefix=f"inputs/{TENANT}/{task_id}")["Contents"]]
    stored = s3.get_object(Bucket="sluice-payloads", Key=key)
    assert json.loads(stored["Body"].read()) == texts
    view = wait_task(stack, api, task_id)
    assert view["status"] == "succeeded", view
    # ... and the worker read exactly those inputs back from it.
    expected = [{"length": len(t), "sha256": hashlib.sha256(t.encode()).hexdigest()[:16]} for t in texts]
    assert view["result"] == {"outputs": expected}


def test_a_large_result_is_fetched_through_its_presigned_url(stack, api):
    texts = [f"Sentence number {i} about GPUs, queues and batching." for i in range(8)]
    accepted = api.post("/v1/tasks", json={"model": "minilm-embed", "inputs": texts, "priority": "normal"})
    assert accepted.status_code == 202, accepted.text
    view = wait_task(stack, api, accepted.json()["task_id"])
    assert view["status"] == "succeeded", view
    assert view["result"] is None and view["result_url"], view
    assert view["result_url"].startswith(f"{stack.public_s3}/sluice-payloads/results/{TENANT}/")
    # A plain GET, no AWS credentials: the signature in the URL, made for the host
    # the client names, is the authorization (SeaweedFS checks it, as MinIO does).
    with urllib.request.urlopen(view["result_url"], timeout=10) as response:
        body = response.read()
    assert len(body) > INLINE_RESULT_MAX
    result = json.loads(body)
    assert result["dim"] == 384 and len(result["embeddings"]) == len(texts)


def test_a_batch_across_all_three_priorities(stack, api):
    tasks = [{"model": "synthetic", "inputs": [f"{p} task"], "priority": p} for p in ("low", "normal", "high")]
    accepted = api.post("/v1/tasks/batch", json={"tasks": tasks})
    assert accepted.status_code == 202, accepted.text
    views = [wait_task(stack, api, t["task_id"]) for t in accepted.json()["tasks"]]
    assert [v["status"] for v in views] == ["succeeded"] * 3
    assert [v["priority"] for v in views] == ["low", "normal", "high"]
    assert [v["result"]["outputs"][0]["length"] for v in views] == [len(t["inputs"][0]) for t in tasks]


def test_characters_sqs_refuses_in_a_body_still_travel(stack, api):
    # U+FFFE and U+FFFF are valid in JSON but refused by SQS in a message body:
    # sent raw, the submit failed with a 503 that no retry could cure.
    texts = ["a\uffffb", "\ufffe"]
    accepted = api.post("/v1/tasks", json={"model": "synthetic", "inputs": texts})
    assert accepted.status_code == 202, accepted.text
    view = wait_task(stack, api, accepted.json()["task_id"])
    assert view["status"] == "succeeded", view
    expected = [hashlib.sha256(t.encode()).hexdigest()[:16] for t in texts]
    assert [o["sha256"] for o in view["result"]["outputs"]] == expected


def test_an_unknown_key_is_refused(stack):
    response = httpx.get(f"{stack.api_url}/v1/models", headers={"x-api-key": "not-a-key"}, timeout=10)
    assert response.status_code == 403


def test_worker_and_api_stop_cleanly_on_sigterm(stack):
    """Runs last in this module: stops the entrypoints the way Docker and Kubernetes do."""
    assert stack.worker.stop(timeout_s=30) == 0, stack.worker.tail()  # 0: it exited within the 30 s
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit says why.
    assert stack.api.stop(timeout_s=15) in (0, -signal.SIGTERM), stack.api.tail()
    assert "Finished server process" in stack.api.log.read_text(), stack.api.tail()
