"""Kimi K3's Quantile Balancing (model.moe.balance=quantile): the histogram's quantile is the exact quantile
of the required biases within one bin, a few updates balance a skewed router's loads (where the sign step
moves by its rate only), the biases are mean-centred, only training forwards count, and the config's
rules. The distributed sums are tested with the parallel layouts (tests/parallel/test_parallel.py,
moe_qb_*)."""

import pytest
import torch

from helpers import tiny_model_cfg
from kimi.config import ConfigError
from kimi.model.moe import (MoE, histogram_quantile, qb_range, required_bias_histogram, route,
                            update_expert_bias)
from kimi.model.rules import validate_model

pytestmark = pytest.mark.unit


def _skewed_scores(N=4000, E=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, E, generator=gen) + torch.linspace(-2, 2, E)  # later experts win far more often
    return logits.sigmoid()


def test_histogram_quantile_is_the_exact_quantile_within_one_bin():
    scores, k, bins = _skewed_scores(), 4, 1000
    bias = torch.linspace(-0.3, 0.2, 16)
    hist = torch.zeros(16, bins)
    required_bias_histogram(scores, bias, k, hist)
    assert hist.sum() == scores.numel()  # every (token, expert) pair binned once, none clamped away
    cutoff = (scores + bias).topk(k + 1, dim=-1).values[:, -1:]
    required = cutoff - scores
    lo, width = qb_range(bias, bins)
    ours = histogram_quantile(hist, lo, width, k / 16)
    exact = torch.quantile(required.double(), k / 16, dim=0).float()
    assert (ours - exact).abs().max() <= width


def _moe(balance, E=16, k=4):
    cfg = tiny_model_cfg(d_model=32, moe=dict(num_experts=E, top_k=k, hidden=16, shared_experts=0,
                                              first_dense=1, balance=balance, bias_rate=1e-3))
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        moe.router.weight.normal_(0, 0.3)
        moe.router.weight[-4:] += 0.5  # four experts the router favours
        for p in moe.experts.parameters():
            p.normal_(0, 0.1)
    return moe


def _imbalance(moe, x):
    _, experts, _ = route(x, moe.router.weight, moe.expert_bias, moe.top_k, 1, 1, True, 1.0)
    load = torch.bincount(experts.flatten(), minlength=moe.num_experts).float()
    return (load.max() / load.mean()).item()


def test_updates_balance_a_skewed_router_far_faster_than_the_sign_step():
    """Five steps on one batch: QB's quantiles take max/mean load from 3.8 to about 1.3 (the report's cutoff,
    the (k+1)-th biased score, is each selected expert's exact threshold and a lower one for the others, so
    the fixed point is near balance, not at it); the sign step, at a 100x larger rate than DeepSeek-V3's,
    has moved each bias by 0.05 and is still above 2.5."""
    x = torch.randn(4096, 32, generator=torch.Generator().manual_seed(1)) + 0.5
    results = {}
    for balance in ("sign", "quantile"):
        moe = _moe(balance)
        seen = [_imbalance(moe, x)]
        for _ in range(5):
            moe(x)  # a training forward: counts the loads (and the histogram)
            update_expert_bias(moe, rate=1e-2)
            seen.append(_imbalance(moe, x))
        results[balance] = (seen, moe.expert_bias.clone())
    seen, bias = results["quantile"]
    assert seen[0] > 3.5 and seen[1] < 2.0 and seen[-1] < 1.4, seen
    assert abs(bias.mean().item()) < 1e-6  # mean-centred
    assert results["sign"][0][-1] > 2.5 and results["sign"][1].abs().max() <= 0.05 + 1e-6, results["sign"]
    moe = _moe("quantile")
    with torch.no_grad():
        moe(x)  # evaluation counts nothing
    assert moe.qb_hist.sum() == 0


def test_rules():
    with pytest.raises(ConfigError,
                       match=r"^model.moe.groups=2 is invalid: must be 1 with model.moe.balance="):
        validate_model(tiny_model_cfg(moe=dict(num_experts=8, top_k=2, groups=2, balance="quantile")))
    with pytest.raises(ConfigError, match=r"^model.moe.top_k=8 is invalid: must be < model.moe.num_experts"):
        validate_model(tiny_model_cfg(moe=dict(num_experts=8, top_k=8, balance="quantile")))
