"""The planner's memory and communication models (kimi/plan/memory.py, kimi/plan/comm.py) against what a
step really holds and sends: in-process, the activations and the optimizer's working memory measured by
torch's MemTracker; under torchrun, two layouts of bench/plan_check.py (peak memory within 10%, every
collective kind's calls and bytes equal to bench/comm_count.py's counts)."""

import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import ROOT

sys.path.append(str(ROOT / "bench"))  # appended: a bench script must not shadow an installed package
import plan_check  # noqa: E402

from kimi.config import register_configs  # noqa: E402

# tiers per test (in-process checks are unit, the torchrun comparison dist), as in test_conv_mixer.py
SHORT = ["model=tiny", "data.tokenizer.vocab_size=384", "trainer.seq_len=64", "trainer.micro_batch_size=2",
         "trainer.device=cpu", "trainer.run_dir=unused"]


def config(*overrides: str):
    from kimi.summary import vocab_note

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[*SHORT, *overrides]))
    vocab_note(cfg)  # model.vocab_size from the tokenizer's, as the trainer sets it
    return cfg


def tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def snapshot(mem) -> dict:
    """MemTracker's split at the peak, by category name (ACT, TEMP, OPT, ...)."""
    peak = mem.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items()}


def measured_activations(cfg, ac: str, bf16: bool = False, cuda_rules: bool = False,
                         allocator: bool = False) -> int:
    """MemTracker's activations and temporaries at the peak of one forward and backward of 2 rows of
    trainer.seq_len tokens (bf16: under CPU autocast, as trainer.precision=bf16 runs; cuda_rules: casting as
    CUDA autocast casts, kimi.plan.cuda_autocast, as a GPU runs). Under parallel.cp, of the last cp rank's
    shard of those rows, its exchanges answered locally (kimi.parallel.context_parallel.LastRankOf).
    allocator: the most the step allocated at once instead, read from the allocator (the profiler's memory
    timeline), which also sees what an op allocates inside its call."""
    import contextlib

    from kimi.plan.measure import _profiled_rise

    from kimi.plan.cuda_autocast import cuda_policy

    from kimi.model import KimiModel
    from kimi.parallel.activation_checkpointing import apply_activation_checkpointing

    from kimi.parallel.context_parallel import LastRankOf

    torch.manual_seed(0)
    model = KimiModel(cfg.model)
    cp = cfg.parallel.cp
    if cp > 1:
        model.context_parallel = LastRankOf(cp)
    apply_activation_checkpointing(model, ac)
    for p in model.parameters():  # gradients are memory.py's other part: dropped as they arrive
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.trainer.seq_len // cp + 1))

    def step():
        with cuda_policy() if cuda_rules else contextlib.nullcontext(), \
                torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()

    if allocator:
        return _profiled_rise(step)
    mem = tracker()
    mem.track_external(model)
    with mem:
        step()
    peak = snapshot(mem)
    return peak["ACT"] + peak["TEMP"]


def predicted_activations(cfg, mode) -> float:
    from kimi.plan.activations import trace
    from kimi.plan.memory import activations

    ac = cfg.parallel.activation_checkpointing
    return activations(cfg, trace(cfg.model, ac, mode), 0, list(range(cfg.model.num_layers)), True, True)


@pytest.mark.unit
@pytest.mark.parametrize("ac", ["none", "full"])
def test_activations_match_a_measured_forward_and_backward(ac):
    from kimi.plan.activations import Mode

    cfg = config(f"parallel.activation_checkpointing={ac}")
    want, got = predicted_activations(cfg, Mode()), measured_activations(cfg, ac)
    assert 0.9 <= want / got <= 1.1, (want, got)


@pytest.mark.unit
@pytest.mark.parametrize("ac", ["none", "full"])
def test_a_context_parallel_rank_is_traced_as_the_last_rank_runs(ac):
    """The trace of a cp layout runs the model as the last of cp ranks (the heaviest: its MLA reads every
    earlier shard, its KDA runs V + K value columns to join the shards) and matches that rank's measured
    step, which holds more than one device with the same tokens."""
    from kimi.plan.activations import Mode

    cfg = config(f"parallel.activation_checkpointing={ac}", "parallel.cp=2", "trainer.seq_len=128")
    want, got = predicted_activations(cfg, Mode(cp=2)), measured_activations(cfg, ac)
    assert 0.9 <= want / got <= 1.1, (want, got)
    one = config(f"parallel.activation_checkpointing={ac}")  # one device, the same 2 x 64 tokens
    assert got > measured_activations(one, ac)


