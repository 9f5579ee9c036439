"""Every SLUICE_* variable the deployment files set is one the code reads.

Settings ignores variables it does not know (extra="ignore": the environment
holds many), so a misspelt name in a manifest (SLUICE_MAX_BATCHSIZE) would
leave its setting at the default without a word."""

from __future__ import annotations

import re

import pytest
import yaml
import dockerfile_reader
from dockerfile_reader import ROOT

from sluice.settings import ENV_PREFIX, Settings

_NAME = re.compile(r"\bSLUICE_[A-Z0-9_]+\b")
_PRODUCT = ["sluice", "containers", "lambdas", "models", "onprem"]


def read_by_the_code() -> set[str]:
    """Settings' fields, and the names the code reads itself (os.environ, a model's own)."""
    names = {ENV_PREFIX + field.upper() for field in Settings.model_fields}
    for top in _PRODUCT:
        for path in (ROOT / top).rglob("*.py"):
            if "node_modules" not in path.parts:
                names |= {m for m in re.findall(r"[\"'](SLUICE_[A-Z0-9_]+)[\"']", path.read_text())}
    return names


def compose_names() -> set[str]:
    doc = yaml.safe_load((ROOT / "onprem" / "compose.yaml").read_text())
    blocks = [v for k, v in doc.items() if k.startswith("x-") and isinstance(v, dict)]
    blocks += [service.get("environment") or {} for service in doc["services"].values()]
    names = set()
    for block in blocks:
        env = block.get("environment", block) if isinstance(block, dict) else {}
        if isinstance(env, list):  # KEY=value items
            env = dict(item.split("=", 1) for item in env)
        names |= {k for k in env if k.startswith("SLUICE_")}
    return names


def k8s_names() -> set[str]:
    names = set()
    for path in (ROOT / "onprem" / "k8s").rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            if doc.get("kind") == "ConfigMap":
                names |= {k for k in doc.get("data", {}) if k.startswith("SLUICE_")}
            for container in (doc.get("spec", {}).get("template", {}).get("spec", {}).get("containers") or []):
                names |= {e["name"] for e in container.get("env") or [] if e["name"].startswith("SLUICE_")}
    return names


def cdk_names() -> set[str]:
    # The environments the constructs hand to functions, pods and the endpoint.
    return {m for path in (ROOT / "cdk").glob("*.py") for m in re.findall(r"[\"'](SLUICE_[A-Z0-9_]+)[\"']",
                                                                          path.read_text())}


def dockerfile_names() -> set[str]:
    # Read by instruction: an ENV continued over lines sets names on each.
    return {name for path in (ROOT / "containers").rglob("Dockerfile") for name in dockerfile_reader.env(path)
            if name.startswith("SLUICE_")}


def test_the_dockerfiles_names_include_those_of_continued_env_lines():
    assert {"SLUICE_HOST", "SLUICE_PORT", "SLUICE_DEVICE"} <= dockerfile_names()


@pytest.mark.parametrize("where, names", [("compose.yaml", compose_names), ("onprem/k8s", k8s_names),
                                          ("cdk", cdk_names), ("Dockerfiles", dockerfile_names)])
def test_every_sluice_variable_set_is_one_the_code_reads(where, names):
    found = names()
    assert found, f"no SLUICE_ variable found in {where}: the reader is broken"
    unknown = sorted(found - read_by_the_code())
    assert not unknown, f"{where} sets {unknown}, which nothing reads"


def test_the_check_catches_a_misspelt_name():
    assert "SLUICE_MAX_BATCHSIZE" not in read_by_the_code()
    assert "SLUICE_MAX_BATCH_SIZE" in read_by_the_code()
