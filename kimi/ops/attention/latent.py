"""MLA attention over a long prefix of latents, one key block at a time: no rank holds the whole prefix's
up-projected keys and values.

    latent_attention(q, c, r, w, nope, block, scale, return_max_logits=False, deterministic=None)
        -> o [B, Tq, H, Dv], or (o, max_logits [B, H] fp32)

q [B, Tq, H, nope + rope]: the queries, the last Tq positions of the prefix; c [B, Tk, R]: the normalised
latents of the whole prefix; r [B, Tk, rope]: its shared (rotated) key part; w [H * (nope + Dv), R]: MLA's
up-projection (wkv_b), so that block j's keys are [(c_j w^T)_h[:nope] | r_j] and its
values (c_j w^T)_h[nope:]. Tk is a multiple of block = Tq: every block but the last lies wholly before the
queries (no mask), the last is the queries' own (causal). This is context parallelism's MLA
(kimi.parallel.context_parallel): the last rank's prefix is the whole sequence, and up-projecting it at once
costs (nope + rope + Dv) values per head and token of the sequence, 35 KiB per token for `1b`
(docs/parallelism.md), where the latent is R + rope.

The forward runs the Triton flash kernel per block and merges the blocks' outputs by their log-sum-exps (the
online softmax one level up), keeping no block's keys or values. The backward is FlashAttention's over each
block again, with the merged output and log-sum-exp (P = exp(S - LSE) is then the whole softmax's), and
projects each block's dK, dV back onto its latents and w by hand: no autograd graph inside, so it runs as
one custom autograd function with one block's keys and values alive at a time. Triton only: the kernels run
on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch


def _up(c: torch.Tensor, r: torch.Tensor, w: torch.Tensor, heads: int, nope: int, dtype: torch.dtype):
    """One block's keys [B, T, H, nope + rope] and values [B, T, H, Dv] from its latents, in the queries'
    dtype (as autocast would give them in the forward; the backward, which runs without autocast, matches)."""
    B, T, _ = c.shape
    kv = c.to(dtype) @ w.to(dtype).T
    k_nope, v = kv.view(B, T, heads, -1).split([nope, w.shape[0] // heads - nope], dim=-1)
    k = torch.cat([k_nope, r.to(dtype).unsqueeze(2).expand(-1, -1, heads, -1)], dim=-1)
    return k, v.contiguous()


def _blocks(c, r, block):
    n = c.shape[1] // block
    return [(j, j == n - 1, c[:, j * block:(j + 1) * block], r[:, j * block:(j + 1) * block])
            for j in range(n)]


class _LatentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, c, r, w, nope: int, block: int, scale: float, measure: bool, atomic: bool):
        from .triton.op import flash_attention_op

        H = q.shape[2]
        o_acc = lse_acc = m_acc = None
        for _, last, c_j, r_j in _blocks(c, r, block):
            k, v = _up(c_j, r_j, w, H, nope, q.dtype)
            o, lse, m = flash_attention_op(q, k, v, None, scale, last, measure, atomic)
            if o_acc is None:
                o_acc, lse_acc, m_acc = o.float(), lse, m
                continue
            new = torch.logaddexp(lse_acc, lse)  # [B, H, Tq]; every row sees keys in the first block
            o_acc = (o_acc * (lse_acc - new).exp().transpose(1, 2)[..., None]
                     + o.float() * (lse - new).exp().transpose(1, 2)[..., None])
            lse_acc = new
            m_acc = torch.maximum(m_acc, m) if measure else m_acc
        o = o_acc.to(q.dtype)
        ctx.save_for_backward(q, c, r, w, o, lse_acc)
        ctx.nope, ctx.block, ctx.scale, ctx.atomic = nope, block, scale, atomic
        ctx.mark_non_differentiable(m_acc)
        return o, m_acc

    @staticmethod
    def backward(ctx, do, _dm):
        from .triton.op import flash_attention_backward_op

        q, c, r, w, o, lse = ctx.saved_tensors
        H, nope = q.shape[2], ctx.nope
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dc, dr, dw = torch.zeros_like(c, dtype=torch.float32), torch.zeros_like(r, dtype=torch.float32), None
        for j, last, c_j, r_j in _blocks(c, r, ctx.block):
            k, v = _up(c_j, r_j, w, H, nope, q.dtype)
            dq_j, dk, dv = flash_attention_backward_op(do.contiguous(), None, q, k, v, o, lse, None,
                                                       ctx.scale, last, ctx.atomic)
            dq += dq_j.float()
            B, T = c_j.shape[:2]
            dkv = torch.cat([dk[..., :nope], dv], dim=-1).reshape(B * T, -1).float()  # d (c_j w^T)
            rows = slice(j * ctx.block, (j + 1) * ctx.block)
            dc[:, rows] = (dkv @ w.float()).view(B, T, -1)
            dr[:, rows] = dk[..., nope:].float().sum(dim=2)
            dw_j = dkv.T @ c_j.reshape(B * T, -1).float()
            dw = dw_j if dw is None else dw + dw_j
        return (dq.to(q.dtype), dc.to(c.dtype), dr.to(r.dtype), dw.to(w.dtype), None, None, None, None, None)


def latent_attention(q, c, r, w, nope: int, block: int, scale: float | None = None,
                     return_max_logits: bool = False, deterministic: bool | None = None):
    """deterministic: the Triton backward's dQ mode, as attention()'s."""
    from .triton import common
    from .triton.common import check_device

    check_device(q, c, r, w)
    if c.shape[1] % block or q.shape[1] != block:
        raise ValueError(f"latent_attention: {c.shape[1]} key positions in blocks of {block} need queries of "
                         f"one block, got {q.shape[1]}")
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    atomic = common.DQ_ATOMIC if deterministic is None else not deterministic
    o, m = _LatentAttention.apply(q, c, r, w, nope, block, float(scale), bool(return_max_logits),
                                  bool(atomic))
    return (o, m) if return_max_logits else o
