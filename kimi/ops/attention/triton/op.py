"""The kernels as torch custom ops with autograd, so torch.compile traces them as single opaque nodes
(no graph break) and autograd calls the Triton backward.

    kimi::flash_attention(q, k, v, cu_seqlens, scale, causal, return_max_logits, atomic_dq)
        -> (o, lse, max_logits)
    kimi::attention_max_logits(q, k, cu_seqlens, scale, causal) -> max_logits [B, H]

LSE is differentiable (its gradient folds into delta); max_logits is a statistic for QK-Clip and is marked
non-differentiable. atomic_dq is the backward's dQ mode (kimi/ops/attention/triton/common.py), fixed at the
forward so a recomputed forward and its backward agree. attention_max_logits is the forward kernel reduced
to its row maxima (no softmax, no V): the max-logit pass of the SDPA path.
"""

from __future__ import annotations

import torch

from kimi.ops.flops import register_attention_ops

from .backward import attention_backward
from .forward import attention_forward, attention_max_logits


@torch.library.custom_op("kimi::flash_attention", mutates_args=())
def flash_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float,
    causal: bool, return_max_logits: bool, atomic_dq: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, cu_seqlens, scale, causal, return_max_logits)


@flash_attention_op.register_fake
def _(q, k, v, cu_seqlens, scale, causal, return_max_logits, atomic_dq):
    B, Tq, H, _ = q.shape
    o = q.new_empty(B, Tq, H, v.shape[-1])
    lse = q.new_empty(B, H, Tq, dtype=torch.float32)
    max_logits = q.new_empty((B, H) if return_max_logits else (0,), dtype=torch.float32)
    return o, lse, max_logits


@torch.library.custom_op("kimi::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    o: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, causal: bool,
    atomic_dq: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(do, dlse, q, k, v, o, lse, cu_seqlens, scale, causal, atomic_dq)


@flash_attention_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens, scale, causal, atomic_dq):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale, causal, _, atomic_dq = inputs
    o, lse, max_logits = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.scale, ctx.causal, ctx.atomic_dq = scale, causal, atomic_dq
    ctx.mark_non_differentiable(max_logits)


def _backward(ctx, do, dlse, _dmax):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else do
    dq, dk, dv = flash_attention_backward_op(do, dlse, q, k, v, o, lse, cu_seqlens, ctx.scale, ctx.causal,
                                             ctx.atomic_dq)
    return dq, dk, dv, None, None, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("kimi::attention_max_logits", mutates_args=())
def attention_max_logits_op(
    q: torch.Tensor, k: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, causal: bool,
) -> torch.Tensor:
    return attention_max_logits(q, k, cu_seqlens, scale, causal)


@attention_max_logits_op.register_fake
def _(q, k, cu_seqlens, scale, causal):
    return q.new_empty(q.shape[0], q.shape[2], dtype=torch.float32)


register_attention_ops()  # FlopCounterMode counts them as the model declares them (kimi/ops/flops.py)
