"""Builds the CDK app: one SluiceStack per configured worker backend."""

from __future__ import annotations

import json
import os
from pathlib import Path

from aws_cdk import App, Validations
from cdk_nag import AwsSolutionsChecks

from cdk import bundling
from cdk.config import SluiceConfig
from cdk.stack import SluiceStack

ROOT = Path(__file__).resolve().parent.parent
STACK_NAMES = {"eks": "SluiceEks", "sagemaker": "SluiceSageMaker"}


def cdk_json_context(root: Path = ROOT) -> dict:
    return json.loads((root / "cdk.json").read_text()).get("context", {})


def new_app(context: dict | None = None, outdir: str | None = None, root: Path = ROOT) -> App:
    """An App with cdk.json's context, as the CDK CLI would pass it.

    Run as `python app.py` (make synth), there is no CLI to read cdk.json or to
    choose the output directory, so this does both.
    """
    if "CDK_CONTEXT_JSON" in os.environ or "CDK_OUTDIR" in os.environ:
        return App(context=context) if context else App()
    merged = {**cdk_json_context(root), **(context or {})}
    return App(context=merged, outdir=outdir or str(root / "cdk.out"))


def build_app(app: App | None = None, *, root: Path = ROOT) -> tuple[App, dict[str, SluiceStack]]:
    app = app or new_app(root=root)
    config = SluiceConfig.from_context(app.node)
    layer_dir, code_dir = bundling.build(root=root)
    stacks = {
        backend: SluiceStack(
            app,
            STACK_NAMES[backend],
            config=config.with_backend(backend),
            root=root,
            layer_dir=layer_dir,
            code_dir=code_dir,
            description=f"Sluice asynchronous inference ({backend} workers)",
        )
        for backend in config.backends
    }
    # Any unacknowledged finding fails the synth.
    Validations.of(app).add_plugins(AwsSolutionsChecks(app))
    return app, stacks
