"""docker/Dockerfile cannot be built here (no container engine, no image registry), so it is kept correct by
reading it: every path it copies exists, its entrypoint runs train.py with the venv `make venv` creates
from its working directory, and the README's build and run lines (and the Dockerfile's own header) agree
with it: same file and tag, the run's arguments compose as train.py overrides, and the run directory lands
in the mounted volume."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def readme_docker_lines() -> list[list[str]]:
    block = re.search(r"### Container.*?```bash\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert block, "README.md has no Container section with a bash block"
    return [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]


def test_every_copied_path_exists():
    copies = [shlex.split(args) for op, args in instructions() if op == "COPY"]
    assert copies
    for words in copies:
        sources = [w for w in words[:-1] if not w.startswith("--")]
        for src in sources:
            assert (ROOT / src).exists(), f"the Dockerfile copies {src}, which is not in the repository"


def test_entrypoint_runs_train_py_from_the_venv_make_creates():
    ops = instructions()
    workdir = [args for op, args in ops if op == "WORKDIR"][-1]
    entry = json.loads([args for op, args in ops if op == "ENTRYPOINT"][-1])
    assert entry == [".venv/bin/python", "train.py"]
    copied = {Path(shlex.split(args)[-2]).name for op, args in ops if op == "COPY"}
    assert "train.py" in copied and "conf" in copied and "kimi" in copied
    assert any(op == "RUN" and "make venv" in args for op, args in ops)
    assert re.search(r"^VENV\s*\??=\s*\.venv\s*$", (ROOT / "Makefile").read_text(), re.M)
    assert workdir == "/kimi"


def test_the_readme_lines_match_the_dockerfile_and_compose():
    from kimi.summary import compose_config

    build, run = readme_docker_lines()
    assert build[:2] == ["docker", "build"] and build[build.index("-f") + 1] == "docker/Dockerfile"
    tag = build[build.index("-t") + 1]
    assert run[:2] == ["docker", "run"]
    image = run.index(tag)  # the arguments after the image go to the entrypoint, train.py
    volume = run[run.index("-v") + 1].split(":")[1]
    overrides = run[image + 1:]
    run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir="))
    workdir = [args for op, args in instructions() if op == "WORKDIR"][-1]
    assert (Path(workdir) / run_dir).is_relative_to(volume), (
        f"the run directory {workdir}/{run_dir} is outside the mounted volume {volume}: it would be lost")
    compose_config([o for o in overrides if not o.startswith("hydra.")])  # train.py's overrides, valid
    header = [line.lstrip("# ").strip() for line in DOCKERFILE.read_text().splitlines()[:4]]
    for words in (build, run):
        assert shlex.join(words) in [shlex.join(shlex.split(h)) for h in header if h.startswith("docker ")], (
            "docker/Dockerfile's header and the README's Container lines differ")
