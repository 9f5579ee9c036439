"""cfn-lint (installed into the project's venv) on both synthesized templates."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# W3005: CDK adds DependsOn on a function's role so that the role's *policy*
# exists before the function; cfn-lint sees only the role and calls it redundant.
IGNORED = ["W3005"]


def test_cfn_lint_passes_on_both_templates(synth):
    templates = sorted(str(p) for p in synth.outdir.glob("*.template.json"))
    assert len(templates) == 2
    cfn_lint = Path(sys.executable).with_name("cfn-lint")
    result = subprocess.run(
        [str(cfn_lint), "--ignore-checks", *IGNORED, "--", *templates],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
