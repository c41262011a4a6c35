"""bench/peer.py's CPU dry run: the Kimi model, its dense peer and torchtitan's trainer on the dense peer's
shape (installed by make into .venv/titan) trained the same way, one table with their ratios (the GPU run is
make gpu-check's peer step)."""

import json
import math
import subprocess
import sys

import pytest

from helpers import ROOT, TINY_TRAINER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_peer_dry_run_measures_the_three_alike(tmp_path, data):
    out = tmp_path / "peer.json"
    shared = [o for o in TINY_TRAINER if not o.startswith(("trainer.micro_batch_size", "trainer.log_every"))]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "peer.py"), "--kimi", "tiny",
                           "--dense", "tiny", "--dense-set", "model.layer_pattern=A",
                           "model.residual=standard", "model.mha.num_heads=2", "--batch", "2",
                           "--steps", "2", "--titan", "--out", str(out), "--set", *shared, *data],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    kimi, dense = record["kimi"], record["dense"]
    assert record["dense_set"][0] == "model.layer_pattern=A" and record["batch"] == 2
    titan = record["titan"]
    for r in (kimi, dense, titan):
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and r["peak_mem_bytes"] > 0
    assert len(kimi["losses"]) == len(dense["losses"]) == len(titan["losses"]) == 4
    # torchtitan trained the dense peer's shape on its own trainer: the same width, depth and vocabulary
    shape = titan["shape"]
    assert (shape["layers"], shape["heads"], shape["seq_len"]) == (2, 2, 32) and shape["dim"] == 32
    assert shape["vocab"] == 384 and all(map(math.isfinite, titan["losses"]))  # data.tokenizer.vocab_size
    # its MFU on our FLOP count: the dense peer's FLOPs per token at torchtitan's speed
    assert titan["mfu"] / titan["tokens_per_s"] == pytest.approx(dense["mfu"] / dense["tokens_per_s"])
    for a, b in (("kimi", "dense"), ("dense", "titan")):
        ratio = record[a]["tokens_per_s"] / record[b]["tokens_per_s"]
        assert f"| {a} / {b} | {ratio:.2f}x |" in proc.stdout