@pytest.mark.unit
def test_the_backwards_transient_at_long_rows():
    """Under full recomputation at 2 x 1,024 tokens the forward keeps little and the backward's transient (a
    block recomputed, its activation gradients) sets the peak: 0.76 of the step's activations here. The trace
    counts it per token from peaks without the weights' gradients, which set a short row's peak (the
    embedding's and the head's, at a 32k vocabulary) and made the line through 64 and 128 tokens fall: that
    predicted 0.84 of this step."""
    from kimi.plan.activations import Mode, trace

    cfg = config("parallel.activation_checkpointing=full", "trainer.seq_len=1024",
                 "data.tokenizer.vocab_size=32000")
    want, got = predicted_activations(cfg, Mode()), measured_activations(cfg, "full")
    assert 0.9 <= want / got <= 1.1, (want, got)
    assert 2048 * trace(cfg.model, "full").extra >= 0.7 * got


@pytest.mark.unit
@pytest.mark.parametrize("ac", ["none", "selective"])
def test_bf16_activations_match_a_measured_autocast_step(ac):
    """A bf16 run is traced in bf16 (CPU autocast on fake tensors), not as half of the fp32 trace: what
    autocast leaves in fp32 and the copies of the weights autograd saves are counted (the step keeps 0.93
    of the fp32 step's activations here, not half)."""
    from kimi.plan.activations import Mode

    cfg = config(f"parallel.activation_checkpointing={ac}", "trainer.precision=bf16")
    want, got = predicted_activations(cfg, Mode(2, False)), measured_activations(cfg, ac, bf16=True)
    assert 0.9 <= want / got <= 1.1, (want, got)


@pytest.mark.unit
def test_a_gpu_runs_activations_match_its_kernels_measured(monkeypatch):
    """A GPU run is traced with the kernels a GPU's auto picks (the Triton KDA ops, attention and the fused
    AttnRes mix, through their fake implementations and what their launchers allocate beside the outputs,
    kimi.ops.SCRATCH); measured here with those kernels run for real (interpreted, conftest sets
    TRITON_INTERPRET=1) under bf16 autocast with CUDA's casting rules. They keep less than the CPU's paths.
    With the activations recomputed a KDA layer's backward sets the peak, inside its launcher: MemTracker (a
    dispatch mode) sees only the op's outputs there, so that case is read from the allocator, every kernel
    launch a no-op (allocations only)."""
    from triton.runtime.interpreter import InterpretedFunction

    from kimi.plan.activations import Mode

    # two blocks (KDA, MLA) keep the interpreted kernels' time down
    triton = ["model.kda.backend=triton", "model.attnres.backend=triton", "model.attention.backend=triton",
              "trainer.precision=bf16", "model.num_layers=2", "model.mla_every=2"]
    cfg = config("parallel.activation_checkpointing=none", *triton)
    want, got = (predicted_activations(cfg, Mode(2, True)),
                 measured_activations(cfg, "none", bf16=True, cuda_rules=True))
    assert 0.9 <= want / got <= 1.1, (want, got)
    cpu = config("parallel.activation_checkpointing=none", *triton[3:])
    assert want < 0.9 * predicted_activations(cpu, Mode(2, False))

    cfg = config("parallel.activation_checkpointing=full", *triton)
    monkeypatch.setattr(InterpretedFunction, "run", lambda self, *args, **kwargs: None)
    want = predicted_activations(cfg, Mode(2, True))
    got = measured_activations(cfg, "full", bf16=True, cuda_rules=True, allocator=True)
    assert 0.95 <= want / got <= 1.05, (want, got)


