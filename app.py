#!/usr/bin/env python3
"""CDK entry point: `make synth`, or `cdk synth|deploy` through cdk.json."""

from cdk.build import build_app

app, _ = build_app()
app.synth()
