"""Mixture of experts (kimi/model/moe.py): the router and the whole layer equal transformers' Kimi Linear MoE
(an independent definition), the grouped expert computation equals the per-expert loop, and the
aux-loss-free bias update balances the load."""

import pytest
import torch

from helpers import tiny_model_cfg
from kimi.config import ConfigError
from kimi.model.rules import validate_model
from kimi.model.moe import MoE, experts_grouped, experts_loop, route, update_expert_bias
from kimi.model.transformer import KimiModel

pytestmark = pytest.mark.unit

F64 = torch.float64


def moe_cfg(moe=None, **overrides):
    """tiny_model_cfg with 8 experts; `moe` adds to (or changes) these MoE keys."""
    base = dict(num_experts=8, top_k=2, hidden=16, shared_experts=1, groups=4, topk_groups=2,
                routed_scale=2.5, first_dense=1)
    return tiny_model_cfg(**{"d_model": 32, **overrides, "moe": {**base, **(moe or {})}})


def filled_moe(cfg, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    moe = MoE(cfg).to(dtype)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        moe.expert_bias.copy_(torch.linspace(-0.2, 0.3, cfg.moe.num_experts).to(dtype))
    return moe


def hf_moe(cfg, ours: MoE):
    """transformers' KimiLinearMoE with our layer's weights (its fused gate_up is our w_gate over w_up)."""
    hf = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear",
                             reason="transformers (dev extra) not installed")
    from transformers.models.kimi_linear.configuration_kimi_linear import KimiLinearConfig

    config = KimiLinearConfig(hidden_size=cfg.d_model, moe_intermediate_size=cfg.moe.hidden,
                              num_local_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
                              n_group=cfg.moe.groups, topk_group=cfg.moe.topk_groups,
                              routed_scaling_factor=cfg.moe.routed_scale,
                              n_shared_experts=cfg.moe.shared_experts, norm_topk_prob=cfg.moe.norm_topk,
                              num_hidden_layers=2, vocab_size=64)
    theirs = hf.KimiLinearMoE(config).to(ours.router.weight.dtype)
    with torch.no_grad():
        theirs.gate.weight.copy_(ours.router.weight)
        theirs.gate.e_score_correction_bias.copy_(ours.expert_bias)
        theirs.experts.gate_up_proj.copy_(torch.cat([ours.experts.w_gate, ours.experts.w_up], dim=1))
        theirs.experts.down_proj.copy_(ours.experts.w_down)
        for name in ("gate", "up", "down"):
            theirs_proj = getattr(theirs.shared_experts, f"{name}_proj")
            theirs_proj.weight.copy_(getattr(ours.shared, f"w_{name}").weight)
    return theirs


@pytest.mark.parametrize("groups,topk_groups,norm", [(4, 2, True), (1, 1, True), (2, 1, False)])
def test_layer_equals_transformers_kimi_linear_moe(groups, topk_groups, norm):
    cfg = moe_cfg(moe=dict(groups=groups, topk_groups=topk_groups, norm_topk=norm))
    ours = filled_moe(cfg)
    theirs = hf_moe(cfg, ours)
    x = torch.randn(3, 11, cfg.d_model, generator=torch.Generator().manual_seed(1))
    _, w_ref, e_ref = theirs.gate(x)
    w, e, _ = route(x.view(-1, cfg.d_model), ours.router.weight, ours.expert_bias, cfg.moe.top_k, groups,
                    topk_groups, norm, cfg.moe.routed_scale)
    # the same experts (topk's order may differ) with the same weights
    order, order_ref = e.argsort(dim=1), e_ref.argsort(dim=1)
    assert torch.equal(e.gather(1, order), e_ref.gather(1, order_ref))
    torch.testing.assert_close(w.gather(1, order), w_ref.gather(1, order_ref), rtol=1e-6, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x), rtol=1e-5, atol=1e-6)