@pytest.mark.unit
def test_a_compiled_steps_activations_match_inductors_measured():
    """A compiled step (parallel.compile: torch.compile's inductor, C++ on this CPU) keeps what the min-cut
    partitioner saves, much less than the eager step; the trace runs each region through the same
    AOTAutograd and partitioner (kimi.plan.compiled). Measured by the profiler's memory timeline, which
    leaves the regions compiled (a dispatch mode like MemTracker would run them eager)."""
    from kimi.model import KimiModel
    from kimi.parallel.activation_checkpointing import apply_compile
    from kimi.plan.activations import Mode
    from kimi.plan.measure import _profiled_rise

    cfg = config("parallel.activation_checkpointing=none", "trainer.precision=bf16", "parallel.compile=true")
    torch.manual_seed(0)
    model = KimiModel(cfg.model)
    apply_compile(model)
    for p in model.parameters():  # gradients are memory.py's other part: dropped as they arrive
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ids = torch.randint(0, cfg.model.vocab_size, (2, cfg.trainer.seq_len + 1))

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(ids[:, :-1], labels=ids[:, 1:])
        loss.backward()

    # compiles; unvectorised C++ (a vector ISA changes the kernels' code, not which buffers they write: the
    # same bytes were measured with and without), which halves a cold compile on this CPU
    with torch._inductor.config.patch({"cpp.simdlen": 1}):
        step()
    got = _profiled_rise(step)
    want = predicted_activations(cfg, Mode(2, False, True))
    assert 0.95 <= want / got <= 1.2, (want, got)  # an upper bound: see kimi.plan.compiled
    assert want < 0.75 * predicted_activations(cfg, Mode(2, False))  # what the eager trace said


