"""`python -m kimi.plan`: the layouts it prints are ones the project's rules accept (their overrides compose
and validate), what the rules reject is named and never printed, the ranking follows the time model, and
the time model's formulas give the numbers worked out by hand here."""

from __future__ import annotations

import json
import math
import sys
import types
from dataclasses import dataclass

import pytest

from kimi.errors import ConfigError
from kimi.plan import cli, timing
from kimi.plan.cluster import GIB, Cluster, split_args
from kimi.plan.layout import Layout, Shape
from kimi.plan.model_facts import ModelFacts
from kimi.plan.search import Search, group_span, validate_layout
from kimi.summary import compose_config, vocab_note

pytestmark = pytest.mark.unit

COMMAND_48B = ["model=kimi_linear_48b_a3b", "cluster.gpus=64", "cluster.gpu=h200", "trainer.seq_len=4096",
               "trainer.tokens_per_step=4194304"]
SMALL = ["model=small", "trainer.seq_len=1024"]


@dataclass(frozen=True)
class FakeCollective:  # kimi.plan.comm.Collective's fields
    kind: str
    dim: str
    calls: int
    bytes: int


def fake_memory(cfg):
    """Bytes by part: fp32 weights, gradients and two moments sharded over everything but dp_replicate, and
    activations by rows per forward and checkpointing mode."""
    p, t, m = cfg.parallel, cfg.trainer, cfg.model
    shard = p.tp * p.pp * p.dp_shard * p.cp
    w = 4 * 400_000_000 // shard
    rows = t.micro_batch_size // (p.pp_microbatches if p.pp > 1 else 1)
    per_token = {"none": 30, "selective": 10, "full": 2}[p.activation_checkpointing]
    per_token *= m.d_model * m.num_layers
    parts = {"weights": w, "gradients": w, "optimizer": 2 * w, "fsdp_gathered": 0, "comm_buffers": 0,
             "activations": per_token * rows * t.seq_len // (p.tp * p.pp * p.cp)}
    return parts


def fake_comm(cfg):
    """A gather and a reduction over the FSDP ranks, a tensor-parallel all_reduce per forward."""
    p, t = cfg.parallel, cfg.trainer
    out = []
    if p.dp_shard * p.cp > 1:
        out += [FakeCollective("all_gather", "dp_shard", 24, 2 * 400_000_000 // p.tp),  # the gathered units
                FakeCollective("reduce_scatter", "dp_shard", 12,
                               4 * 400_000_000 // (p.dp_shard * p.cp * p.tp))]
    if p.tp > 1:
        out.append(FakeCollective("all_reduce", "tp", 48, 2 * t.micro_batch_size * t.grad_accum_steps
                                  * t.seq_len * cfg.model.d_model * 8))
    return out


@pytest.fixture(scope="module")
def small():
    cfg = compose_config(SMALL)
    vocab_note(cfg)
    return cfg, ModelFacts.of(cfg)


def h200(gpus: int, **kw) -> Cluster:
    keys = [f"cluster.{k}={v}" for k, v in kw.items()]
    return split_args([f"cluster.gpus={gpus}", "cluster.gpu=h200", *keys]).cluster


def search(small, gpus: int, tokens: int, **kw) -> Search:
    cfg, facts = small
    return Search(cfg, h200(gpus, **kw), tokens, facts, fake_memory, fake_comm, validate_layout)


# ---- the formulas ----------------------------------------------------------------------------------------
def test_ring_factors_against_hand_computed_times():
    bw = 100e9  # 100 GB/s
    assert timing.collective_seconds("all_reduce", 1e9, 8, bw) == pytest.approx(0.0175)  # 2 x 7/8 x 10 ms
    # the bytes are the first tensor argument's: FSDP's all_gather counts the gathered 4 GB (each of 4 ranks
    # receives 3 GB), its reduce_scatter the 1 GB shard of 4 GB (each sends 3 GB); tp's functional
    # collectives count their input, the 1 GB shard gathered and the 4 GB reduced
    assert timing.collective_seconds("all_gather", 4e9, 4, bw, "dp_shard") == pytest.approx(0.030)
    assert timing.collective_seconds("reduce_scatter", 1e9, 4, bw, "dp_shard") == pytest.approx(0.030)
    assert timing.collective_seconds("all_gather", 1e9, 4, bw, "tp") == pytest.approx(0.030)
    assert timing.collective_seconds("reduce_scatter", 4e9, 4, bw, "tp") == pytest.approx(0.030)
    assert timing.collective_seconds("all_to_all", 1e9, 8, bw) == pytest.approx(0.00875)
    assert timing.collective_seconds("send", 1e9, 2, bw) == pytest.approx(0.010)
    assert timing.collective_seconds("all_reduce", 1e9, 1, bw) == 0.0  # a group of one sends nothing


def test_bubble_and_owner_balance_against_hand_computed_numbers():
    assert timing.bubble_fraction(4, 8, 1, "1f1b") == pytest.approx(3 / 8)
    assert timing.bubble_fraction(4, 8, 2, "interleaved_1f1b") == pytest.approx(3 / 16)
    assert timing.bubble_fraction(4, 8, 2, "1f1b") == pytest.approx(3 / 8)  # one stage per rank
    assert timing.bubble_fraction(1, 8, 1, "1f1b") == 0.0
    # largest first to the least loaded: 5 -> a, 4 -> b, 3 -> b (7), 3 -> a (8), 3 -> b (10)
    assert timing.busiest_owner([3, 5, 3, 4, 3], 2) == 10
    assert timing.busiest_owner([3, 5], 4) == 5


def test_mesh_groups_and_links():
    p = types.SimpleNamespace(tp=4, cp=1, ep=2, dp_shard=4, dp_replicate=2, pp=2)
    cluster = h200(64)
    assert group_span("tp", p) == (4, 4) and cluster.link(4)[0] == "NVLink"
    assert group_span("ep", p) == (2, 8) and cluster.link(8)[0] == "NVLink"
    assert group_span("dp_shard", p) == (4, 16) and cluster.link(16)[0] == "inter-node"
    assert group_span("dp_replicate", p) == (2, 32)
    assert group_span("pp", p) == (2, 64)


def test_ceilings_are_the_committed_compiled_roofline():
    from pathlib import Path

    audit = json.loads((Path(__file__).resolve().parents[2] / "bench/results/step_audit.json").read_text())
    gpus = audit["families"]["1b"]["compiled"]["gpus"]
    for kind in ("h100", "h200"):
        assert timing.MFU_CEILING[kind] == pytest.approx(gpus[kind.upper()]["mfu_ceiling"], abs=1e-4)
        assert timing.MFU_CEILING_UNFUSED[kind] == pytest.approx(gpus[kind.upper()]["mfu_ceiling_unfused"],
                                                                 abs=1e-4)
    h = gpus["H200"]
    assert timing.MATMUL_SHARE == pytest.approx(h["parts_s"]["matmuls"] / h["compiled_step_s"], abs=1e-3)


# ---- the search ------------------------------------------------------------------------------------------
def test_the_top_layouts_overrides_compose_and_validate(small):
    plan = search(small, 8, 8 * 8 * 1024).run(top=3)
    assert plan.best
    for e in plan.best:
        cfg = compose_config([*SMALL, *e.layout.overrides()])
        validate_layout(cfg, 8)  # raises on a layout the rules reject
        p = cfg.parallel
        assert p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp == 8
        tokens = cfg.trainer.micro_batch_size * cfg.trainer.seq_len * cfg.trainer.grad_accum_steps * (
            p.dp_replicate * p.dp_shard)
        assert tokens == 8 * 8 * 1024


def test_a_layout_the_rules_reject_is_named_and_never_printed(small):
    # model=small has 6 heads: tp 4 does not divide them (kimi/model/rules.py), tp 16 is past a node of 8
    cfg, _ = small
    s = search(small, 16, 16 * 4 * 1024)
    plan = s.run(top=20)
    text = "\n".join(plan.rejected.by_reason)
    with pytest.raises(ConfigError) as e:
        from kimi.model.rules import check_tensor_parallel

        check_tensor_parallel(cfg.model, 4)
    assert str(e.value).split("\n")[0] in text
    assert "tp > 8 GPUs per node" in text
    assert plan.best and all(x.layout.shape.tp not in (4, 16) for x in plan.best)


def test_the_ranking_prefers_the_faster_of_two_hand_checked_layouts(small):
    cfg, facts = small
    s = search(small, 2, 2 * 4 * 1024)
    tokens, peak = 2 * 4 * 1024, 989e12
    shape = Shape(1, 1, "1f1b", 1, 1, 1, 2, 1)
    none = Layout(shape, "none", 4, 1, 1, "bf16", True)
    full = Layout(shape, "full", 4, 1, 1, "bf16", True)
    compute = facts.flops_per_token * tokens / 2 / (peak * timing.MFU_CEILING["h200"])
    # FSDP over 2 ranks in a node: 0.8 GB gathered and 1.6 GB reduced (to 0.8 GB shards), (n-1)/n = 1/2 at
    # 450 GB/s, all overlapped with compute (well under it)
    fsdp = (400e6 / 450e9) + (800e6 / 450e9)
    times = {}
    for layout in (none, full):
        e = s.evaluate(layout, s.lower_bound(layout))
        times[layout.ac] = e.time.step_s
        assert sum(c.seconds for c in e.time.comm) == pytest.approx(fsdp)
        assert e.time.comm_exposed_s == 0.0
    muon = facts.busiest_owner(cfg, shape) / (peak * timing.MFU_CEILING["h200"])
    assert times["none"] == pytest.approx(compute + muon)
    assert times["full"] == pytest.approx(compute * 4 / 3 + muon)
    ranked = [e.layout for e in s.run(top=200).best]
    assert ranked.index(none) < ranked.index(full)


def test_a_memory_rejection_says_by_how_much(small):
    # 2 GPUs of 5 GiB (4.5 usable): 5.96 GiB of fake persistent state fits sharded over both, not replicated
    plan = search(small, 2, 2 * 16 * 1024, hbm_bytes=5 * GIB).run(top=50)
    memory = {r: f for r, f in plan.rejected.by_reason.items() if "GiB in all > 4.5 GiB" in r}
    assert any("dp2x1 bf16" in f for f in memory.values())
    assert plan.best and all(e.peak <= 0.9 * 5 * GIB and e.layout.shape.dp_replicate == 1 for e in plan.best)


def test_a_context_parallel_layout_over_one_devices_sizing_is_rejected_without_its_own(small):
    """A cp layout is sized with one device's trace at its rank's tokens first (kimi.plan.memory.memory_floor,
    a lower bound): over the memory, it is rejected saying "at least", and the rank's own sizing (its
    traces, the expensive call) never runs; within it, the rank's sizing decides."""
    cfg, facts = small
    sized = []

    def memory(cfg):
        sized.append(cfg.parallel.cp)
        return fake_memory(cfg)

    def over(cfg):  # 1 TiB of activations: nothing fits, so the walk reaches every layout
        return {**fake_memory(cfg), "activations": 1 << 40}

    def huge(cfg):
        sized.append(cfg.parallel.cp)
        return over(cfg)

    plan = Search(cfg, h200(8), 8 * 8 * 1024, facts, huge, fake_comm, validate_layout,
                  memory_floor=over).run(top=3)
    text = "\n".join(f"{r}: {f}" for r, f in plan.rejected.by_reason.items())
    assert not plan.best and set(sized) == {1}
    assert "GiB in all at least (one device's trace at a rank's tokens) > " in text and " cp2 " in text
    sized.clear()
    Search(cfg, h200(8), 8 * 8 * 1024, facts, huge, fake_comm, validate_layout,
           memory_floor=fake_memory).run(top=3)
    assert set(sized) > {1}


# ---- the command ------------------------------------------------------------------------------------------
@pytest.fixture
def models(monkeypatch):
    """The fakes above as kimi.plan.memory and kimi.plan.comm: this checks the command, not their numbers
    (which tests/plan/test_plan_models.py checks; sizing a 48B model takes minutes on 2 cores)."""
    comm = types.SimpleNamespace(collectives_per_step=fake_comm,
                                 per_rank=lambda cfg, muonclip=True: [fake_comm(cfg)])
    monkeypatch.setitem(sys.modules, "kimi.plan.comm", comm)
    monkeypatch.setitem(sys.modules, "kimi.plan.memory",
                        types.SimpleNamespace(memory_per_rank=fake_memory, memory_floor=fake_memory))


def test_the_48b_command_prints_every_column_and_launchable_overrides(models, capsys, tmp_path):
    out = tmp_path / "plan.json"
    assert cli.main([*COMMAND_48B, f"json={out}"]) == 0
    text = capsys.readouterr().out
    for column in ("step s", "tokens/s", "MFU", "compute", "bubble", "Muon NS", "comm exposed", "GiB/rank"):
        assert column in text
    for part in ("weights", "gradients", "optimizer", "activations", "fsdp_gathered", "comm_buffers"):
        assert f"{part} " in text
    assert "communication " in text and "Rejected" in text and "tp > 8 GPUs per node" in text
    data = json.loads(out.read_text())
    assert data["layouts"] and data["cluster"]["gpus"] == 64
    top = data["layouts"][0]
    assert f"train.py overrides: {' '.join(top['overrides'])}" in text
    assert top["step_s"] == pytest.approx(top["compute_s"] + top["bubble_s"] + top["muon_s"]
                                          + top["comm_exposed_s"])
    assert math.isclose(top["tokens_per_s"] * top["step_s"], 4194304, rel_tol=1e-9)
    cfg = compose_config(top["overrides"])
    validate_layout(cfg, 64)


def test_a_wrong_planner_key_is_one_line(capsys):
    assert cli.main(["cluster.gpus=64", "cluster.gpux=h200"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "did you mean cluster.gpu?" in err
    assert cli.main(["model=tiny"]) == 2
    assert "cluster.gpus is required" in capsys.readouterr().err