def test_bias_steers_the_choice_not_the_weights():
    """A large bias on one expert makes every token choose it, with its unbiased score as weight."""
    cfg = moe_cfg(moe=dict(groups=1, topk_groups=1, norm_topk=False, routed_scale=1.0))
    moe = filled_moe(cfg)
    x = torch.randn(20, cfg.d_model)
    bias = torch.zeros(cfg.moe.num_experts)
    bias[5] = 10.0
    w, e, scores = route(x, moe.router.weight, bias, 2, 1, 1, False, 1.0)
    assert (e == 5).any(dim=1).all()
    torch.testing.assert_close(w, scores.gather(1, e))


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_grouped_equals_loop_forward_and_backward(dtype):
    """fp32 runs torch._grouped_mm, fp64 the per-expert matmuls on sorted rows; both equal the loop,
    including an expert no token chose."""
    cfg = moe_cfg()
    moe = filled_moe(cfg, dtype)
    x = torch.randn(40, cfg.d_model, dtype=dtype, generator=torch.Generator().manual_seed(2))
    w, e, _ = route(x, moe.router.weight, moe.expert_bias, 2, 4, 2, True, 2.5)
    e = torch.where(e == 3, torch.full_like(e, 4), e)  # expert 3 gets no token
    weights = [moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down]
    results = []
    for fn in (experts_grouped, experts_loop):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xs, e, ws, *weights)
        cot = torch.randn(y.shape, dtype=dtype, generator=torch.Generator().manual_seed(3))
        results.append([y, *torch.autograd.grad((y * cot).sum(), [xs, ws, *weights])])
    tol = 1e-12 if dtype == F64 else 1e-5
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert results[0][4][3].abs().sum() == 0  # no gradient for the unused expert


def test_bias_update_balances_and_resets():
    cfg = moe_cfg(moe=dict(groups=1, topk_groups=1))
    model = KimiModel(moe_cfg(moe=dict(groups=1, topk_groups=1), num_layers=3, vocab_size=61))
    layers = [b.mlp for b in model.blocks.values() if isinstance(b.mlp, MoE)]
    assert len(layers) == 2  # block 0 stays dense
    tokens = torch.randint(0, 61, (2, 16))
    model(tokens).sum().backward()
    loads = [m.load.clone() for m in layers]
    assert all(load.sum() == 2 * 16 * cfg.moe.top_k for load in loads)
    with torch.no_grad():
        model(tokens)  # evaluation does not count
    assert all(torch.equal(m.load, load) for m, load in zip(layers, loads))
    stats = update_expert_bias(model, rate=0.01)
    for m, load in zip(layers, loads):
        expected = 0.01 * torch.sign(load.mean() - load)
        torch.testing.assert_close(m.expert_bias, expected)
        assert m.load.sum() == 0
    assert stats["moe_imbalance"] == pytest.approx(max(float(ld.max() / ld.mean()) for ld in loads))
    assert any(k.endswith("mlp.expert_bias") for k in model.state_dict())  # saved in checkpoints
    assert not any(k.endswith("mlp.load") for k in model.state_dict())


def test_bias_update_makes_an_overloaded_expert_lose_tokens():
    """Tokens all prefer expert 0; repeated updates lower its bias until other experts take tokens."""
    cfg = moe_cfg(moe=dict(groups=1, topk_groups=1, top_k=1, shared_experts=0))
    moe = filled_moe(cfg)
    with torch.no_grad():
        moe.expert_bias.zero_()
        moe.router.weight.zero_()
        moe.router.weight[0] += 0.05  # every token's top score
    x = torch.randn(64, cfg.d_model).abs()
    holder = torch.nn.Sequential(moe)
    first = None
    for _ in range(200):
        moe(x.requires_grad_())
        share = moe.load[0] / moe.load.sum()
        first = share if first is None else first
        update_expert_bias(holder, rate=0.01)
    assert first == 1.0 and share < 0.5


def test_validation_names_the_key():
    cases = [(dict(groups=3), "model.moe.groups"), (dict(top_k=9), "model.moe.top_k"),
             (dict(topk_groups=5), "model.moe.topk_groups"),
             (dict(aux_loss_coef=-1.0), "model.moe.aux_loss_coef"),
             (dict(num_experts=1, groups=1, topk_groups=1), "model.moe.num_experts")]
    for overrides, key in cases:
        with pytest.raises(ConfigError, match=key):
            validate_model(moe_cfg(moe=overrides))


