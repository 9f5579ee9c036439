"""A small Dockerfile reader for the tests: enough to check instructions and to run
an image's CMD and HEALTHCHECK as processes. Not a general Dockerfile parser."""

from __future__ import annotations

import fnmatch
import json
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


def instructions(path: Path) -> list[Instruction]:
    out: list[Instruction] = []
    pending, start = "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comments inside a continued instruction are dropped by Docker too
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        out.append(Instruction(keyword.upper(), args.strip(), start))
    return out


def one(path: Path, keyword: str) -> Instruction:
    found = [i for i in instructions(path) if i.keyword == keyword]
    assert len(found) == 1, f"{path.name}: expected one {keyword}, found {len(found)}"
    return found[0]


def exec_form(args: str) -> list[str]:
    """The JSON array of an exec-form CMD/HEALTHCHECK CMD."""
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def cmd(path: Path) -> list[str]:
    return exec_form(one(path, "CMD").args)


def healthcheck(path: Path) -> tuple[dict[str, str], list[str]]:
    args = one(path, "HEALTHCHECK").args
    options, _, command = args.partition(" CMD ")
    flags = dict(opt.lstrip("-").split("=", 1) for opt in options.split())
    return flags, exec_form(command.strip())


def env(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    for ins in instructions(path):
        if ins.keyword == "ENV":
            for pair in shlex.split(ins.args):
                key, _, value = pair.partition("=")
                values[key] = value
    return values


def copy_sources(path: Path) -> list[str]:
    sources = []
    for ins in instructions(path):
        if ins.keyword == "COPY":
            parts = [p for p in shlex.split(ins.args) if not p.startswith("--")]
            sources += parts[:-1]
    return sources


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(relative: str, patterns: list[str]) -> bool:
    """Docker's rule for the patterns used here: a pattern excludes a path or any
    of its parent directories; `**/` matches any number of directories."""
    parts = relative.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        if pattern.startswith("!"):
            raise AssertionError("exception patterns are not handled by this reader")
        for candidate in candidates:
            if fnmatch.fnmatchcase(candidate, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(candidate.rsplit("/", 1)[-1], pattern[3:]):
                return True
    return False
