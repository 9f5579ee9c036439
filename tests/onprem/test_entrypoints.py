"""The image entrypoints create whatever is missing before they start when
SLUICE_BOOTSTRAP_ON_START=1, which onprem/compose.yaml sets on the api and the
workers (and onprem/k8s/onprem on the workers): LocalStack keeps its state in
memory, and after a host reboot Docker restarts the containers without
compose's `init` step. Here both entrypoints start together, as they do then,
against a server that holds nothing.

They also read SLUICE_LOG_LEVEL in any case (compose hands the same value to the
API, whose uvicorn takes `debug`, and to the workers), and refuse a value that
is no level in one line, not a traceback in a restart loop."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request

import boto3
import pytest
from dockerfile_reader import ROOT, cmd, env
from servers import BIN, CREDENTIALS, REGION, Processes, clean_env, free_port, http_ok, start_moto, wait_for

from sluice.settings import LOG_LEVELS, SettingsError, log_level

API_DOCKERFILE = ROOT / "containers" / "api" / "Dockerfile"
WORKER_DOCKERFILE = ROOT / "containers" / "worker" / "Dockerfile"
SERVE = ROOT / "containers" / "sagemaker" / "serve.py"


def image_command(dockerfile_args: list[str]) -> list[str]:
    program, *rest = dockerfile_args
    return [sys.executable if program == "python" else str(BIN / program), *rest]


def without_web_stack(args: list[str]) -> list[str]:
    """A `python script.py` command run as the worker image has it: no web framework
    installed (the dev venv has them all, so an import of one would pass here)."""
    program, script = args
    blocker = ("import runpy, sys\n"
               "for m in ('fastapi', 'starlette', 'uvicorn', 'mangum'): sys.modules[m] = None\n"
               f"sys.argv = [{script!r}]\n"
               f"runpy.run_path({script!r}, run_name='__main__')\n")
    return [program, "-c", blocker]


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
        worker = procs.start("worker", without_web_stack(image_command(cmd(WORKER_DOCKERFILE))),
                             {**base, **env(WORKER_DOCKERFILE)})
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
    # AWS (EKS, SageMaker): the stack owns the resources, and the roles may not
    # create them; likewise wherever an operator leaves the setting out.
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


def test_log_level_takes_any_case_and_names_the_variable_and_values_when_refused():
    for raw, level in [("debug", "DEBUG"), ("Info", "INFO"), (" warning ", "WARNING"), ("ERROR", "ERROR"),
                       ("critical", "CRITICAL"), ("", "INFO"),
                       # compose gives the API and the workers one value: uvicorn's trace, logging's warn
                       ("trace", "DEBUG"), ("WARN", "WARNING"), ("fatal", "CRITICAL")]:
        assert log_level({"SLUICE_LOG_LEVEL": raw}) == level, raw
    assert log_level({}) == "INFO"
    for raw in ("verbose", "10", "warn ing"):
        with pytest.raises(SettingsError) as refused:
            log_level({"SLUICE_LOG_LEVEL": raw})
        message = str(refused.value)
        assert "\n" not in message and message.startswith(f"SLUICE_LOG_LEVEL={raw!r}")
        assert all(name in message for name in LOG_LEVELS), message


def entrypoints() -> dict[str, list[str]]:
    return {"api": image_command(cmd(API_DOCKERFILE)), "worker": image_command(cmd(WORKER_DOCKERFILE)),
            "sagemaker": [sys.executable, str(SERVE)]}  # the worker image's `serve`


@pytest.mark.parametrize("name", ["api", "worker", "sagemaker"])
def test_an_unknown_log_level_stops_an_entrypoint_with_one_line(name):
    env = {**clean_env(), **CREDENTIALS, "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "SLUICE_LOG_LEVEL": "verbose", "SLUICE_MODELS": "synthetic"}
    run = subprocess.run(entrypoints()[name], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    output = (run.stdout + run.stderr).strip()
    assert run.returncode == 2, output
    assert len(output.splitlines()) == 1 and "Traceback" not in output, output
    assert "SLUICE_LOG_LEVEL='verbose'" in output and all(level in output for level in LOG_LEVELS), output


@pytest.mark.parametrize("name", ["api", "worker", "sagemaker"])
@pytest.mark.parametrize("refused", [{"SLUICE_LOG_LEVEL": "verbose"}, {"SLUICE_MAX_BATCH_SIZE": "abc"},
                                     {"SLUICE_SYNTHETIC_FAULTS": "sometimes"}],
                         ids=["log level", "setting", "a model's setting"])
def test_a_refused_setting_stops_an_entrypoint_before_its_bootstrap_naming_it(name, refused):
    # As compose and onprem/k8s start them: the bootstrap on, and here nothing
    # to reach. The setting is refused first, in a line naming it, not a
    # traceback from the bootstrap's own Settings() or its first call.
    env = {**clean_env(), **CREDENTIALS, "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_ENDPOINT_URL": "http://127.0.0.1:9", "SLUICE_BOOTSTRAP_ON_START": "1", "SLUICE_MODELS": "synthetic",
           **refused}
    run = subprocess.run(entrypoints()[name], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    output = (run.stdout + run.stderr).strip()
    assert run.returncode == 2, output
    assert "Traceback" not in output and "refused settings" in output, output
    [(variable, value)] = refused.items()
    assert f"{variable}={value!r}" in output, output


def test_the_worker_takes_a_lowercase_log_level():
    # `debug` once crashed logging.basicConfig (ValueError: Unknown level), so the
    # worker never got as far as its settings. A refused setting shows it does.
    env = {**clean_env(), **CREDENTIALS, "AWS_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
           "SLUICE_LOG_LEVEL": "debug", "SLUICE_MODELS": "synthetic", "SLUICE_MAX_BATCH_SIZE": "abc"}
    run = subprocess.run(entrypoints()["worker"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    output = run.stdout + run.stderr
    assert run.returncode == 2 and "Traceback" not in output, output
    assert "ERROR worker[" in output and "refused settings" in output and "SLUICE_MAX_BATCH_SIZE='abc'" in output


def test_the_sagemaker_server_takes_a_lowercase_log_level(tmp_path):
    procs = Processes(tmp_path)
    try:
        port = free_port()
        serve = procs.start("sagemaker", entrypoints()["sagemaker"], {
            **clean_env(), "AWS_REGION": REGION, "SLUICE_LOG_LEVEL": "debug", "SLUICE_MODELS": "synthetic",
            "SAGEMAKER_BIND_TO_PORT": str(port)})
        wait_for(lambda: http_ok(f"http://127.0.0.1:{port}/ping"), 60, "serve.py /ping", serve)
        assert " DEBUG sagemaker[" in serve.log.read_text(errors="replace")  # the /ping above, at debug
        serve.popen.send_signal(signal.SIGTERM)
        assert serve.popen.wait(30) == 0
    finally:
        procs.stop_all()


def test_api_server_parses_with_httptools_on_uvloop():
    """uvicorn takes its C parser and loop when they are installed and falls back
    to h11 and asyncio without a word otherwise: 0.3-0.5 ms more per request
    (docs/benchmarks.md, section 1). The api extra installs both; this is the
    configuration containers/api/main.py runs (uvicorn's defaults)."""
    from uvicorn import Config

    config = Config(app=lambda scope, receive, send: None)
    config.load()
    assert config.http_protocol_class.__name__ == "HttpToolsProtocol"
    assert config.get_loop_factory().__module__.split(".")[0] == "uvloop"


def test_every_level_one_side_takes_the_other_takes_too():
    """Compose hands the API and the workers one SLUICE_LOG_LEVEL: none may stop one side only."""
    import importlib.util

    from uvicorn.config import LOG_LEVELS as UVICORN_LEVELS

    spec = importlib.util.spec_from_file_location("api_main", ROOT / "containers" / "api" / "main.py")
    api_main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_main)
    for raw in [*UVICORN_LEVELS, *LOG_LEVELS, "warn", "fatal"]:
        assert log_level({"SLUICE_LOG_LEVEL": raw}), raw  # the worker's and serve's
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLUICE_LOG_LEVEL", raw)
            assert api_main.log_level(), raw  # the API's