def test_sequence_balance_loss_matches_its_definition():
    """DeepSeek-V3 eq. 17-20, literally, one sequence and one expert at a time."""
    from kimi.model.moe import sequence_balance_loss

    gen = torch.Generator().manual_seed(4)
    B, T, E, k = 3, 10, 6, 2
    scores = torch.rand(B, T, E, generator=gen, dtype=F64)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(B * T)]).view(B, T, k)
    total = 0.0
    for b in range(B):
        for e in range(E):
            f = E / (k * T) * sum(int(e in experts[b, t].tolist()) for t in range(T))
            P = sum(float(scores[b, t, e] / scores[b, t].sum()) for t in range(T)) / T
            total += f * P
    assert float(sequence_balance_loss(scores, experts, k)) == pytest.approx(total / B, rel=1e-12)


def test_aux_loss_enters_the_gradient_not_the_output():
    """With model.moe.aux_loss_coef = c the layer's output is unchanged, and every gradient equals that of
    loss + c * scale * aux computed explicitly."""
    from kimi.model.moe import sequence_balance_loss

    c, scale = 0.3, 0.5
    cfg = moe_cfg(moe=dict(aux_loss_coef=c))
    with_aux = filled_moe(cfg, F64)
    with_aux.aux_grad_scale = scale
    plain = filled_moe(moe_cfg(moe=dict(aux_loss_coef=0.0)), F64)
    x = torch.randn(2, 9, cfg.d_model, dtype=F64, generator=torch.Generator().manual_seed(5))
    cot = torch.randn(2, 9, cfg.d_model, dtype=F64, generator=torch.Generator().manual_seed(6))
    y = with_aux(x)
    grads = torch.autograd.grad((y * cot).sum(), list(with_aux.parameters()))
    y_ref = plain(x)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    _, experts, scores = route(x.view(-1, cfg.d_model), plain.router.weight, plain.expert_bias,
                               cfg.moe.top_k, cfg.moe.groups, cfg.moe.topk_groups, cfg.moe.norm_topk,
                               cfg.moe.routed_scale)
    aux = sequence_balance_loss(scores.view(2, 9, -1), experts.view(2, 9, -1), cfg.moe.top_k)
    grads_ref = torch.autograd.grad((y_ref * cot).sum() + c * scale * aux, list(plain.parameters()))
    for a, b in zip(grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert float(with_aux.aux_loss) == pytest.approx(aux.item())
    router = dict(zip((n for n, _ in with_aux.named_parameters()), grads))["router.weight"]
    no_aux = torch.autograd.grad((plain(x) * cot).sum(), plain.router.weight)[0]
    assert not torch.allclose(router, no_aux)  # the router's gradient includes the auxiliary term


def test_packed_rows_keep_a_per_row_sequence_loss():
    """With packed documents (data.varlen) the model runs its B rows as one row [1, B*T]; the sequence-wise
    loss must still be per batch row, or it would change with how rows are grouped into micro-batches (and
    so with the parallel layout): packed and unpacked runs of the same rows record the same loss."""
    from kimi.model.moe import moe_layers

    cfg = moe_cfg(moe=dict(aux_loss_coef=0.1), num_layers=2, vocab_size=61)
    torch.manual_seed(0)
    model = KimiModel(cfg)
    model.init_weights()
    ids = torch.randint(0, 61, (3, 12), generator=torch.Generator().manual_seed(1))
    starts = torch.zeros(3, 12, dtype=torch.bool)
    starts[:, 0] = True  # one document per row: packing changes nothing else
    model(ids)
    unpacked = [float(m.aux_loss) for m in moe_layers(model)]
    model(ids, doc_starts=starts)
    packed = [float(m.aux_loss) for m in moe_layers(model)]
    assert packed == pytest.approx(unpacked, rel=1e-6) and len(packed) == 1


@pytest.mark.slow
def test_layer_compiles_on_cpu_fp32():
    """Under torch.compile the grouped GEMM's fake kernel takes only bf16: fp32 on CPU (tests, CPU
    training with parallel.compile=true) takes the per-expert matmuls, with the same result."""
    cfg = moe_cfg()
    moe = filled_moe(cfg)
    x = torch.randn(2, 9, cfg.d_model, generator=torch.Generator().manual_seed(7))
    torch._dynamo.reset()
    compiled = torch.compile(moe, backend="aot_eager")
    torch.testing.assert_close(compiled(x), moe(x), rtol=1e-5, atol=1e-6)
