"""One synth per test session: both stacks, cdk-nag enforced, templates kept on disk."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION", "20")


@pytest.fixture(scope="session")
def synth(tmp_path_factory):
    from aws_cdk.assertions import Template

    from cdk.build import build_app, new_app

    # A stand-in build context: synth only stages it, and the test must not
    # depend on (or copy) the real worker image's sources.
    image = tmp_path_factory.mktemp("image")
    (image / "containers" / "worker").mkdir(parents=True)
    (image / "containers" / "worker" / "Dockerfile").write_text("FROM scratch\n")
    outdir = tmp_path_factory.mktemp("cdk.out")

    started = time.perf_counter()
    app = new_app(context={"sluice.image_directory": str(image)}, outdir=str(outdir))
    app, stacks = build_app(app)
    app.synth()  # raises if cdk-nag reports any unacknowledged finding
    seconds = time.perf_counter() - started

    templates = {}
    raw = {}
    for backend, stack in stacks.items():
        raw[backend] = json.loads((outdir / f"{stack.stack_name}.template.json").read_text())
        templates[backend] = Template.from_json(raw[backend])
    return SimpleNamespace(
        outdir=Path(outdir), stacks=stacks, templates=templates, raw=raw, seconds=seconds,
        config={b: s.config for b, s in stacks.items()},
    )


@pytest.fixture(params=["eks", "sagemaker"])
def backend(request):
    return request.param
