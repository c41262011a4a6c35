"""The kernels as torch custom ops with autograd, so torch.compile traces them as single opaque nodes
(no graph break) and autograd calls the Triton backward.

    kimi::flash_attention(q, k, v, cu_seqlens, scale, causal, return_max_logits) -> (o, lse, max_logits)

LSE is differentiable (its gradient folds into delta); max_logits is a statistic for QK-Clip and is marked
non-differentiable.
"""

from __future__ import annotations

import torch

from .backward import attention_backward
from .forward import attention_forward


@torch.library.custom_op("kimi::flash_attention", mutates_args=())
def flash_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float,
    causal: bool, return_max_logits: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_forward(q, k, v, cu_seqlens, scale, causal, return_max_logits)


@flash_attention_op.register_fake
def _(q, k, v, cu_seqlens, scale, causal, return_max_logits):
    B, Tq, H, _ = q.shape
    o = q.new_empty(B, Tq, H, v.shape[-1])
    lse = q.new_empty(B, H, Tq, dtype=torch.float32)
    max_logits = q.new_empty((B, H) if return_max_logits else (0,), dtype=torch.float32)
    return o, lse, max_logits


@torch.library.custom_op("kimi::flash_attention_backward", mutates_args=())
def flash_attention_backward_op(
    do: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    o: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor | None, scale: float, causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return attention_backward(do, dlse, q, k, v, o, lse, cu_seqlens, scale, causal)


@flash_attention_backward_op.register_fake
def _(do, dlse, q, k, v, o, lse, cu_seqlens, scale, causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, scale, causal, _ = inputs
    o, lse, max_logits = output
    ctx.save_for_backward(q, k, v, o, lse, cu_seqlens)
    ctx.scale, ctx.causal = scale, causal
    ctx.mark_non_differentiable(max_logits)


def _backward(ctx, do, dlse, _dmax):
    q, k, v, o, lse, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(o) if do is None else do
    dq, dk, dv = flash_attention_backward_op(do, dlse, q, k, v, o, lse, cu_seqlens, ctx.scale, ctx.causal)
    return dq, dk, dv, None, None, None, None


flash_attention_op.register_autograd(_backward, setup_context=_setup_context)
