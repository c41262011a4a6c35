"""bench/step_audit.py, small: one bf16-autocast training step of `tiny` and `moe_tiny` runs no matmul in fp32
that the audit cannot explain, calls the KDA and attention kernels with bf16 q, k, v, reads nothing to the
host in the forward and backward and only what its allow-list explains in the update; activation checkpointing
keeps a few KiB per token; the roofline prices every op. The audit's detectors are checked on planted
faults, so a blind audit cannot pass."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT / "bench"))  # appended: a bench script must not shadow an installed package

import step_audit  # noqa: E402

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("family", ["tiny", "moe"])
def test_a_bf16_step_has_no_unexplained_fp32_matmul_or_host_read(family):
    ops = step_audit.audit_ops(step_audit.FAMILIES[family], T=64)
    assert ops["unexplained_fp32"] == 0, [r for r in ops["fp32"] if r["allowed"] is None]
    assert ops["fp32_kernel_calls"] == 0, ops["kernels"]
    assert {r["kernel"] for r in ops["kernels"]} == {"chunk_kda", "attention"}
    assert ops["syncs"]["forward_backward"] == [], ops["syncs"]["forward_backward"]
    assert ops["unexplained_syncs"] == 0, ops["syncs"]["update"]
    assert (any(r["op"] == "_grouped_mm" and r["dtypes"] == "bfloat16" for r in ops["matmuls"])
            == (family == "moe"))


def test_the_audit_sees_planted_fp32_matmuls_and_host_reads(monkeypatch):
    """A KDA layer whose output gate runs outside autocast, and an MLP that reads a value to the host: both
    show up, unexplained."""
    import kimi.model.mlp as mlp

    forward = mlp.SwiGLU.forward

    def leaky(self, x, **kwargs):
        if float(x.float().abs().max()) < 0:  # a host read
            raise AssertionError
        with torch.autocast("cpu", enabled=False):
            x.float() @ self.w_up.weight.T.float()
        return forward(self, x, **kwargs)

    monkeypatch.setattr(mlp.SwiGLU, "forward", leaky)
    ops = step_audit.audit_ops(step_audit.FAMILIES["tiny"], T=64)
    assert ops["unexplained_fp32"] >= 1
    assert any(r["op"] == "_local_scalar_dense" and r["allowed"] is None
               for r in ops["syncs"]["forward_backward"])
    assert ops["unexplained_syncs"] >= 1


def test_checkpointing_keeps_a_few_kib_per_token():
    """tiny at 32k vocabulary: AC full keeps under 8 KiB per token (each sublayer's input and the sources,
    bf16 at d=128), at least 10x less than without checkpointing."""
    memory = step_audit.audit_memory(step_audit.FAMILIES["tiny"], 64, 128, modes=("none", "full"))
    full, none = memory["full"]["bytes_per_token"], memory["none"]["bytes_per_token"]
    assert 0 < full < 8 * 1024 and full * 10 < none, memory


@pytest.mark.parametrize("family", ["tiny", "moe"])
def test_roofline_prices_the_step(family):
    """MoE included: its experts trace as the GPU's grouped GEMMs (no host read of the counts on meta)."""
    roof = step_audit.audit_roofline(step_audit.FAMILIES[family], 256)
    # the traced FLOPs cover the model's count (attention's extras come on top); without the grouped GEMMs'
    # count moe_tiny's would be 6% short
    assert roof["traced_flops"] >= 0.98 * roof["model_flops"]
    for gpu in ("H200", "H100"):
        g = roof["gpus"][gpu]
        assert 0 < g["mfu_ceiling"] < 1 and g["predicted_step_s"] > 0
        assert len(g["memory_bound_top10"]) == 10
    assert roof["gpus"]["H100"]["predicted_step_s"] > roof["gpus"]["H200"]["predicted_step_s"]
    # KDA priced as the GPU runs it: the Triton chunk ops, each way, with their FLOPs
    assert roof["gpus"]["H200"]["time_by_class"]["kda"] > 0
    # the forward by module kind: the model's own work between the sublayers (the depth mixes) and the
    # mixers are named, and the forward is a part of the whole step (the fused loss makes its gradients there)
    forward = {x["module"]: x["compute_s"] + x["memory_s"]
               for x in roof["gpus"]["H200"]["forward_time_by_module"]}
    assert forward["model"] > 0 and forward["mixer"] > 0
    assert 0.2 < sum(forward.values()) / roof["gpus"]["H200"]["predicted_step_s"] < 1


def test_the_host_audit_counts_the_ops_a_cuda_step_dispatches():
    """bench/host_audit.py's eager count (--parts host): on the meta device, dispatched as on CUDA, a tiny
    step reaches the Triton custom ops (not the CPU fallbacks), counts views apart from launches, and grows
    with depth; the proxy keeps a preset's depth and heads and narrows its widths."""
    import host_audit

    def count(*extra):
        cfg = step_audit.compose([*step_audit.FAMILIES["tiny"], "model.attention.backend=triton", *extra])
        return host_audit.eager_on_meta(cfg, 64, step_audit.build, step_audit.batch, step_audit.loss_of,
                                        repeats=1)

    two, four = count("model.num_layers=2"), count("model.num_layers=4")
    assert {"kda_chunk_fwd", "kda_chunk_bwd"} <= set(two["custom_ops"]), two["custom_ops"]
    assert 0 < two["launches"] < two["ops"] and 1.6 < four["ops"] / two["ops"] < 2.4, (two, four)
    cfg = step_audit.compose(step_audit.FAMILIES["1b"])
    proxy = step_audit.compose([*step_audit.FAMILIES["1b"], *host_audit.proxy_overrides(cfg)])
    assert (proxy.model.num_layers, proxy.model.kda.num_heads, proxy.model.mla.num_heads) == (
        cfg.model.num_layers, cfg.model.kda.num_heads, cfg.model.mla.num_heads)
    assert proxy.model.d_model * 8 <= cfg.model.d_model


