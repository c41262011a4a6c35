"""Distributed MuonClip (kimi/optim/owners.py) under torchrun with gloo on CPU, against one process.

The same weights, gradients and per-rank QK-Clip logits (tests/muonclip_problem.py) laid out as plain
replicas, FSDP Shard(0) over 2 and 4 ranks (uneven and empty blocks), TP Shard(0)/Shard(1) with replicated
norms, dp2 x tp2 (FSDP's _StridedShard over TP columns, TP rows under FSDP, HSDP-like replicas) and expert
parallelism (experts split over ep, FSDP-sharded over the other dp ranks) and DeepSpeed's ZeRO partitions
(flat fragments: an equal share of all weights concatenated, cut mid-row, or of each weight): after
3 steps every layout equals single-process MuonClip. Per step each logical matrix is orthogonalised exactly
once over all ranks, the collectives do not grow with the number of matrices, no rank duplicates optimizer
state, and a checkpoint written at dp=2 continues exactly at 4 ranks and in one process. On the same layouts
the trainer's global-norm clip over ranks returns the whole gradients' norm and scales every block alike.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from muonclip_problem import (LOGICAL_MATRICES, SHAPES, gradients, initial_weights, make_optimizer,
                              max_logits, reference)
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

TESTS = Path(__file__).parents[1]
LAUNCHES = {2: ["replicated", "fsdp", "tp", "fsdp_more", "fsdp_save", "zero12", "zero12_more"],
            4: ["fsdp4", "dp2tp2", "ep2fsdp2", "fsdp4_load", "zero3"]}
WORLD = {case: n for n, cases in LAUNCHES.items() for case in cases}


def torchrun(nproc: int, out: Path, cases: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(TESTS / "dist_muonclip.py"), str(out), *cases]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"torchrun {nproc} ranks {cases} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-6000:]}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("muonclip_dist")
    for nproc, cases in LAUNCHES.items():  # 2 ranks first: the 4-rank launch loads its checkpoint
        torchrun(nproc, out, cases)
    return out


def result(runs: Path, case: str) -> dict:
    return torch.load(runs / f"{case}.pt", weights_only=False)


def assert_weights_close(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=0, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.unit
def test_the_problem_depends_on_every_ranks_logits():
    """Otherwise the layout tests could not see a missing max-reduce over ranks."""
    one, two, four = reference(3, 1), reference(3, 2), reference(3, 4)
    for a, b in ((one, two), (two, four)):
        assert not torch.allclose(a["wq"], b["wq"]) and not torch.allclose(a["wkv"], b["wkv"])
    assert not torch.allclose(initial_weights()["tall"], one["tall"])


@pytest.mark.dist
@pytest.mark.parametrize("case",
                         ["replicated", "fsdp", "tp", "fsdp4", "dp2tp2", "ep2fsdp2", "zero12", "zero3"])
def test_layout_equals_one_process(runs, case):
    assert_weights_close(result(runs, case)["weights"], reference(3, WORLD[case]))


@pytest.mark.dist
@pytest.mark.parametrize("case", sorted(WORLD))
def test_each_matrix_is_orthogonalised_once_per_step(runs, case):
    ranks = result(runs, case)["stats"]
    expected = LOGICAL_MATRICES + (5 if case.endswith("_more") else 0)
    for step in range(len(ranks[0]["steps"])):
        per_rank = [r["steps"][step]["ns_matrices"] for r in ranks]
        assert sum(per_rank) == expected, per_rank
        assert max(per_rank) < expected  # shared out, not all on one rank


@pytest.mark.dist
@pytest.mark.parametrize("case", ["replicated", "fsdp", "tp", "fsdp4", "dp2tp2", "ep2fsdp2"])
def test_the_gradient_clip_over_ranks_is_the_whole_gradients(runs, case):
    """kimi.parallel.tensor_parallel.clip_grad_norm_ on this layout's blocks, clipping to half the norm: the
    norm of the whole gradients (fp64 from the full tensors) and every gradient halved."""
    clips = result(runs, case)["clips"]
    assert len(clips) == 3
    for step, clip in enumerate(clips):
        full = gradients(step)
        want = torch.sqrt(sum(g.double().square().sum() for g in full.values())).item()
        assert clip["norm"] == pytest.approx(want, rel=1e-6)
        assert clip["grads"].keys() == full.keys()
        for n, g in full.items():
            torch.testing.assert_close(clip["grads"][n], g * (want / 2) / (clip["norm"] + 1e-6),
                                       rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step}, {n}: {m}")


@pytest.mark.dist
@pytest.mark.parametrize("layout", ["fsdp", "zero12"])
def test_collectives_do_not_grow_with_the_number_of_matrices(runs, layout):
    few, many = (result(runs, c)["stats"] for c in (layout, f"{layout}_more"))
    count = {r["steps"][s]["collectives"] for stats in (few, many) for r in stats for s in range(3)}
    # gradient blocks to owners, updates back, one max-reduce of the QK-Clip logits
    assert count == {3}


@pytest.mark.dist
@pytest.mark.parametrize("case", ["replicated", "fsdp4", "dp2tp2", "ep2fsdp2", "zero12", "zero3"])
def test_no_rank_duplicates_optimizer_state(runs, case):
    adamw = {"embed", "norm", "bias"}
    sizes = [torch.Size(s).numel() * (2 if n in adamw else 1) for n, s in SHAPES.items()]
    per_rank = [r["state_numel"] for r in result(runs, case)["stats"]]
    # all of it, once; each rank about 1/world of it, give or take one tensor's (owners hold whole matrices)
    assert sum(per_rank) == sum(sizes) and max(per_rank) <= sum(sizes) / len(per_rank) + max(sizes), per_rank


@pytest.mark.dist
def test_checkpoint_from_two_ranks_continues_on_four_and_on_one(runs):
    uninterrupted = result(runs, "fsdp_save")["weights"]
    assert_weights_close(result(runs, "fsdp4_load")["weights"], uninterrupted)

    model = torch.nn.Module()
    for n, w in initial_weights().items():
        model.register_parameter(n, torch.nn.Parameter(w))
    current = {}
    opt = make_optimizer(list(model.named_parameters()), lambda i: current.get(i))
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(runs / "ckpt"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    for n, g in gradients(2).items():
        getattr(model, n).grad = g
    current.update({i: torch.maximum(max_logits(2, 0)[i], max_logits(2, 1)[i]) for i in range(2)})
    opt.step()
    assert_weights_close({n: p.detach() for n, p in model.named_parameters()}, uninterrupted)
