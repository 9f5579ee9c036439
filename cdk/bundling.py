"""Lambda code built without Docker, so `cdk synth` works on a machine without one.

Two asset directories under build/lambda/:

* ``layer-<hash>/layer.zip``: the third-party packages, installed with
  ``pip install --target`` for the Lambda runtime's Python and platform, then
  zipped. The hash covers the requirement list, so pip runs only when it changes.
* ``code/``: our own modules (sluice, the torch-free part of models, lambdas),
  copied afresh on every synth; CDK hashes the content, so an unchanged copy is
  an unchanged asset.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAMBDA_PYTHON = "3.14"
LAMBDA_PLATFORM = "manylinux2014_x86_64"

# boto3 and botocore are bundled as a pair, though the runtime has its own: the
# X-Ray SDK brings botocore along anyway, and a bundled botocore beside the
# runtime's older boto3 would be a pair nobody tested. They are pinned to this
# environment's, the pair the tests ran with; layers come first on the path.
_SDK = ("boto3", "botocore")
# Powertools Tracer needs the X-Ray SDK, which the runtime does not have.
_EXTRA = ["aws-xray-sdk>=2.14"]
# The API only lists models: registry + base never import torch.
_MODEL_FILES = ("__init__.py", "base.py", "registry.py")


def requirements(root: Path = ROOT) -> list[str]:
    """The core dependencies plus the `api` extra, from pyproject.toml."""
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    wanted = list(project["dependencies"]) + list(project["optional-dependencies"]["api"]) + _EXTRA
    # uvicorn and its parser and loop are the local server; in Lambda, Mangum is.
    skip = {"uvicorn", "httptools", "uvloop", *_SDK}
    return sorted([r for r in wanted if _name(r) not in skip] + [f"{name}=={version(name)}" for name in _SDK])


def _name(requirement: str) -> str:
    for sep in "<>=!~[; ":
        requirement = requirement.split(sep, 1)[0]
    return requirement.strip().lower().replace("_", "-")


def build_layer(out: Path, root: Path = ROOT) -> Path:
    reqs = requirements(root)
    key = hashlib.sha256(json.dumps([reqs, LAMBDA_PYTHON, LAMBDA_PLATFORM]).encode()).hexdigest()[:16]
    target = out / f"layer-{key}"
    if (target / ".complete").exists():
        return target
    staging = out / f".layer-{key}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--target", str(staging / "python"),
        "--platform", LAMBDA_PLATFORM, "--implementation", "cp",
        "--python-version", LAMBDA_PYTHON, "--only-binary=:all:",
        *reqs,
    ]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"pip could not build the Lambda layer:\n{result.stderr[-3000:]}")
    # Byte code and metadata of console scripts differ per build: drop them so
    # the asset hash depends on the packages only.
    for junk in list((staging / "python").rglob("__pycache__")) + [staging / "python" / "bin"]:
        shutil.rmtree(junk, ignore_errors=True)
    _deterministic_zip(staging / "python", staging / "layer.zip", prefix="python")
    (staging / ".complete").write_text("\n".join(reqs) + "\n")
    try:
        staging.rename(target)
    except OSError:  # another process finished the same layer first
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _deterministic_zip(source: Path, archive: Path, prefix: str) -> None:
    """One zip file instead of a directory of thousands of files: CDK then copies
    and hashes a single file on every synth. Fixed timestamps and order keep the
    hash (and so the layer version) stable across rebuilds."""
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for path in sorted(source.rglob("*")):
            if path.is_file():
                info = zipfile.ZipInfo(f"{prefix}/{path.relative_to(source).as_posix()}", date_time=(1980, 1, 1, 0, 0, 0))
                info.external_attr = 0o644 << 16
                info.compress_type = zipfile.ZIP_DEFLATED
                zf.writestr(info, path.read_bytes())


def build_code(out: Path, root: Path = ROOT) -> Path:
    target = out / "code"
    shutil.rmtree(target, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "tests")
    shutil.copytree(root / "sluice", target / "sluice", ignore=ignore)
    shutil.copytree(root / "lambdas", target / "lambdas", ignore=ignore)
    (target / "models").mkdir()
    for name in _MODEL_FILES:
        shutil.copy2(root / "models" / name, target / "models" / name)
    return target


def build(out: Path | None = None, root: Path = ROOT) -> tuple[Path, Path]:
    """(layer directory, code directory) for the Lambda functions; the layer
    asset is ``layer.zip`` inside the former, its unpacked files in ``python/``."""
    out = out or root / "build" / "lambda"
    out.mkdir(parents=True, exist_ok=True)
    return build_layer(out, root), build_code(out, root)
