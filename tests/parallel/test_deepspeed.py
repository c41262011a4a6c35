"""parallel.engine=deepspeed (DeepSpeed's ZeRO 1-3 on its CPU accelerator, gloo) equals one process of the
torch engine.

Two ranks with micro-batch 2 see what one process sees with micro-batch 4, so losses and final weights
must match the single-process run (to float summation order) under every ZeRO stage, with AdamW and with
MuonClip (orthogonalising each matrix once across DeepSpeed's flat partitions: kimi/parallel/zero_client.py),
with gradient accumulation, with QK-Clip firing on the fp32 masters, and with a mixture of experts under
ZeRO-3. The cases run in one torchrun launch (tests/dist_train.py). Checkpoints hold whole tensors under their
names, as the torch engine's: a DeepSpeed run resumes exactly, and moves to the torch engine and back (each
start of those runs a run of its own in the same launch, resuming from the checkpoint the one before wrote).
"""

from __future__ import annotations

import json

import pytest
from layout_runs import ROOT, assert_same_run, dist_train, metrics, overrides, resumed_at

from kimi import checkpoint
from kimi.run.metrics import read_metrics

pytestmark = pytest.mark.dist

pytest.importorskip("deepspeed", reason="deepspeed (dev extra) not installed")

MOE = ["model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.hidden=16", "model.moe.groups=2",
       "model.moe.topk_groups=1", "model.moe.bias_rate=0.01"]
TAU = ["optim.qk_clip_tau=0.02"]  # the tiny model's max logits are ~0.03: heads clip every step
ACCUM = ["trainer.grad_accum_steps=2"]


def zero(stage: int, *extra: str) -> list[str]:
    return ["parallel.engine=deepspeed", "parallel.dp_shard=2", "trainer.micro_batch_size=2",
            f"parallel.deepspeed.zero_stage={stage}", *extra]


CASES = {  # name: (optim, overrides)
    **{f"zero{s}_{o}": (o, zero(s)) for s in (1, 2, 3) for o in ("adamw", "muonclip")},
    # the end-of-run sample too: every rank decodes, ZeRO-3 gathering each layer's weights as it runs
    "zero3_sample_muonclip": ("muonclip", zero(3, "trainer.sample_tokens=24")),
    **{f"zero{s}_accum2_muonclip": ("muonclip", zero(s, *ACCUM)) for s in (1, 2, 3)},
    "zero2_accum2_adamw": ("adamw", zero(2, *ACCUM)),
    "zero2_qkclip_muonclip": ("muonclip", zero(2, *TAU)),
    "zero3_qkclip_adamw": ("adamw", zero(3, *TAU)),
    "zero3_moe_muonclip": ("muonclip", zero(3, *MOE)),
    # per-head Muon (Kimi K3): each head's block of q/k/v orthogonalised once, on the rank owning it
    **{f"zero{s}_per_head_muonclip": ("muonclip", zero(s, "optim.muon_per_head=true")) for s in (2, 3)},
    # ZeRO-Offload: optimizer state and fp32 masters in CPU memory, stepped by DeepSpeed's offload path
    "zero2_offload_muonclip": ("muonclip", zero(2, "parallel.deepspeed.offload_optimizer=true")),
    "zero3_offload_adamw": ("adamw", zero(3, "parallel.deepspeed.offload_optimizer=true")),
}
BF16 = {"zero2_bf16_muonclip": ("muonclip", zero(2, "trainer.precision=bf16"))}  # bf16 weights, fp32 masters
INIT = {"zero2_init_adamw": ("adamw", 2), "zero3_init_muonclip": ("muonclip", 3)}  # with trainer.init_from


@pytest.fixture(scope="module")
def init_from(references):
    """trainer.init_from= the weights of a finished one-process run: a new run, fresh optimizer state."""
    return f"trainer.init_from={references('adamw')}"


FSDP = ["parallel.dp_shard=2", "trainer.micro_batch_size=2"]
# name: the layout of each start and the step it stops at, one run dir: it resumes where the start before
# stopped (ZeRO-2 stopped and restarted; ZeRO-2, then the torch engine's FSDP, then ZeRO-3)
SEQUENCES = {"resumed": [(zero(2), 1), (zero(2), 3)], "moved": [(zero(2), 1), (FSDP, 2), (zero(3), 3)]}


@pytest.fixture(scope="module")
def launch(tmp_path_factory, data, init_from):
    """Every case and every start of SEQUENCES trained by one 2-rank launch of tests/dist_train.py: (run dirs
    by name, the result)."""
    out = tmp_path_factory.mktemp("deepspeed")
    cases = {**CASES, **BF16,
             **{name: (optim, zero(stage, init_from)) for name, (optim, stage) in INIT.items()}}
    runs = {name: out / name for name in [*cases, *SEQUENCES]}
    spec = [(runs[name], overrides(data, optim, *extra)) for name, (optim, extra) in cases.items()]
    spec += [(runs[name], overrides(data, "muonclip", *layout, f"trainer.stop_at_step={stop}"))
             for name, starts in SEQUENCES.items() for layout, stop in starts]
    return runs, dist_train(2, spec, out / "runs.pkl", check=False)


def finished(launch, case: str):
    runs, proc = launch
    if checkpoint.latest_complete(runs[case] / "checkpoints") is None:
        pytest.fail(f"the launch exited {proc.returncode} before {case} finished:\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-5000:]}")
    return runs[case]


