"""onprem/k8s/ checked offline. Core kinds: `kubernetes-validate --strict` (unknown
fields are errors). KEDA kinds, which kubernetes-validate has no schema for: the
models generated from KEDA's CRDs (cloudcoil-models-keda), made strict by
requiring a lossless round trip, plus the aws-sqs-queue scaler's parameters."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml
from cloudcoil.models.keda import v1alpha1 as keda
from dockerfile_reader import ROOT

from sluice.contract import Priority
from sluice.settings import Settings, model_names_of

K8S = ROOT / "onprem" / "k8s"
FILES = sorted(K8S.rglob("*.yaml"))
SITES = ["onprem", "eks"]
VALIDATE = Path(sys.executable).with_name("kubernetes-validate")
# KEDA's documented aws-sqs-queue trigger metadata (2.13+).
SQS_TRIGGER_PARAMETERS = {
    "queueURL", "queueURLFromEnv", "queueLength", "activationQueueLength", "awsRegion", "awsEndpoint",
    "scaleOnInFlight", "scaleOnDelayed", "identityOwner",
}
PRIORITIES = ["high", "normal", "low"]
# The sluice-config keys one site sets and the other does not, besides the on-prem
# endpoints (AWS_ENDPOINT_URL_<SERVICE>), each with the reason.
EKS_ONLY = {
    # The CDK stack made the queues with these (maxReceiveCount, visibility timeout); the
    # worker must use the same. On-prem, bootstrap makes the queues with the worker's own.
    "SLUICE_MAX_ATTEMPTS": None,
    "SLUICE_VISIBILITY_TIMEOUT_S": None,
    # Sized from the stack's longest_batch_s; on-prem the worker's default stands.
    "SLUICE_INFERENCE_TIMEOUT_S": None,
}
ONPREM_ONLY = {
    # LocalStack forgets its queues when it restarts; a restarted worker recreates them.
    # On EKS the stack owns them, and the worker's role may not create them.
    "SLUICE_BOOTSTRAP_ON_START": "1",
}


def documents(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def site(name: str) -> dict[tuple[str, str], dict]:
    """Everything `kubectl apply -f common -f <site>` creates, by (kind, name)."""
    out = {}
    for path in sorted((K8S / "common").glob("*.yaml")) + sorted((K8S / name).glob("*.yaml")):
        for doc in documents(path):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in out, f"{key} defined twice for {name}"
            out[key] = doc
    return out


def test_layout():
    assert {p.relative_to(K8S).parts[0] for p in FILES} == {"common", *SITES}


@pytest.mark.parametrize("version", ["1.29.0", "1.37.0"])  # oldest EKS extended support .. newest schema
def test_core_kinds_pass_kubernetes_validate_strict(version):
    assert VALIDATE.exists(), "kubernetes-validate is missing: `make install` installs it"
    run = subprocess.run([str(VALIDATE), "--strict", "-k", version, *map(str, FILES)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = (run.stdout + run.stderr).splitlines()
    assert not [line for line in lines if line.startswith("ERROR")]
    # The only things it cannot check are KEDA's kinds: they are checked below.
    unchecked = [line for line in lines if line.startswith("WARN")]
    assert unchecked and all("api version keda.sh/v1alpha1" in line for line in unchecked), unchecked
    passed = [line for line in lines if line.startswith("INFO") and " passed " in line]
    core = [d for p in FILES for d in documents(p) if not d["apiVersion"].startswith("keda.sh/")]
    assert len(passed) == len(core)


def test_kubernetes_validate_strict_rejects_unknown_fields(tmp_path):
    bad = tmp_path / "bad.yaml"
    deployment = documents(K8S / "common" / "worker-deployment.yaml")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["gpu"] = 1
    bad.write_text(yaml.safe_dump(deployment))
    run = subprocess.run([str(VALIDATE), "--strict", str(bad)], capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "'gpu' was unexpected" in run.stdout + run.stderr


KEDA_KINDS = {"ScaledObject": keda.ScaledObject, "TriggerAuthentication": keda.TriggerAuthentication}


def keda_strict(doc: dict) -> None:
    """Validate against the CRD model; anything dropped or coerced on the way is an error."""
    model = KEDA_KINDS[doc["kind"]].model_validate(doc)
    again = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
    assert again == doc, f"{doc['kind']}/{doc['metadata']['name']}: not a lossless fit for the KEDA CRD"


@pytest.mark.parametrize("name", SITES)
def test_keda_objects_fit_the_keda_crds(name):
    objects = [d for d in site(name).values() if d["apiVersion"] == "keda.sh/v1alpha1"]
    assert sorted(d["kind"] for d in objects) == ["ScaledObject", "TriggerAuthentication"]
    for doc in objects:
        keda_strict(doc)


def test_the_keda_check_rejects_unknown_and_mistyped_fields():
    scaled = site("onprem")[("ScaledObject", "sluice-worker")]
    with pytest.raises(AssertionError, match="lossless"):
        keda_strict({**scaled, "spec": {**scaled["spec"], "maxReplicas": 3}})
    with pytest.raises(Exception):
        keda_strict({**scaled, "spec": {**scaled["spec"], "minReplicaCount": "one"}})


@pytest.mark.parametrize("name", SITES)
def test_one_sqs_trigger_per_priority_reading_the_workers_queue_urls(name):
    objects = site(name)
    scaled = objects[("ScaledObject", "sluice-worker")]
    deployment = objects[("Deployment", scaled["spec"]["scaleTargetRef"]["name"])]
    config = objects[("ConfigMap", "sluice-config")]["data"]
    triggers = scaled["spec"]["triggers"]
    assert [t["name"] for t in triggers] == PRIORITIES
    lengths = []
    for priority, trigger in zip(PRIORITIES, triggers):
        assert trigger["type"] == "aws-sqs-queue"
        metadata = trigger["metadata"]
        assert set(metadata) <= SQS_TRIGGER_PARAMETERS
        assert objects[("TriggerAuthentication", trigger["authenticationRef"]["name"])]
        assert metadata["awsRegion"] == config["AWS_REGION"]
        # The worker reads the same variable (Settings.queue_url_<priority>), so the
        # scaler always watches the queues the workers drain.
        variable = metadata["queueURLFromEnv"]
        assert variable == f"SLUICE_QUEUE_URL_{priority.upper()}"
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        assert {"configMapRef": {"name": "sluice-config"}} in container["envFrom"]
        # KEDA takes the queue name from a path of exactly /<account>/<queue>.
        path = urlparse(config[variable]).path.split("/")
        assert len(path) == 3 and path[1].isdigit() and path[2] == f"sluice-{priority}", config[variable]
        if name == "onprem":
            assert metadata["awsEndpoint"] == config["AWS_ENDPOINT_URL_SQS"]
            assert config[variable].startswith(config["AWS_ENDPOINT_URL_SQS"] + "/")
        else:
            assert "awsEndpoint" not in metadata
        lengths.append(int(metadata["queueLength"]))
    assert lengths == sorted(lengths), "high must scale out first"


def test_the_two_sites_differ_only_in_endpoints_credentials_and_the_named_settings():
    onprem, eks = site("onprem"), site("eks")
    assert onprem.keys() == eks.keys()
    a, b = onprem[("ScaledObject", "sluice-worker")], eks[("ScaledObject", "sluice-worker")]
    strip = [{**t, "metadata": {k: v for k, v in t["metadata"].items() if k != "awsEndpoint"}}
             for t in a["spec"]["triggers"]]
    assert {**a, "spec": {**a["spec"], "triggers": strip}} == b
    assert onprem[("TriggerAuthentication", "sluice-sqs")]["spec"]["secretTargetRef"]
    assert eks[("TriggerAuthentication", "sluice-sqs")]["spec"] == {"podIdentity": {"provider": "aws"}}
    on_cfg, eks_cfg = onprem[("ConfigMap", "sluice-config")]["data"], eks[("ConfigMap", "sluice-config")]["data"]
    endpoints = {k for k in on_cfg if k.startswith("AWS_ENDPOINT_URL_")}
    assert endpoints == {"AWS_ENDPOINT_URL_SQS", "AWS_ENDPOINT_URL_DYNAMODB", "AWS_ENDPOINT_URL_CLOUDWATCH",
                         "AWS_ENDPOINT_URL_S3"}
    assert set(on_cfg) - endpoints - set(ONPREM_ONLY) == set(eks_cfg) - set(EKS_ONLY)
    assert set(EKS_ONLY) <= set(eks_cfg) and not set(EKS_ONLY) & set(on_cfg)
    assert set(ONPREM_ONLY) <= set(on_cfg) and not set(ONPREM_ONLY) & set(eks_cfg)
    for config, named in ((eks_cfg, EKS_ONLY), (on_cfg, ONPREM_ONLY)):
        for key, value in named.items():
            assert value is None or config[key] == value, key  # None: checked against the stack below
    assert "AWS_ENDPOINT_URL" not in on_cfg


def test_keda_reads_the_same_credentials_the_onprem_workers_get():
    # KEDA's aws-sqs-queue scaler names its static credentials awsAccessKeyID and
    # awsSecretAccessKey; a wrong parameter, secret or key leaves it unable to
    # read the queues, and the workers never scale out.
    onprem = site("onprem")
    refs = onprem[("TriggerAuthentication", "sluice-sqs")]["spec"]["secretTargetRef"]
    pod = onprem[("Deployment", "sluice-worker")]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    [secret] = [e["secretRef"]["name"] for e in container["envFrom"] if "secretRef" in e]
    assert sorted((r["parameter"], r["name"], r["key"]) for r in refs) == [
        ("awsAccessKeyID", secret, "AWS_ACCESS_KEY_ID"), ("awsSecretAccessKey", secret, "AWS_SECRET_ACCESS_KEY")]


@pytest.mark.parametrize("name", SITES)
def test_workers_send_metrics_to_cloudwatch(name):
    # As the stack's own workers do (cdk/workers_eks_construct.py): the logging
    # add-on ships container logs, not EMF, so EMF on stdout never becomes a
    # metric on EKS; on-prem nothing reads stdout for it at all, and the
    # config points CloudWatch at LocalStack.
    assert site(name)[("ConfigMap", "sluice-config")]["data"]["SLUICE_METRICS_SINK"] == "cloudwatch"


class _Context:
    """What SluiceConfig.from_context reads from a CDK node: cdk.json's context."""

    def __init__(self):
        self.context = json.loads((ROOT / "cdk.json").read_text())["context"]

    def try_get_context(self, key):
        return self.context.get(key)

    def get_all_context(self):
        return dict(self.context)


