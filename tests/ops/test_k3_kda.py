"""Kimi K3's KDA (model.kda.gate_lower_bound, model.kda.full_rank_gate): the safe gate L sigmoid(exp(A_log)
(f + dt_bias)) against fla-core's reference and fp64, its fused Triton kernel (interpreted) forward and
backward against PyTorch's in fp64, and the whole layer against mlx-lm's kimi_k3 KDA (an independent
definition) with the same weights."""

import numpy as np
import pytest
import torch

from helpers import tiny_model_cfg
from kimi.config import ConfigError
from kimi.interop.hf import NotExpressible, hf_config
from kimi.model.kda import KDA
from kimi.model.rules import validate_model
from kimi.ops.kda.gate import normalize_and_gate

pytestmark = pytest.mark.unit

F64 = torch.float64


def _gate_inputs(dtype=F64, H=3, K=16):
    gen = torch.Generator().manual_seed(0)
    f = torch.linspace(-30, 30, 2 * 5 * H * K, dtype=F64)[torch.randperm(2 * 5 * H * K, generator=gen)]
    A_log = torch.randn(H, generator=gen, dtype=F64)
    dt_bias = torch.randn(H * K, generator=gen, dtype=F64)
    return [t.to(dtype) for t in (f.view(2, 5, H, K), A_log, dt_bias)]


def test_safe_gate_is_fla_cores_lower_bound_gate_and_stays_in_bounds():
    from fla.ops.kda.gate import naive_kda_lowerbound_gate

    f, A_log, dt_bias = _gate_inputs()
    q = torch.randn(2, 5, 3, 16, dtype=F64)
    _, _, g = normalize_and_gate(q, q, f, A_log, dt_bias, backend="torch", lower_bound=-5.0)
    expected = naive_kda_lowerbound_gate(f, A_log, dt_bias, lower_bound=-5.0, output_dtype=F64)  # fp32 inside
    torch.testing.assert_close(g, expected, rtol=1e-6, atol=1e-6)
    by_hand = -5.0 / (1 + torch.exp(-A_log.exp()[:, None] * (f + dt_bias.view(3, 16))))
    torch.testing.assert_close(g, by_hand, rtol=1e-14, atol=1e-14)
    assert g.min() >= -5 and g.max() <= 0  # (saturated at the ends in floating point)
    _, _, plain = normalize_and_gate(q, q, f, A_log, dt_bias, backend="torch")
    assert plain.min() < -5  # Kimi Linear's gate has no such bound


