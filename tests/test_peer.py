"""bench/peer.py's CPU dry run: the Kimi model and its dense peer trained the same way, one table with their
ratios (the GPU run is make gpu-check's peer step)."""

import json
import subprocess
import sys

import pytest

from helpers import ROOT, TINY_TRAINER

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_peer_dry_run_measures_both_models_alike(tmp_path, data):
    out = tmp_path / "peer.json"
    shared = [o for o in TINY_TRAINER if not o.startswith(("trainer.micro_batch_size", "trainer.log_every"))]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "peer.py"), "--kimi", "tiny", "--dense", "tiny",
                           "--dense-set", "model.layer_pattern=A", "model.residual=standard",
                           "model.attn_num_heads=2", "--batch", "2", "--steps", "1", "--out", str(out),
                           "--set", *shared, *data], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(out.read_text())
    kimi, dense = record["kimi"], record["dense"]
    assert record["dense_set"][0] == "model.layer_pattern=A" and record["batch"] == 2
    for r in (kimi, dense):
        assert r["tokens_per_s"] > 0 and 0 < r["mfu"] < 1 and len(r["losses"]) == 3
    ratio = kimi["tokens_per_s"] / dense["tokens_per_s"]
    assert f"| kimi / dense | {ratio:.2f}x |" in proc.stdout