def test_eks_workers_use_the_stacks_max_attempts_visibility_result_ttl_and_grace_period():
    # The stack made the queues with maxReceiveCount = max_attempts and its visibility
    # timeout; a worker with other values spends attempts the queue does not count, or
    # lets a message reappear while its batch still runs. The stack's bucket and API
    # keep results for result_ttl_days: a worker's finished records must last as long.
    from cdk.config import SluiceConfig

    eks = site("eks")
    config = eks[("ConfigMap", "sluice-config")]["data"]
    for stack in (SluiceConfig(), SluiceConfig.from_context(_Context())):
        assert int(config["SLUICE_MAX_ATTEMPTS"]) == stack.max_attempts
        assert int(config["SLUICE_VISIBILITY_TIMEOUT_S"]) == stack.visibility_timeout_s
        assert int(config["SLUICE_INFERENCE_TIMEOUT_S"]) == stack.inference_timeout_s
        assert int(config["SLUICE_RESULT_TTL_DAYS"]) == stack.result_ttl_days
        pod = eks[("Deployment", "sluice-worker")]["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == stack.termination_grace_s
    # Strings (a ConfigMap's data holds nothing else) that the worker accepts.
    worker = Settings(max_attempts=config["SLUICE_MAX_ATTEMPTS"],
                      visibility_timeout_s=config["SLUICE_VISIBILITY_TIMEOUT_S"])
    assert (worker.max_attempts, worker.visibility_timeout_s) == (stack.max_attempts, stack.visibility_timeout_s)


def test_eks_workers_serve_the_stacks_models_and_batch_as_its_own_workers_do():
    # The stack's API accepts tasks for its `models`: a model these workers do not
    # load would be handed back, receive after receive, until its tasks dead-letter.
    from cdk.config import SluiceConfig

    config = site("eks")[("ConfigMap", "sluice-config")]["data"]
    worker = Settings(**{key.removeprefix("SLUICE_").lower(): value for key, value in config.items()
                         if key in ("SLUICE_MODELS", "SLUICE_MAX_BATCH_SIZE", "SLUICE_MAX_WAIT_MS")})
    for stack in (SluiceConfig(), SluiceConfig.from_context(_Context())):
        assert (worker.model_names(), worker.max_batch_size, worker.max_wait_ms) == \
            (model_names_of(stack.models), stack.max_batch_size, stack.max_wait_ms)


def test_onprem_workers_recreate_what_a_restarted_localstack_lost():
    config = site("onprem")[("ConfigMap", "sluice-config")]["data"]
    assert config["SLUICE_BOOTSTRAP_ON_START"] == "1"
    # Bootstrap creates the queues by name (SLUICE_QUEUE_PREFIX): the URLs the worker
    # and KEDA read must name those very queues.
    settings = Settings(queue_prefix=Settings.model_fields["queue_prefix"].default)
    for priority in Priority:
        assert config[f"SLUICE_QUEUE_URL_{priority.value.upper()}"].rsplit("/", 1)[1] == settings.queue_name(priority)
    assert "SLUICE_QUEUE_PREFIX" not in config


def test_worker_pod_gets_one_gpu_runs_non_root_and_is_covered_by_the_pdb():
    objects = site("onprem")
    deployment = objects[("Deployment", "sluice-worker")]
    pod = deployment["spec"]["template"]
    container = pod["spec"]["containers"][0]
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 1 and resources["limits"]["nvidia.com/gpu"] == 1
    assert pod["spec"]["serviceAccountName"] == "sluice-worker"
    assert objects[("ServiceAccount", "sluice-worker")]
    security = pod["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == 10001  # the image's USER
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    # The worker needs longer than one batch to stop cleanly on SIGTERM.
    assert pod["spec"]["terminationGracePeriodSeconds"] >= 60
    pdb = objects[("PodDisruptionBudget", "sluice-worker")]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector == deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert pdb["spec"]["maxUnavailable"] == 1
    namespaces = {d["metadata"].get("namespace") for k, d in objects.items() if k[0] != "Namespace"}
    assert namespaces == {objects[("Namespace", "sluice")]["metadata"]["name"]}


@pytest.mark.parametrize("name", SITES)
def test_keda_alone_sets_the_worker_replica_count(name):
    # A `replicas` in the manifest resets the scaled-out Deployment on every
    # `kubectl apply`, which then fights KEDA (whose minReplicaCount covers it).
    objects = site(name)
    scaled = [d for d in objects.values() if d["kind"] == "ScaledObject"]
    assert scaled
    for doc in scaled:
        target = doc["spec"]["scaleTargetRef"]
        assert target.get("kind", "Deployment") == "Deployment"
        deployment = objects[("Deployment", target["name"])]
        assert "replicas" not in deployment["spec"], f"{target['name']} sets replicas; KEDA owns them"
        assert "minReplicaCount" in doc["spec"]  # what the Deployment starts from


def test_the_eks_triggers_look_up_the_queues_in_the_workers_region():
    # KEDA asks SQS in the trigger's awsRegion: set apart from the worker's, it
    # would look up the queues in another region and never scale.
    eks = site("eks")
    config = eks[("ConfigMap", "sluice-config")]["data"]
    regions = {t["metadata"]["awsRegion"] for t in eks[("ScaledObject", "sluice-worker")]["spec"]["triggers"]}
    url_regions = {config[f"SLUICE_QUEUE_URL_{p.upper()}"].split(".")[1] for p in PRIORITIES}
    assert regions == url_regions == {config["AWS_REGION"]}