@pytest.mark.unit
def test_the_optimizer_steps_working_memory_matches_a_real_step():
    from kimi.model import KimiModel
    from kimi.optim import build_optimizer
    from kimi.plan.optimizer_step import step_bytes_per_param

    cfg = config()
    model = KimiModel(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    params = list(model.parameters())
    for _ in range(2):  # the first step makes the state; the second is measured
        for p in params:
            p.grad = torch.randn_like(p)
        if _ == 0:
            optimizer.step()
    mem = tracker()
    mem.track_external(model, optimizer)
    with mem:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    peak = snapshot(mem)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    want = step_bytes_per_param(cfg) * sum(p.numel() for p in params)
    assert 0.9 <= want / (peak["OPT"] - state) <= 1.1


@pytest.mark.unit
def test_the_newton_schulz_buffers_kept_on_the_cpu_are_predicted_and_measured_with_the_state():
    """On the CPU MuonClip keeps its Newton-Schulz buffers from one step to the next: the trace predicts
    their bytes exactly, and both measurements count them with the state from the step's start."""
    from kimi.model import KimiModel
    from kimi.optim import build_optimizer
    from kimi.plan.measure import allocator_peak, tracked_peak
    from kimi.plan.memory import rank_parts
    from kimi.plan.optimizer_step import kept_bytes_per_param

    cfg = config()
    model = KimiModel(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    params = list(model.parameters())

    def step():
        for p in params:
            p.grad = torch.randn_like(p)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    tracked = tracked_peak(step, model, optimizer, torch.device("cpu"))  # two steps: the second measured
    kept = sum(t.untyped_storage().nbytes() for t in optimizer.kept_buffers())
    assert kept > 0 and kept == kept_bytes_per_param(cfg) * sum(p.numel() for p in params)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    assert allocator_peak(step, model, optimizer, torch.device("cpu"))["OPT"] == state + kept
    assert tracked["OPT"] >= state + kept and "OTH" not in tracked
    # the plan counts them in the backward too: under full recomputation its end (the gradients made, little
    # of the activations left) is the peak, above the first backward's start and the optimizer step
    full = config("parallel.activation_checkpointing=full")
    (parts,) = rank_parts(full)
    assert parts["optimizer"] == pytest.approx(state + kept, rel=1e-4)
    assert parts["gradients"] == 4 * sum(p.numel() for p in params) and 0 < parts["activations"] < 8 << 20
    cuda = config("trainer.device=cuda")  # a GPU's allocator reuses its blocks: MuonClip keeps none there
    assert kept_bytes_per_param(cuda) == 0


@pytest.mark.unit
def test_sharding_divides_what_each_layout_shards():
    from kimi.plan.comm import collectives_per_step
    from kimi.plan.memory import PARTS, rank_parts

    def parts(*overrides):
        return rank_parts(config(*overrides))[0]

    one, fsdp = parts(), parts("parallel.dp_shard=2")
    assert set(one) == set(PARTS) and all(isinstance(v, int) and v >= 0 for v in one.values())
    assert fsdp["weights"] * 2 == pytest.approx(one["weights"], rel=0.01)
    assert fsdp["fsdp_gathered"] > 0 == one["fsdp_gathered"]
    zero = {s: parts("parallel.engine=deepspeed", "parallel.dp_shard=2", f"parallel.deepspeed.zero_stage={s}")
            for s in (1, 2, 3)}
    assert zero[3]["weights"] < zero[2]["weights"] == zero[1]["weights"]
    assert zero[2]["optimizer"] == zero[1]["optimizer"] < one["optimizer"]
    assert collectives_per_step(config()) == []  # one process: nothing to communicate


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder with the generated corpus and its token cache, shared by the layouts."""
    path = tmp_path_factory.mktemp("plan_check")
    return path, plan_check.corpus(path / "corpus")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tiny/fsdp2/selective", "tiny/tp2_sp/full", "tiny/pp2_interleaved/none"])
def test_the_models_match_a_measured_step(layout, work):
    path, data = work
    measured = plan_check.measure(layout, data, path)
    assert measured is not None, (path / (layout.replace("/", "_") + ".log")).read_text()[-3000:]
    row = plan_check.compare(layout, measured, plan_check.predict(layout, data))
    assert 0.9 <= row["ratio"] <= 1.1, row
    for kind in row["comm"]:
        assert (kind["predicted_calls"], kind["predicted_bytes"]) == (kind["calls"], kind["bytes"]), kind


@pytest.mark.unit
def test_the_owner_plan_computed_once_is_every_ranks_own():
    """kimi.plan.owner_plan runs kimi.optim.owners.assign once for a stage group (its plans differ between
    ranks only in `local`) and caches what it counts: the same as each rank's own call."""
    import math

    import torch

    from kimi.optim.owners import assign
    from kimi.plan import owner_plan
    from kimi.plan.shapes import pipeline

    cfg = config("model=moe_tiny", "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2")
    _, blocks, first, last = pipeline(cfg)[0]
    params = owner_plan.rank_params(cfg, blocks, first, last)
    muon, plans, local = owner_plan.muon_plans(cfg, params)
    everyone = owner_plan._blocks_of(cfg, params)
    _, routes, _ = owner_plan.model_shapes(cfg)
    order = [i for i, x in enumerate(params) if routes[x[0]] == "muon"]
    order += [i for i, x in enumerate(params) if routes[x[0]] != "muon" and len(x[1]) >= 2]
    order += [i for i, x in enumerate(params) if routes[x[0]] != "muon" and len(x[1]) < 2]
    everyone = [[mine[i] for i in order] for mine in everyone]
    kinds = [(torch.float32, torch.device("meta"))] * len(order)
    traffic = owner_plan.muon_traffic(cfg, blocks, first, last)
    for rank in range(8):
        own = assign(everyone, muon, rank, kinds)
        assert [p.local for p in own] == local[rank]
        who = [(p.owner, p.senders, p.keepers) for p in plans]
        assert [(p.owner, p.senders, p.keepers) for p in own] == who
        mine = sum(math.prod(p.shape) for p, m in zip(own, muon) if m and p.owner == rank)
        assert traffic.owned[rank] == mine
    assert owner_plan.muon_traffic(cfg, blocks, first, last) is traffic  # cached


@pytest.mark.unit
def test_the_searchs_bound_without_muonclip_is_below_the_whole_communication():
    """The search skips a layout when its collectives without MuonClip's already make it too slow: for
    that the rest must be a subset of every pipeline rank's collectives."""
    from kimi.plan.comm import per_rank

    cfg = config("model=moe_tiny", "parallel.dp_shard=2", "parallel.pp=2", "parallel.pp_microbatches=2")
    whole, rest = per_rank(cfg), per_rank(cfg, muonclip=False)
    for mine, fewer in zip(whole, rest):
        counted = {(c.kind, c.dim): c for c in mine}
        for c in fewer:
            assert c.calls <= counted[(c.kind, c.dim)].calls and c.bytes <= counted[(c.kind, c.dim)].bytes
    assert any(c.kind == "all_to_all" for rank in whole for c in rank)
    assert not any(c.kind == "all_to_all" for rank in rest for c in rank)


@pytest.mark.unit
def test_the_per_shape_communication_floor_is_below_every_layout_of_the_shape():
    """The search queues a layout behind the communication its whole shape exposes at least (comm_floor):
    that must be at most what each of the shape's layouts exposes, recomputation and forwards included."""
    from kimi.plan.cluster import split_args
    from kimi.plan.layout import apply
    from kimi.plan.model_facts import ModelFacts
    from kimi.plan.search import make_search

    cfg = config("model=moe_tiny")
    cluster = split_args(["cluster.gpus=8", "cluster.gpus_per_node=4"]).cluster  # groups across 2 "nodes"
    s = make_search(cfg, cluster, 8 * 4 * 64, ModelFacts.of(cfg))
    s.run(top=1)  # enumerates every layout (and each shape's floor)
    checked = 0
    for shape in list(s.shapes())[::3]:
        for layout in s.layouts(shape):
            lines, exposed = s.comm_lines(apply(cfg, layout), s.lower_bound(layout)[0])
            assert s.comm_floor(layout) <= exposed, (layout.label(), s.comm_floor(layout), exposed)
            checked += s.comm_floor(layout) > 0
    assert checked > 10  # shapes with tp, ep or MuonClip traffic were among them


@pytest.mark.unit
def test_a_nan_score_counts_in_no_quantile_balancing_bin():
    """Found measuring k3_tiny with a GPipe pipeline (bench/plan_check.py): the second stage infers its
    shapes on uninitialised activations, whose NaN scores became bin index -2**63 and crashed the step."""
    from kimi.model.moe import required_bias_histogram

    torch.manual_seed(0)
    scores, bias = torch.rand(5, 4), torch.tensor([0.1, -0.2, 0.0, 0.3])
    want = torch.zeros(4, 10)
    required_bias_histogram(scores, bias, 2, want)
    got = torch.zeros(4, 10)
    required_bias_histogram(torch.cat([scores, torch.full((2, 4), float("nan"))]), bias, 2, got)
    assert torch.equal(got, want) and want.sum() == 5 * 4  # the NaN tokens count in no bin
    partial = scores.clone()
    partial[0, 1] = float("nan")
    some = torch.zeros(4, 10)
    required_bias_histogram(partial, bias, 2, some)  # no out-of-range bin
    assert want.sum() - 4 <= some.sum() < want.sum()


@pytest.mark.unit
def test_the_docs_memory_table_is_the_committed_check():
    """docs/planning.md's memory table is bench/plan_check.py's table of the committed
    bench/results/plan_check.json, every layout in it, and its bf16 and compiled paragraphs quote that run's
    rows."""
    import json

    rows = json.loads((ROOT / "bench" / "results" / "plan_check.json").read_text())["rows"]
    assert [r["layout"] for r in rows] == list(plan_check.LAYOUTS)
    docs = (ROOT / "docs" / "planning.md").read_text()
    memory = plan_check.table(rows).split("\n\n")[0]
    assert memory in docs
    by_name = {r["layout"]: r for r in rows}
    bf16, fp32 = by_name["tiny/single/none_bf16"], by_name["tiny/single/none"]
    kept, kept32 = bf16["measured_parts"]["rest"] / 2**20, fp32["measured_parts"]["rest"] / 2**20
    flat = " ".join(docs.split())
    assert (f"keeps {kept:.2f} MiB beside its weights and optimizer state, {kept / kept32:.2f} of the fp32 "
            f"step's {kept32:.2f}") in flat
    assert (f"{bf16['predicted_peak'] / 2**20:.2f} MiB against {bf16['measured_peak'] / 2**20:.2f} measured, "
            f"{bf16['ratio']:.3f}") in flat

    def beside_state(row):  # MiB beside the weights and optimizer state
        parts = row["measured_parts"]
        return (parts["rest"] + parts["gradients"]) / 2**20

    none, none_c = bf16, by_name["tiny/single/none_bf16_compiled"]
    sel, sel_c = by_name["tiny/single/selective_bf16_512"], by_name["tiny/single/selective_bf16_512_compiled"]
    assert (f"`tiny/single/none_bf16_compiled` keeps {beside_state(none_c):.2f} MiB beside its weights and "
            f"optimizer state against the eager step's {beside_state(none):.2f} "
            f"({beside_state(none_c) / beside_state(none):.2f} of it), and with selective checkpointing at "
            f"512 tokens {beside_state(sel_c):.2f} MiB against {beside_state(sel):.2f} "
            f"({beside_state(sel_c) / beside_state(sel):.2f})") in flat
    assert f"Now {none_c['ratio']:.3f} and {sel_c['ratio']:.3f}" in flat  # traced as compiled
    assert f"predicted the same there), at {by_name['tiny/single/full_1024']['ratio']:.3f}" in flat
