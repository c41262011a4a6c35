"""The package as a user installs it: a wheel built from the repository (`pip install .`, not editable) in a
fresh virtual environment, then `kimi-train model=tiny trainer.max_steps=2` from a directory outside the
checkout, which must find the configs the wheel carries (kimi.conf, read through Hydra's pkg://).

The fresh environment gets only the kimi wheel; its dependencies (torch, hydra, ...) are this interpreter's,
reached through a .pth file, so the test needs no network and takes seconds instead of minutes. A .pth file
puts a directory on sys.path after the environment's own site-packages without running that directory's own
.pth files: the editable install of this checkout (its import hook) stays out, and the kimi that runs is the
wheel's."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers import make_corpus

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
# what `pip install .` reads: the build configuration and what it packages
SOURCES = ("pyproject.toml", "setup.py", "README.md", "kimi", "conf")
CACHES = ("__pycache__", "*.egg-info")
COMMANDS = ("kimi-train", "kimi-generate", "kimi-convert", "kimi-summary", "kimi-prepare", "kimi-eval")


def _run(cmd, cwd: Path, env=None) -> str:
    cmd = [str(c) for c in cmd]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A fresh virtual environment holding the kimi wheel built from a copy of the repository's sources (an
    in-place build would leave build/ in the checkout)."""
    tmp = tmp_path_factory.mktemp("install")
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns(*CACHES))
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    _run([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", tmp / "dist", src], cwd=tmp)
    wheel = next((tmp / "dist").glob("kimi-*.whl"))
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    python = venv / "bin" / "python"
    purelib = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    site = Path(_run([python, "-c", purelib], cwd=tmp).strip())
    (site / "kimi_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([python, "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel], cwd=tmp)
    return venv


@pytest.fixture
def outside(tmp_path) -> dict:
    """An environment for commands run outside the checkout: no PYTHONPATH, offline, caches of its own."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"),
               KIMI_CACHE_DIR=str(tmp_path / "kimi_cache"), OMP_NUM_THREADS="1")
    return env


def test_the_wheel_trains_from_any_directory(venv, outside, tmp_path):
    work = tmp_path / "elsewhere"
    work.mkdir()
    python = venv / "bin" / "python"
    found = "import kimi, kimi.cli.conf_dir as c; print(kimi.__file__); print(c.search_path())"
    where = _run([python, "-c", found], cwd=work, env=outside).split()
    assert Path(where[0]).is_relative_to(venv) and where[1] == "pkg://kimi.conf", where
    for command in COMMANDS:
        assert (venv / "bin" / command).is_file(), f"the wheel installs no {command} console script"

    files = ",".join(str(p) for p in sorted(make_corpus(tmp_path / "corpus").glob("*.txt")))
    # the default job's data (Shakespeare) is downloaded: a generated corpus instead, batches it can fill
    data = ["data=files", f"data.data_files=[{files}]", "data.tokenizer.vocab_size=384",
            f"data.cache_dir={tmp_path / 'cache'}", "trainer.micro_batch_size=4", "trainer.seq_len=64",
            "trainer.eval_batches=1"]
    quick = ["trainer.eval_every=0", "trainer.sample_tokens=0", "logging.wandb.mode=disabled",
             "logging.plot=false", "trainer.peak_flops=1e11", "trainer.threads=1", "hydra.run.dir=run"]
    out = _run([venv / "bin" / "kimi-train", "model=tiny", "trainer.max_steps=2", *data, *quick], cwd=work,
               env=outside)
    assert "[kimi] model tiny:" in out and "step 2/2" in out, out
    run = work / "run"
    assert (run / "checkpoints" / "step_00000002").is_dir() and (run / "train.log").is_file()
    assert "name: tiny" in (run / "config.yaml").read_text()

    summary = _run([venv / "bin" / "kimi-summary", "model=small"], cwd=work, env=outside)
    assert summary.startswith("model small:"), summary
    sample = _run([venv / "bin" / "kimi-generate", "run=run", "prompt=The king", "max_new_tokens=4"],
                  cwd=work, env=outside)
    assert "[kimi] step 2 checkpoint, 4 tokens:\nThe king" in sample, sample
