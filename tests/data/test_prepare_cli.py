"""`python -m kimi.data.prepare` end to end (the command writes what the trainer's own prepare then reuses,
without importing torch: a worker of a preparation across machines skips its seconds of start-up), and the
trainer on a blend: per-source validation losses, exact resume."""

import json
import os
import subprocess
import sys

import pytest

from helpers import IMPORT_TIMES, ROOT, imported, make_corpus

pytestmark = pytest.mark.e2e


def _run(*args, env):
    return subprocess.run([sys.executable, "-m", "kimi.data.prepare", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_prepare_command_writes_shards_the_trainer_reuses(tmp_path, offline):
    from kimi.data import prepare
    from kimi.summary import compose_config

    corpus = make_corpus(tmp_path / "corpus", docs=12, sentences=30)
    overrides = ["data=files", f"data.data_files=[{corpus}/*.txt]", f"data.cache_dir={tmp_path / 'cache'}",
                 "data.shard_mb=0.002", "data.num_proc=2", "data.tokenizer.vocab_size=300",
                 "data.val_fraction=0.2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **IMPORT_TIMES}
    done = _run(*overrides, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[data] ready:" in done.stdout and "tokens/s" in done.stdout
    assert imported(done.stderr, "kimi.data.pack") and not imported(done.stderr, "torch")
    data = prepare(compose_config(overrides).data)  # finds the command's output: nothing tokenised again
    manifest = json.loads((data.data_dir / "manifest.json").read_text())
    assert len(manifest["splits"]["train"]["shards"]) == len(data.shards["train"]) > 1
    assert manifest["splits"]["train"]["num_documents"] + manifest["splits"]["val"]["num_documents"] == 12


def test_trainer_trains_on_a_blend_logs_each_source_and_resumes_exactly(tmp_path, offline):
    """Two sources of different text, weights 3:1, a tokenizer.json: per-source validation losses beside the
    blended one in metrics.jsonl, and a run stopped at step 2 and resumed ends as the uninterrupted one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from helpers import train_run
    from kimi.run.metrics import read_metrics

    books = make_corpus(tmp_path / "books", docs=12, sentences=40)
    web = tmp_path / "web"
    web.mkdir()
    for i in range(12):
        (web / f"page{i}.txt").write_text("\n".join(f"item {i}-{k}: price {k * 7 % 100} in stock"
                                                   for k in range(80)))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [p.read_text() for d in (books, web) for p in sorted(d.iterdir())]
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp_path / "tokenizer.json"))
    data = [f"data.cache_dir={tmp_path / 'cache'}",
            f"data.tokenizer.model_path={tmp_path / 'tokenizer.json'}", "model.vocab_size=320",
            f"data.sources=[{{name:books,weight:3,data_files:[{books}/*.txt],val_fraction:0.2}},"
            f"{{name:web,weight:1,data_files:[{web}/*.txt],val_fraction:0.2}}]"]
    whole = train_run(tmp_path / "whole", data, "trainer.max_steps=4", "trainer.eval_every=2")
    rows = [r for r in read_metrics(tmp_path / "whole" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in rows] == [0, 2, 4]
    for r in rows:
        assert r["val_loss"] == pytest.approx((3 * r["val_loss/books"] + r["val_loss/web"]) / 4)
        assert r["val_loss/books"] != r["val_loss/web"]
    train_run(tmp_path / "parts", data, "trainer.max_steps=4", "trainer.eval_every=2",
              "trainer.stop_at_step=2")
    resumed = train_run(tmp_path / "parts", data, "trainer.max_steps=4", "trainer.eval_every=2")
    assert resumed.loader.state_dict() == whole.loader.state_dict()
    losses = [[(r["step"], r.get("loss"), r["val_loss"]) for r in read_metrics(run / "metrics.jsonl")
               if "val_loss" in r and r["step"] == 4] for run in (tmp_path / "whole", tmp_path / "parts")]
    assert losses[0] == losses[1]


def test_a_checkpoint_from_before_global_positions_resumes(tmp_path, data, monkeypatch):
    """A checkpoint whose loader state has the older keys (micro-batches served, no global position) resumes
    where the uninterrupted run goes; a blend's checkpoint resumed on one source is one line."""
    from helpers import train_run
    from kimi.data import DataError, loader
    from kimi.run.metrics import read_metrics

    whole = train_run(tmp_path / "whole", data, "trainer.max_steps=3")
    new = loader.TokenLoader.state_dict

    def old_keys(self):
        sd = new(self)
        return {k: sd[k] for k in ("epoch", "position", "seed", "dp_world", "num_windows", "seq_len",
                                   "batch_size")}

    monkeypatch.setattr(loader.TokenLoader, "state_dict", old_keys)
    train_run(tmp_path / "parts", data, "trainer.max_steps=3", "trainer.stop_at_step=1")
    monkeypatch.setattr(loader.TokenLoader, "state_dict", new)
    resumed = train_run(tmp_path / "parts", data, "trainer.max_steps=3")
    assert resumed.loader.state_dict() == whole.loader.state_dict()
    losses = [[r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
              for run in (tmp_path / "whole", tmp_path / "parts")]
    assert losses[0] == losses[1] and len(losses[0]) == 3
    with pytest.raises(DataError, match="read a blend"):
        whole.loader.load_state_dict({"samples": 0, "seed": 1, "global_batch": 4, "seq_len": 32,
                                      "batch_size": 4, "dp_world": 1, "blend": "{}"})