def test_the_host_audit_times_a_step_graphs_own_host_part():
    """parallel.cuda_graphs=step's prediction: StepGraph around tiny's micro-batch with a replay that costs
    nothing leaves the batch copied in, the records (one max-logit tensor per MLA layer) and the loss copied
    out: a few launches, none of the model's."""
    import host_audit

    from kimi.parallel.cuda_graphs import BATCH_FIELDS

    # the PyTorch kernels (null kernels would stay for the worker's other tests; interpreted Triton is slow)
    cfg = step_audit.compose([*step_audit.FAMILIES["tiny"], "model.attention.backend=sdpa",
                              "model.kda.backend=torch"])
    part = host_audit.step_graph_host(cfg, step_audit.build, step_audit.batch, step_audit.loss_of, repeats=1,
                                      null=False)
    model = step_audit.build(cfg)
    mla = sum(1 for _, m in model.sublayers() if m.MAX_LOGITS)
    assert part["records"] == mla >= 1
    assert part["launches"] == len(BATCH_FIELDS) + mla + 1
    assert part["parameters"] == sum(1 for p in model.parameters() if p.requires_grad)


def test_the_compiled_roofline_marks_what_parallel_compile_compiles():
    """bench/compiled_roofline.py's Regions: in tiny's meta trace, the ops that apply_compile's regions run
    (each sublayer, each depth mix with its pre-norm) are marked in the forward and in the backward, the
    embedding and the loss's head are not, and marking changes nothing that is traced. The compiled price
    takes out the marked elementwise ops, keeps the matmuls, and adds Inductor's kernels."""
    import compiled_roofline as cr

    overrides = [*step_audit.FAMILIES["tiny"], *cr.OVERRIDES]
    plain, flops = step_audit.trace_step(overrides, 128)
    regions = cr.Regions()
    marked, _ = step_audit.trace_step(overrides, 128, regions)
    cfg = step_audit.compose(overrides)
    # each block's two sublayers and the mix with its pre-norm before each, then the final mix: the 17
    # regions the host audit's compiled tiny calls
    assert len(regions.spans) == 4 * cfg.model.num_layers + 1
    total = lambda ops, i: sum(v[i] for v in ops.values())  # noqa: E731
    # the same ops but for how the pre-norm after a mix is written (the unmarked mixes run RMSNorm's module)
    assert total(marked.ops, 1) == pytest.approx(total(plain.ops, 1), rel=0.01)
    assert total(marked.ops, 2) == pytest.approx(total(plain.ops, 2), rel=0.01)
    inside = {k[0] for k in marked.ops if k[3]}
    outside = {k[0] for k in marked.ops if not k[3]}
    assert {"mm", "mul", "sum", "kimi::kda_chunk_fwd", "kimi::kda_chunk_bwd"} <= inside
    assert {"embedding", "embedding_dense_backward"} <= outside and "embedding" not in inside
    backward_inside = {k[0] for k, v in marked.ops.items()
                       if k[3] and v[0] > marked.forward_ops.get(k, [0])[0]}
    assert {"mm", "mul"} <= backward_inside, backward_inside
    rows = {g: step_audit.priced(marked.ops, peak) for g, peak in step_audit.GPUS.items()}
    no_kernels = cr.price(rows, 0.0, flops, step_audit.GPUS, step_audit.MATMULS)["H200"]
    parts = no_kernels["parts_s"]
    assert parts["absorbed (unfused)"] > 0 and parts["matmuls"] > 0
    unfused_rest = no_kernels["unfused_step_s"] - parts["absorbed (unfused)"]
    assert no_kernels["compiled_step_s"] == pytest.approx(unfused_rest)
    line = cr.at(4096, {"T": 128, "bytes": 1000}, {"T": 256, "bytes": 1800})
    assert line == 1000 + 800 / 128 * (4096 - 128)


def test_the_compiled_roofline_counts_the_gradient_sums_between_regions():
    """A tensor read by two compiled regions gets one gradient from each, which autograd's engine adds
    outside both graphs: compiled_roofline.accumulations finds that add (and its bytes: two bf16 operands
    read, one written) in a profile, and nothing when one region reads it."""
    from torch.profiler import ProfilerActivity, profile

    import compiled_roofline as cr

    region = torch.compile(lambda x: x.sin() * 2)
    x = torch.randn(64, 16, dtype=torch.bfloat16, requires_grad=True)

    def sums(reads: int) -> dict:
        y = x * 1  # a tensor with a producer, as every region input in the model
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            sum(region(y) for _ in range(reads)).sum().backward()
        return cr.accumulations(prof.events())

    assert sums(2) == {"accumulations": 1, "accumulation_bytes": 3 * 64 * 16 * 2}
    assert sums(1) == {"accumulations": 0, "accumulation_bytes": 0}


def test_the_docs_host_table_is_the_scripts():
    """docs/benchmarks.md's host table is bench/step_audit.py's, rendered from the committed results."""
    results = json.loads((ROOT / "bench" / "results" / "step_audit.json").read_text())
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    block = page.split("<!-- host table: bench/step_audit.py --report -->\n", 1)[1]
    block = block.split("\n<!-- end of host table -->", 1)[0]
    assert block.splitlines() == [line for line in step_audit.host_report(results) if line.startswith("|")]
