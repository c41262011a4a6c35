"""`python -m kimi.summary`: parameter families, optimizer split, FLOPs and memory per rank, checked
against counts made here from the model's named parameters and, for tensor parallelism and FSDP, against
the shards the real parallel plans produce (a fake process group: one process, no communication)."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kimi.config import mla_layer_indices
from kimi.model import KimiModel
from kimi.summary import compose_config, main, summarize

ROOT = Path(__file__).resolve().parents[2]
LAYOUT_48B = ["model=48b_dense", "parallel.dp_shard=64", "parallel.tp=8", "parallel.pp=4",
              "trainer.seq_len=4096", "trainer.micro_batch_size=1", "trainer.precision=bf16"]


def summary(*overrides: str):
    return summarize(compose_config(list(overrides)))


def meta_model(s) -> KimiModel:
    """A fresh model of the summary's (vocab-resolved) config, on the meta device."""
    with torch.device("meta"):
        return KimiModel(s.cfg.model)


def counts_by_name(model: KimiModel) -> dict:
    """Families by parameter name alone (block index -> KDA or MLA from the config)."""
    mla = set(mla_layer_indices(model.cfg))
    out = dict.fromkeys(["embedding", "LM head", "norms + AttnRes queries"], 0)  # the rows every model has
    for name, p in model.named_parameters():
        if name.startswith("embed."):
            key = "embedding"
        elif name.startswith("lm_head."):
            key = "LM head"
        elif m := re.match(r"blocks\.(\d+)\.mixer\.", name):
            key = "MLA mixers" if int(m.group(1)) in mla else "KDA mixers"
        elif re.match(r"blocks\.\d+\.mlp\.experts\.w_(gate|up|down)$", name):
            key = "routed experts"  # a MoE layer's 3-D expert weights
        elif re.match(r"blocks\.\d+\.mlp\.", name):
            key = "MLPs"
        else:
            assert re.search(r"(^|\.)(mixer_norm|mlp_norm|norm)\.weight$|_query$", name), name
            key = "norms + AttnRes queries"
        out[key] = out.get(key, 0) + p.numel()
    return out


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["tiny", "48b_dense", "moe_tiny"])
def test_families_add_up_to_the_model(preset):
    s = summary(f"model={preset}")
    model = meta_model(s)
    assert s.families == counts_by_name(model)
    assert sum(s.families.values()) == s.total == model.num_params()
    # MuonClip's default routing: 2-D matrices (and MoE experts' 3-D batches of them) except the embedding
    # and the LM head
    muon = sum(p.numel() for n, p in model.named_parameters()
               if (p.ndim == 2 or n.endswith((".experts.w_gate", ".experts.w_up", ".experts.w_down")))
               and not n.startswith(("embed.", "lm_head.")))
    assert (s.muon, s.adamw) == (muon, model.num_params() - muon)
    if preset == "48b_dense":
        assert (47.5e9 < s.total < 48.5e9 and s.families["MLA mixers"] > 0
                and len(mla_layer_indices(model.cfg)) == 7)


@pytest.mark.unit
def test_tied_lm_head_adds_nothing():
    s = summary("model=tiny", "model.tie_embeddings=true")
    assert s.families["LM head"] == 0 and s.total == meta_model(s).num_params()


@pytest.mark.unit
def test_vocab_follows_the_tokenizer_when_null():
    s = summary("model=tiny", "data.tokenizer.vocab_size=1000")
    assert s.cfg.model.vocab_size == 1024 and "rounded up" in s.vocab_note
    assert summary("model=tiny", "model.vocab_size=1000").vocab_note is None


@pytest.mark.unit
def test_flops_per_step():
    s = summary("model=tiny", "trainer.seq_len=256", "trainer.micro_batch_size=3",
                "trainer.grad_accum_steps=2", "parallel.dp_replicate=2", "parallel.dp_shard=5")
    tokens = 3 * 256 * 2 * 2 * 5
    assert s.tokens_per_step == tokens
    assert s.flops_per_step == pytest.approx(meta_model(s).flops_per_token(256) * tokens)


@pytest.mark.unit
def test_memory_counts_weights_grads_and_optimizer_state():
    model_s = summary("model=tiny")
    model = meta_model(model_s)
    n = model.num_params()
    muon = sum(p.numel() for name, p in model.named_parameters()
               if p.ndim == 2 and not name.startswith(("embed.", "lm_head.")))
    # fp32 weights + fp32 grads; MuonClip: one fp32 momentum per Muon parameter, two moments per AdamW one
    assert model_s.heaviest.persistent_bytes == 4 * n + 4 * n + 4 * muon + 8 * (n - muon)
    assert summary("model=tiny", "optim=adamw").heaviest.persistent_bytes == 16 * n


