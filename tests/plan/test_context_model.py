"""bench/context.py's memory model, reread from the committed measurements (bench/results/context.json): it
still fits them, and it still says what issue 32 set out to reach, 1M-token sequences of `1b` on at most 8
GPUs of 141 GB. A change to the model's code or to the presets that breaks either shows here."""

import json
import sys

import pytest

from helpers import ROOT

sys.path.append(str(ROOT / "bench"))  # appended: a bench script must not shadow an installed package
import context  # noqa: E402

pytestmark = pytest.mark.unit


def test_the_memory_model_fits_the_measurements_and_reaches_1m_tokens():
    out = json.loads((ROOT / "bench" / "results" / "context.json").read_text())
    text = context.report(out, reserve=0.1)
    for name, T, cp, measured, model, ratio in out["model_check"]:
        if name == "tiny":  # where the blocks set the peak at every length (docs/parallelism.md)
            assert 0.97 <= float(ratio) <= 1.05, (name, T, cp)
    first_cp = {line.split("`")[1] + " " + line.split(" on ")[1].split(" GPUs")[0]:
                int(line.rsplit("= ", 1)[1])
                for line in text.splitlines() if line.startswith("- `")}
    assert first_cp["1b 141 GB"] <= 8 and first_cp["1b 80 GB"] <= 8


def test_the_blockwise_prefix_keeps_only_the_latent():
    from kimi.summary import compose_config

    m = compose_config(["model=1b", "model.vocab_size=32768"]).model
    latent = m.mla.kv_lora_rank + m.mla.qk_rope_head_dim
    # bf16, three copies of the gathered latent
    assert context.prefix_bytes(m, blockwise=True) == 2 * 3 * latent
    # the whole prefix adds its keys and values and their gradients
    assert context.prefix_bytes(m) - context.prefix_bytes(m, blockwise=True) == context.block_bytes(m)


def test_fp32_matmuls_leave_the_measured_peak_as_it_is():
    """bench/context.py runs its bf16 matmuls in fp32 (a CPU without bf16 instructions runs them 10-300x
    slower): the peak MemTracker measures is the one of the real bf16 run, byte for byte, at cp 1, and the
    stand-in did run."""
    job = {"overrides": [*context.MEASURED["tiny"], "model.num_layers=4", "model.mla_layers=[1,3]"], "T": 128,
           "what": "memory"}
    plain = context.measure(job)
    stand_in = context.Fp32Matmuls()
    with stand_in:
        fast = context.measure(job)
    assert fast == plain and plain["bytes"] > 0 and stand_in.count > 0
