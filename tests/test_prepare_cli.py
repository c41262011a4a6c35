"""`python -m kimi.data.prepare` end to end: the command writes what the trainer's own prepare then reuses, and
a bad override is one line with exit code 2."""

import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT, make_corpus

pytestmark = pytest.mark.e2e


def _run(*args, env):
    return subprocess.run([sys.executable, "-m", "kimi.data.prepare", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_prepare_command_writes_shards_the_trainer_reuses(tmp_path, offline):
    from kimi.data import prepare
    from kimi.summary import compose_config

    corpus = make_corpus(tmp_path / "corpus", docs=12, sentences=30)
    overrides = ["data=files", f"data.data_files=[{corpus}/*.txt]", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.shard_mb=0.002", "data.num_proc=2", "data.tokenizer.vocab_size=300", "data.val_fraction=0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = _run(*overrides, env=env)
    assert done.returncode == 0, done.stderr
    assert "[data] ready:" in done.stdout and "tokens/s" in done.stdout
    data = prepare(compose_config(overrides).data)  # finds the command's output: nothing tokenised again
    manifest = json.loads((data.data_dir / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) == len(data.shards["train"]) > 1
    assert manifest["splits"]["train"]["num_documents"] + manifest["splits"]["val"]["num_documents"] == 12
    bad = _run("data.num_proc=0", env=env)
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "data.num_proc" in bad.stderr