@pytest.mark.unit
def test_fsdp_halves_memory_and_dp_replicate_does_not():
    one = summary("model=tiny").heaviest.persistent_bytes
    two = summary("model=tiny", "parallel.dp_shard=2").heaviest.persistent_bytes
    model = meta_model(summary("model=tiny"))
    # FSDP shards every parameter's dim 0; an odd dim 0 pads at most half a row, 16 bytes per element of it
    slack = sum(16 * p[0].numel() / 2 for p in model.parameters())
    assert one / 2 <= two <= one / 2 + slack
    assert summary("model=tiny", "parallel.dp_replicate=2").heaviest.persistent_bytes == one


@pytest.fixture
def fake_world():
    """A process group of 4 ranks in this one process (collectives are no-ops): enough for the real tensor
    parallel and FSDP plans to shard a model, which is all these tests look at."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def local_params(model) -> int:
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


@pytest.mark.unit
@pytest.mark.parametrize("preset", ["tiny", "moe_tiny"])
def test_tp_divides_what_it_says(fake_world, preset):
    from torch.distributed.device_mesh import init_device_mesh

    from kimi.parallel.fsdp import apply_data_parallel
    from kimi.parallel.tensor_parallel import apply_tensor_parallel

    s_tp = summary(f"model={preset}", "parallel.tp=2")
    s_both = summary(f"model={preset}", "parallel.tp=2", "parallel.dp_shard=2")
    model = meta_model(s_tp)
    # replicated over tp, by name: norms, AttnRes queries, KDA's low-rank down-projections, MLA's W_dkv,
    # and everything of a MoE layer (router, shared experts, the routed experts' 3-D weights)
    kept = (r"norm\.weight$|_query$|f_proj_down\.weight$|g_proj_down\.weight$|wkv_a\.weight$"
            r"|\.mlp\.(router|shared)\.|\.mlp\.experts\.w_(gate|up|down)$")
    replicated = sum(p.numel() for n, p in model.named_parameters() if re.search(kept, n))
    assert s_tp.heaviest.tp_replicated == replicated
    assert s_tp.heaviest.tp_split == model.num_params() - replicated
    assert s_tp.heaviest.local == replicated + (model.num_params() - replicated) // 2

    # the real plans, on a real (CPU) model
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    real = KimiModel(s_tp.cfg.model)
    apply_tensor_parallel(real, mesh["tp"])
    assert local_params(real) == s_tp.heaviest.local
    apply_data_parallel(real, mesh["dp_shard"])
    assert local_params(real) == s_both.heaviest.local


@pytest.mark.unit
def test_expert_parallel_divides_what_it_says(fake_world):
    """moe_tiny with dp_shard 4 and ep 2: each rank keeps half the experts, FSDP-sharded over 2 ranks, and the
    rest of the model sharded over 4, as the real expert-parallel and FSDP plans place them (the same count
    per rank as FSDP alone; what ep saves is the gathers and the expert all-gathered copy)."""
    from kimi.parallel.dims import ParallelDims
    from kimi.parallel.expert_parallel import apply_expert_parallel
    from kimi.parallel.fsdp import apply_data_parallel

    s = summary("model=moe_tiny", "parallel.dp_shard=4", "parallel.ep=2")
    dims = ParallelDims(1, 4, 1, 1, 4, ep=2)
    mesh, expert_mesh = dims.build_mesh("cpu"), dims.build_expert_mesh("cpu")
    real = KimiModel(s.cfg.model)
    apply_expert_parallel(real, expert_mesh["ep"])
    apply_data_parallel(real, mesh["dp_replicate", "dp_shard"], expert_mesh=expert_mesh)
    assert local_params(real) == s.heaviest.local
    E = s.cfg.model.moe.num_experts
    assert real.blocks["1"].mlp.experts.w_gate.to_local().shape[0] == E // 4  # E / ep, then / (dp_shard / ep)


@pytest.mark.unit
def test_pipeline_heaviest_stage():
    from kimi.parallel.pipeline import split_blocks

    s = summary("model=tiny", "parallel.pp=2")
    model = meta_model(s)
    ranges = split_blocks(s.cfg.model, 2, s.cfg.trainer.seq_len)

    def stage_params(blocks, first, last):
        total = 0
        for name, p in model.named_parameters():
            m = re.match(r"blocks\.(\d+)\.", name)
            if m:
                total += p.numel() * (int(m.group(1)) in blocks)
            else:
                total += p.numel() * (first if name.startswith("embed.") else last)
        return total

    want = [stage_params(set(r), i == 0, i == 1) for i, r in enumerate(ranges)]
    assert [r.params for r in s.ranks] == want and sum(want) == model.num_params()
    assert s.heaviest.params == max(want) < model.num_params()
    single = summary("model=tiny").heaviest.persistent_bytes
    assert s.heaviest.persistent_bytes < single


@pytest.mark.unit
def test_main_prints_the_report(capsys):
    text = main(["model=tiny", "parallel.dp_shard=2"])
    out = capsys.readouterr().out
    assert text in out and f"{meta_model(summary('model=tiny')).num_params():,}" in out
    assert "activations" in out.lower() and "GiB" in out


@pytest.mark.unit
def test_bad_key_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["model.kda_heads=8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "kda_heads" in err and "\n" not in err


@pytest.mark.e2e
def test_cli_sizes_48b_quickly():
    proc = subprocess.run([sys.executable, "-m", "kimi.summary", *LAYOUT_48B], cwd=ROOT, capture_output=True,
                          text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    with torch.device("meta"):
        total = KimiModel(compose_config(LAYOUT_48B).model).num_params()
    assert f"{total:,}" in proc.stdout and "heaviest" in proc.stdout
    assert math.isclose(total, 48e9, rel_tol=0.01)


@pytest.mark.unit
def test_moe_active_parameters_and_flops():
    """moe_tiny: a token uses the router, the shared expert and top_k of the routed experts of each MoE
    block; the FLOPs count exactly those (6 per active parameter besides attention and KDA terms)."""
    s = summary("model=moe_tiny")
    m = s.cfg.model
    per_expert = 3 * m.moe.hidden * m.d_model
    moe_blocks = m.num_layers - m.moe.first_dense
    assert s.families["routed experts"] == moe_blocks * m.moe.num_experts * per_expert
    assert s.total - s.active == moe_blocks * (m.moe.num_experts - m.moe.top_k) * per_expert
    dense = summary("model=moe_tiny", "model.moe.num_experts=0")
    # the same model with dense MLPs of the same layout: FLOPs differ by exactly the MLP parameters' 6 N
    mlp_dense = moe_blocks * 3 * m.mlp.hidden * m.d_model
    mlp_moe = (moe_blocks * (m.moe.top_k + m.moe.shared_experts) * per_expert
               + moe_blocks * m.moe.num_experts * m.d_model)
    assert s.flops_per_token - dense.flops_per_token == pytest.approx(6 * (mlp_moe - mlp_dense))


@pytest.mark.unit
def test_context_parallel_shards_weights_like_data_parallel(fake_world):
    """dp_shard 2 x cp 2: FSDP shards every weight over the 4 ranks (the real mesh and plan), as the summary
    counts them."""
    from kimi.parallel.dims import ParallelDims
    from kimi.parallel.fsdp import apply_data_parallel

    s = summary("model=tiny", "parallel.dp_shard=2", "parallel.cp=2")
    dims = ParallelDims(1, 2, 1, 1, 4, cp=2)
    real = KimiModel(s.cfg.model)
    apply_data_parallel(real, dims.fsdp_mesh(dims.build_mesh("cpu")))
    assert (local_params(real) == s.heaviest.local
            == summary("model=tiny", "parallel.dp_shard=4").heaviest.local)
    assert s.world == 4 and s.tokens_per_step == summary("model=tiny", "parallel.dp_shard=2").tokens_per_step


@pytest.mark.unit
def test_kimi_k3_preset_is_the_released_size():
    """Kimi K3's report: 2.78T parameters, 104.2B activated per token (the LM head counted, the embedding
    lookup not); the preset's shapes are its config.json's. Sized on the meta device by the command."""
    proc = subprocess.run([sys.executable, "-m", "kimi.summary", "model=kimi_k3"], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    s = summary("model=kimi_k3")
    assert f"{s.total:,}" in proc.stdout
    assert math.isclose(s.total, 2.78e12, rel_tol=0.005)
    assert math.isclose(s.active - s.families["embedding"], 104.2e9, rel_tol=0.005)
    assert s.families["routed experts"] == 92 * 896 * 3 * 3072 * 3584  # experts at the latent width