@pytest.mark.parametrize("case", list(CASES))
def test_zero_equals_one_process(tmp_path, launch, references, case):
    run = finished(launch, case)
    optim, extra = CASES[case]
    same = [o for o in extra if o.startswith(("model.", "optim.", "trainer.grad_accum", "trainer.sample"))]
    ref = references(optim, *same)
    assert_same_run(run, ref, tmp_path)
    if (ref / "sample.txt").exists():
        assert (run / "sample.txt").read_text() == (ref / "sample.txt").read_text()
    config = json.loads((run / "deepspeed.json").read_text())  # what DeepSpeed was given, for the user
    assert config["zero_optimization"]["stage"] == int(case[4])
    if "qkclip" in case:  # the clip fired, on the masters DeepSpeed then copied into the model
        clipped = [r["qk_clipped_frac"] for r in read_metrics(run / "metrics.jsonl")
                   if "qk_clipped_frac" in r]
        assert len(clipped) == 3 and min(clipped) > 0


@pytest.mark.parametrize("case", list(INIT))
def test_init_from_equals_the_torch_engine(tmp_path, launch, references, init_from, case):
    """Started from trainer.init_from, DeepSpeed's first updates are the torch engine's: creating the
    optimizer state to load into (ZeroClient._init_state) counts no step (Adam's bias corrections would
    make the first update sqrt(1 + b2) / (1 + b1) = 0.73 of the torch engine's)."""
    optim = INIT[case][0]
    ref = references(optim, init_from)
    assert metrics(ref) != metrics(references(optim))  # the run did start from the given weights
    assert_same_run(finished(launch, case), ref, tmp_path)


def test_bf16_trains_like_fp32(launch):
    """DeepSpeed's bf16: bf16 weights and activations, fp32 master weights and optimizer state. Its losses
    stay within bf16's rounding of the fp32 run's."""
    (loss, val), (ref_loss, ref_val) = (metrics(launch[0]["zero2_bf16_muonclip"]),
                                        metrics(launch[0]["zero2_muonclip"]))
    assert len(loss) == 3 and loss != ref_loss
    for a, b in zip(loss + val, ref_loss + ref_val):
        assert abs(a - b) < 1e-2 * b, (loss + val, ref_loss + ref_val)


def test_resume_continues_exactly(tmp_path, launch):
    """Stopped after step 1 and restarted: the same losses and weights as the uninterrupted ZeRO-2 run."""
    run = finished(launch, "resumed")
    assert checkpoint.latest_complete(run / "checkpoints").step == 3 and resumed_at(run) == [1]
    assert metrics(run) == metrics(launch[0]["zero2_muonclip"])
    assert_same_run(run, launch[0]["zero2_muonclip"], tmp_path, atol=0.0)


def test_one_process_without_a_launcher(tmp_path, data, references):
    """`python train.py parallel.engine=deepspeed`: DeepSpeed gets a one-rank process group of its own."""
    import subprocess
    import sys

    run = tmp_path / "alone"
    proc = subprocess.run([sys.executable, str(ROOT / "train.py"), f"hydra.run.dir={run}",
                           *overrides(data, "muonclip", "parallel.engine=deepspeed",
                                      "parallel.deepspeed.zero_stage=3")],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert_same_run(run, references("muonclip"), tmp_path)


def test_deepspeeds_launcher_runs_train_py(tmp_path, data, launch):
    """The README's `deepspeed --no_local_rank` launch (on CPU, --num_gpus is the number of processes)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    run = tmp_path / "launched"
    launcher = Path(sys.executable).parent / "deepspeed"
    cmd = [str(launcher), "--no_local_rank", "--num_gpus", "2", str(ROOT / "train.py"),
           f"hydra.run.dir={run}", *overrides(data, "muonclip", *zero(2))]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert metrics(run) == metrics(launch[0]["zero2_muonclip"])


def test_a_run_changes_engine_and_back(tmp_path, launch, references):
    """Step 1 under DeepSpeed ZeRO-2, step 2 under the torch engine's FSDP, step 3 under ZeRO-3 (2 ranks
    each): the single-process run."""
    run = finished(launch, "moved")
    assert checkpoint.latest_complete(run / "checkpoints").step == 3 and resumed_at(run) == [1, 2]
    assert_same_run(run, references("muonclip"), tmp_path)


@pytest.mark.parametrize("override,message", [
    ("parallel.tp=2", "parallel.engine=deepspeed runs ZeRO over data parallelism only "
                      "(parallel.dp_shard ranks), without parallel.tp=2"),
    ("parallel.deepspeed.zero_stage=4", "parallel.deepspeed.zero_stage=4 is invalid: choose 1, 2 or 3"),
])
def test_what_deepspeed_does_not_take_is_refused_in_one_line(override, message):
    """Each rank validates its config before it joins the process group (the Trainer's first step, tests/
    config/test_validation.py), so under torchrun every rank ends with this line instead of hanging, as a
    misfit layout's launch does in tests/parallel/test_parallel.py."""
    from kimi.config import ConfigError
    from kimi.run.validation import validate
    from kimi.summary import compose_config

    with pytest.raises(ConfigError) as err:
        validate(compose_config(["parallel.engine=deepspeed", override]), world=2)
    assert message in str(err.value) and "\n" not in str(err.value)