@pytest.mark.parametrize("lower_bound", [-5.0, -0.5])
def test_fused_triton_gate_forward_and_backward(lower_bound):
    """The Triton kernel (interpreted, fp32) against the PyTorch gate in fp64: g and the gradients of f, A_log
    and dt_bias."""
    outputs = []
    for backend, dtype in (("torch", F64), ("triton", torch.float32)):
        leaves = [t.requires_grad_() for t in _gate_inputs(dtype)]
        q = torch.randn(2, 5, 3, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
        _, _, g = normalize_and_gate(q, q, *leaves, backend=backend, lower_bound=lower_bound)
        cot = torch.randn(g.shape, dtype=F64, generator=torch.Generator().manual_seed(2)).to(g.dtype)
        outputs.append([g, *torch.autograd.grad((g * cot).sum(), leaves)])
    assert outputs[1][0].dtype == torch.float32
    for name, ours, ref in zip(["g", "df", "dA_log", "ddt_bias"], outputs[1], outputs[0]):
        scale = ref.abs().max().item()
        assert (ours.double() - ref).abs().max().item() < 1e-5 * scale, name


def _mlx_twin(ours: KDA, cfg):
    import mlx.core as mx

    from mlx_lm.models.kimi_k3 import KimiK3DeltaAttention, TextArgs

    args = TextArgs.from_dict(dict(
        hidden_size=cfg.d_model, rms_norm_eps=cfg.norm_eps,
        linear_attn_config=dict(num_heads=cfg.kda.num_heads, head_dim=cfg.kda.head_dim,
                                short_conv_kernel_size=cfg.conv_size,
                                gate_lower_bound=cfg.kda.gate_lower_bound,
                                use_full_rank_gate=cfg.kda.full_rank_gate)))
    theirs = KimiK3DeltaAttention(args, 0)
    w = {k: v.detach().numpy() for k, v in ours.state_dict().items()}
    conv = [np.moveaxis(w[f"{p}_conv.weight"], 2, 1) for p in "qkv"]  # mlx's Conv1d: [C, kernel, 1]
    pairs = {"qkv_proj.weight": np.concatenate([w[f"{p}_proj.weight"] for p in "qkv"]),
             "qkv_conv.conv.weight": np.concatenate(conv), "f_a_proj.weight": w["f_proj_down.weight"],
             "f_b_proj.weight": w["f_proj_up.weight"], "b_proj.weight": w["b_proj.weight"],
             "A_log": w["A_log"], "dt_bias": w["dt_bias"], "o_norm.weight": w["o_norm.weight"],
             "o_proj.weight": w["o_proj.weight"]}
    if cfg.kda.full_rank_gate:
        pairs["g_proj.weight"] = w["g_proj.weight"]
    else:
        pairs.update({"g_a_proj.weight": w["g_proj_down.weight"], "g_b_proj.weight": w["g_proj_up.weight"]})
    theirs.load_weights([(k, mx.array(v)) for k, v in pairs.items()])
    return theirs


@pytest.mark.parametrize("lower_bound,full_rank", [(-5.0, True), (-5.0, False), (None, True)])
def test_layer_equals_mlx_lm_kimi_k3_kda(lower_bound, full_rank):
    import mlx.core as mx

    cfg = tiny_model_cfg(kda=dict(gate_lower_bound=lower_bound, full_rank_gate=full_rank, gate_bias=False,
                                  backend="torch"))
    torch.manual_seed(0)
    ours = KDA(cfg)
    ours.init_weights(0.3, 0.3)  # large enough that gates and norms act
    x = torch.randn(2, 70, cfg.d_model, generator=torch.Generator().manual_seed(1))  # more than one chunk
    expected = torch.from_numpy(np.array(_mlx_twin(ours, cfg)(mx.array(x.numpy()))))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


def test_config_rules_and_kimi_linear_export():
    with pytest.raises(ConfigError, match=r"^model.kda.gate_lower_bound=5.0 is invalid: must be negative"):
        validate_model(tiny_model_cfg(kda=dict(gate_lower_bound=5.0)))
    cfg = tiny_model_cfg(kda=dict(gate_lower_bound=-5.0, gate_bias=False), residual="standard", vocab_size=64)
    with pytest.raises(NotExpressible, match=r"cannot express Kimi K3's KDA"):
        hf_config(cfg)
    assert "g_proj" in KDA(tiny_model_cfg(kda=dict(full_rank_gate=True))).tp_plan().colwise


@pytest.mark.parametrize("T,chunk", [(200, 64), (37, 16), (70, 32)])
def test_bounded_chunk_path_is_exact_under_the_safe_gate(T, chunk):
    """Under the safe gate (every g >= -5) the PyTorch chunk path's diagonal blocks are 16-token anchored
    matmuls: equal to the naive recurrence in fp64 (to rounding) and to the general path in fp32, with gates
    at the bound (a 16-token block falls by almost 80 nats, e^80 of the fp32 range e^88), packed documents and
    an initial state; its gradients equal the general path's."""
    from kimi.ops.kda import chunk_kda, naive_recurrent_kda

    gen = torch.Generator().manual_seed(T)
    B, H, K, V = 1, 2, 16, 8
    q, k = (torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
            for _ in range(2))
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    g = -5 * torch.sigmoid(6 + torch.randn(B, T, H, K, generator=gen, dtype=F64))  # nearly -5 everywhere
    beta = torch.rand(B, T, H, generator=gen, dtype=F64)
    h0 = torch.randn(2, H, K, V, generator=gen, dtype=F64)
    cu = torch.tensor([0, T // 3, T])
    from kimi.ops.kda.chunk import chunk_kda_torch

    docs = list(zip(cu[:-1].tolist(), cu[1:].tolist()))
    for i, (a, b) in enumerate(docs):
        part = [x[:, a:b] for x in (q, k, v, g, beta)]
        want = naive_recurrent_kda(*part, K ** -0.5, h0[i:i + 1])
        got = chunk_kda_torch(*part, K ** -0.5, h0[i:i + 1], chunk_size=chunk, lower_bound=-5.0)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)
    # through the public op (chunk 64, documents packed): the bound reaches the PyTorch path
    want = torch.cat([naive_recurrent_kda(*(x[:, a:b] for x in (q, k, v, g, beta)), K ** -0.5, h0[i:i + 1])[0]
                      for i, (a, b) in enumerate(docs)], dim=1)
    got, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, backend="chunk", lower_bound=-5.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    inputs = [x.float().requires_grad_() for x in (q, k, v, g, beta)]
    outs = [chunk_kda(*inputs, cu_seqlens=cu, backend="chunk", lower_bound=lb)[0] for lb in (None, -5.0)]
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-6)
    grads = [torch.autograd.grad(o.square().sum(), inputs) for o in outs]
    for bounded, general in zip(*grads):
        torch.testing.assert_close(bounded, general, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bounded_triton_kernels_match_the_reference(dtype, monkeypatch):
    """The Triton score kernels' bounded form under the safe gate (forward and backward, the diagonal
    sub-chunk blocks as anchored matmuls, run by the interpreter): output, state and every gradient against
    the fp64 recurrence, with gates at the bound (a sub-chunk falls by almost 80 nats), two packed documents
    (a short last chunk, padded rows) and a masked key tail (K = 24). Both dtypes meet the general form's
    bounds: in bf16 that holds only because the diagonal products stay fp32 (bf16 operands there put dg 40%
    off, where the general form is within 1%)."""
    pytest.importorskip("triton", reason="triton is a dependency on Linux only")
    from test_kda_ops import make_inputs
    from test_kda_triton import assert_close_to_naive

    from kimi.ops.kda.triton import chunk_bwd, chunk_fwd

    seen = []
    for module, name in ((chunk_fwd, "scores_kernel"), (chunk_bwd, "scores_bwd_kernel")):
        kernel = getattr(module, name)

        class Spy:  # records the BOUNDED constexpr each launch gets (passed by position)
            def __getitem__(self, grid, kernel=kernel, name=name):
                def launch(*args, **kwargs):
                    seen.append((name, args[kernel.arg_names.index("BOUNDED")]))
                    return kernel[grid](*args, **kwargs)
                return launch
        monkeypatch.setattr(module, name, Spy())
    q, k, v, _, beta, h0 = make_inputs(1, 70, 2, 24, 16, seed=5)
    h0 = torch.cat([h0, -h0])
    g = -5 * torch.sigmoid(6 + torch.randn(q.shape, generator=torch.Generator().manual_seed(0), dtype=F64))
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    assert_close_to_naive([q, k, v, g, beta, h0], dtype, bound, cu_seqlens=cu, lower_bound=-5.0,
                          grad_bounds={"g": 5e-5} if dtype == torch.float32 else None)
    assert {b for _, b in seen} == {True} and {n for n, _ in seen} == {"scores_kernel", "scores_bwd_kernel"}
