"""The install steps of the Makefile, as make would run them (`make -n`: printed, not run)."""

from __future__ import annotations

import platform
import shlex
import subprocess

from tests.conftest import ROOT


def install_commands() -> list[list[str]]:
    # -B: as on a fresh clone, every step of the install is due.
    out = subprocess.run(["make", "-n", "-B", ".venv/.installed"], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [shlex.split(line) for line in out.splitlines() if " pip install " in f" {line} "]


def test_torch_is_installed_first_and_can_only_be_the_cpu_build():
    commands = install_commands()
    torch = [c for c in commands if any(arg.startswith("torch") for arg in c)]
    assert torch and commands.index(torch[0]) == 1  # after pip's own upgrade, before anything needing torch
    (spec,) = [arg for arg in torch[0] if arg.startswith("torch")]
    if platform.system() == "Linux":
        # PyPI's torch==2.13.0 for Linux is the CUDA build (several GB): only the
        # `+cpu` local version, which PyPI does not have, rules it out.
        assert spec == "torch==2.13.0+cpu"
        assert "https://download.pytorch.org/whl/cpu" in torch[0]
    else:
        assert spec == "torch==2.13.0"


def test_no_script_lets_pip_resolve_a_bare_torch():
    # The peers' venv (bench/setup_peers.sh) and the GPU kit install torch too: a
    # bare `torch==2.13.0` is the multi-GB CUDA build on Linux.
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    for script in sorted((root / "bench").glob("*.sh")):
        for line in script.read_text().splitlines():
            if "pip install" in line and re.search(r"\btorch==", line):
                assert "torch==2.13.0+cpu" in line or "+cu" in line, f"{script.name}: {line.strip()}"
            if "pip install" in line and "$TORCH" in line:
                assert "TORCH='torch==2.13.0+cpu'" in script.read_text(), script.name
