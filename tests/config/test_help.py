"""`--help` of every command a user is told about: each console script of pyproject.toml's [project.scripts],
each `python -m kimi...` that README.md or docs/ names, and train.py. Each must exit 0 without a traceback and
list its keys in the key=value table every kimi command uses (kimi.cli.keyvalue.table): a few keys with a
description (all of them where it has fewer), and no argparse `--flag` listing. The commands run in this
process (runpy, and each script's entry point as its generated wrapper calls it): one torch import for all,
where a subprocess each took 8-10 s on a 2-core CPU. And each answers without importing torch (its start-up
is 3-4 s of that), as a mistake in each command line is reported."""

from __future__ import annotations

import importlib.metadata
import json
import re
import runpy
import signal
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
# a row of the key table: two spaces, the key, then its description (or the description on the next line)
ROW = re.compile(r"^  ([a-z][\w.\-]*)(?: {2,}(\S.*))?$")
FLAG_ROW = re.compile(r"^\s+--[a-z][\w-]* [A-Z_]+|^options:$", re.M)  # argparse's own --help
SUBCOMMANDS = {"kimi-convert": ["to-hf"], "kimi.convert": ["from-hf"]}  # each a command of its own
FEWER_KEYS = {"kimi-wandb-offline": 2, "kimi.wandb_offline": 2, "kimi.eval.build_tasks": 1, "from-hf": 2}


def commands() -> list[tuple[str, str, list[str]]]:
    """(kind, name, arguments before --help): kind "script" (a [project.scripts] name), "module" (python -m)
    or "file" (train.py)."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    modules = sorted({m for p in pages for m in re.findall(r"python -m (kimi(?:\.\w+)+)", p.read_text())})
    found = [("script", s, []) for s in scripts] + [("module", m, []) for m in modules]
    found.append(("file", str(ROOT / "train.py"), []))
    return found + [(k, n, [sub]) for k, n, _ in found for sub in SUBCOMMANDS.get(n, [])]


def run_help(kind: str, name: str, args: list[str], monkeypatch) -> int:
    """The exit code of `name args --help`, run as its wrapper, `python -m` or `python FILE` runs it."""
    monkeypatch.setattr(sys, "argv", [name, *args, "--help"])
    # a command installs its signal handlers first (kimi-train's at-once SIGTERM exit): not for later tests
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if kind == "script":
            assert (BIN / name).is_file(), f"{name} is not installed: pip install -e . --no-deps"
            entry, = importlib.metadata.entry_points(group="console_scripts", name=name)
            result = entry.load()()
        else:
            result = runpy.run_module(name, run_name="__main__") if kind == "module" else \
                runpy.run_path(name, run_name="__main__")
            result = None
    except SystemExit as e:
        result = e.code
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return 0 if result is None else result if isinstance(result, int) else 1  # as sys.exit reads it


def described_keys(text: str) -> list[str]:
    """The keys of the help's table that have a description ("(now 600)" alone is a value, not one)."""
    lines = text.splitlines()
    keys = []
    for i, line in enumerate(lines):
        m = ROW.match(line)
        if not m:
            continue
        after = lines[i + 1] if i + 1 < len(lines) else ""
        text = m.group(2) or (after.strip() if after.startswith(" " * 6) else "")
        if text and not text.startswith("(now"):
            keys.append(m.group(1))
    return keys


def test_described_keys_reads_the_table():
    text = ("usage\n  run             the run directory\n  trust_remote_code\n                  true: run it"
            "\n  trainer.seed                (now 1234)\n  --seeds SEEDS  seeds")
    assert described_keys(text) == ["run", "trust_remote_code"]


@pytest.mark.filterwarnings("ignore:.*found in sys.modules after import:RuntimeWarning")  # runpy, harmless
@pytest.mark.parametrize("kind,name,args", [pytest.param(*c, id=" ".join([Path(c[1]).name, *c[2]]))
                                            for c in commands()])
def test_every_command_answers_help(kind, name, args, capsys, monkeypatch):
    code = run_help(kind, name, args, monkeypatch)
    out = capsys.readouterr().out
    keys = described_keys(out)
    assert code == 0 and "Traceback" not in out, out[-2000:]
    assert len(keys) >= FEWER_KEYS.get(args[-1] if args else name, 3), out[-2000:]
    assert not FLAG_ROW.search(out), f"argparse's --flag listing: {out[-2000:]}"


def test_every_script_and_documented_module_is_listed():
    kinds = [k for k, _, _ in commands()]
    assert kinds.count("script") >= 9 and kinds.count("module") >= 9, commands()


# commands without torch, each in turn in one fresh process (the first one that imports it is named)
FRESH = textwrap.dedent("""
    import contextlib, importlib.metadata, io, json, runpy, sys
    for kind, name, argv in json.loads(sys.argv[1]):
        sys.argv = [name, *argv]
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                if kind == "script":
                    (entry,) = importlib.metadata.entry_points(group="console_scripts", name=name)
                    entry.load()()
                elif kind == "module":
                    runpy.run_module(name, run_name="__main__")
                else:
                    runpy.run_path(name, run_name="__main__")
        except SystemExit:
            pass
        if "torch" in sys.modules:
            print(" ".join([name, *argv]))
            break
""")
# a mistake in each kind of command line: an unknown key, or the planner's step that is not whole rows
MISTAKES = [("file", str(ROOT / "train.py"), ["model.nosuch=1"]),
            *[("module", m, ["nosuch=1"]) for m in ("kimi.generate", "kimi.eval", "kimi.dashboard")],
            ("module", "kimi.convert", ["to-hf", "nosuch=1"]), ("module", "kimi.summary", ["model.nosuch=1"]),
            ("module", "kimi.data.prepare", ["data.nosuch=1"]),
            ("module", "kimi.plan", ["cluster.gpus=8", "trainer.tokens_per_step=1000"])]


def without_torch(commands: list) -> str:
    """The first of `commands` ((kind, name, argv) each) whose run imports torch, or ""."""
    proc = subprocess.run([sys.executable, "-c", FRESH, json.dumps(commands)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip()


def test_help_starts_without_torch():
    assert without_torch([(k, n, [*a, "--help"]) for k, n, a in commands()]) == ""


def test_a_mistake_in_the_command_line_is_reported_without_torch():
    assert without_torch(MISTAKES) == ""
