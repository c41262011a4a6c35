"""Kimi K3's per-head Muon (optim.muon_per_head): each head's block of the query, key and value projections
(KDA q/k/v; MLA's query, and W_ukv's keys and values of each head apart) is updated exactly as
torch.optim.Muon updates that block as a parameter of its own; every other Muon matrix as before. The
per-block split keeps one Newton-Schulz per block on one owner in every layout: the layout tests run it
(tests/parallel/test_parallel.py)."""

import pytest
import torch
from helpers import tiny_model_cfg

from kimi.config import OptimConfig
from kimi.model.transformer import KimiModel
from kimi.optim import build_optimizer

pytestmark = pytest.mark.unit


def _blocks(name: str, w: torch.Tensor, cfg) -> list:
    """The per-head blocks of weight `name` (views of w), or [w] for a matrix updated whole."""
    if name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight")):
        return list(w.view(-1, cfg.kda.head_dim, w.shape[-1]))
    if name.endswith((".wq.weight", ".wq_b.weight")):
        return list(w.view(-1, cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim, w.shape[-1]))
    if name.endswith(".wkv_b.weight"):
        heads = w.view(-1, cfg.mla.qk_nope_head_dim + cfg.mla.v_head_dim, w.shape[-1])
        return [h[:cfg.mla.qk_nope_head_dim] for h in heads] + [h[cfg.mla.qk_nope_head_dim:] for h in heads]
    return [w]


@pytest.mark.parametrize("q_lora", [0, 16])
def test_each_head_block_is_updated_as_torch_muon_updates_it_alone(q_lora):
    cfg = tiny_model_cfg(mla=dict(q_lora_rank=q_lora, qk_rope_head_dim=8))
    model = KimiModel(cfg)
    opt = build_optimizer(model, OptimConfig(name="muonclip", lr=0.02, ns_dtype="bf16", muon_per_head=True,
                                             muon_split_fused=False, qk_clip_tau=0))
    muon = [(n, p) for g in opt.param_groups if g["family"] == "muon"
            for n, p in zip(g["param_names"], g["params"])]
    gen = torch.Generator().manual_seed(3)
    grads = {n: torch.randn(p.shape, generator=gen) for n, p in muon}
    init = {n: p.detach().clone() for n, p in muon}
    theirs, per_head = {}, 0
    for n, p in muon:
        blocks = _blocks(n, p.detach(), cfg)
        grad_blocks = _blocks(n, grads[n], cfg)
        per_head += len(blocks) > 1
        theirs[n] = [(torch.nn.Parameter(b.clone()), gb.clone()) for b, gb in zip(blocks, grad_blocks)]
    ref = torch.optim.Muon([q for blocks in theirs.values() for q, _ in blocks], lr=0.02, weight_decay=0.1,
                           momentum=0.95, nesterov=True, adjust_lr_fn="match_rms_adamw")
    for n, p in muon:
        p.grad = grads[n]
        for q, g in theirs[n]:
            q.grad = g
    opt.step()
    ref.step()
    assert per_head == 3 * 2 + 2  # KDA's q/k/v in the two KDA blocks, MLA's query and W_ukv
    for n, p in muon:
        blocks = zip(_blocks(n, p.detach(), cfg), theirs[n], _blocks(n, init[n], cfg))
        for ours, (expected, _), w0 in blocks:
            # both in bf16 Newton-Schulz; batched with other matrices of its shape, a 2-row matrix (KDA's
            # b_proj) rounds differently by up to 1e-3 of its update, every other block agrees to 1e-5
            tol = 1e-5 if len(theirs[n]) > 1 or min(w0.shape) > 2 else 1e-3
            assert rel(ours - w0, expected.detach() - w0) < tol, n
    q = "blocks.0.mixer.q_proj.weight"  # the whole matrix's update of the same step differs from it
    head0 = theirs[q][0][0].detach() - _blocks(q, init[q], cfg)[0]
    solo = torch.nn.Parameter(init[q].clone())
    solo.grad = grads[q].clone()
    torch.optim.Muon([solo], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                     adjust_lr_fn="match_rms_adamw").step()
    assert rel(_blocks(q, solo.detach(), cfg)[0] - _blocks(q, init[q], cfg)[0], head0) > 0.1


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()
