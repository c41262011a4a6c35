"""Triton flash attention that returns O, LSE and per-(batch, head) max scaled logits in one pass, with a
Triton backward, registered as a torch custom op (``torch.ops.kimi.flash_attention``).

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 set before triton
is imported; dots then run in fp32, since interpreted bf16 dots are wrong). Layouts and masks are those of
:func:`kimi.ops.attention.attention`, which dispatches here.

Knobs (environment, or the attributes of .common at run time): KIMI_ATTENTION_AUTOTUNE=0 uses fixed tiles
on a GPU instead of autotuning; KIMI_ATTENTION_DQ=separate makes the process default for dQ a separate
deterministic kernel instead of fp32 atomics inside the dK/dV kernel (fewer matmuls, about twice as fast on
an H200, not bitwise deterministic); `atomic_dq=` chooses per call.
`python bench/attention.py --compile-check` compiles every kernel for sm_90 without a GPU.
"""

from __future__ import annotations

import torch

from . import common
from .common import INTERPRET, check_device
from .op import attention_max_logits_op, flash_attention_op


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    cu_seqlens: torch.Tensor | None = None, return_max_logits: bool = False, atomic_dq: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (o [B, Tq, H, Dv], lse [B, H, Tq] fp32, max_logits [B, H] fp32; [0] unless return_max_logits).
    atomic_dq: the backward's dQ mode (None: common.DQ_ATOMIC)."""
    check_device(q, k, v)
    atomic_dq = common.DQ_ATOMIC if atomic_dq is None else atomic_dq
    return flash_attention_op(q, k, v, cu_seqlens, float(scale), bool(causal), bool(return_max_logits),
                              bool(atomic_dq))


def max_logits(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float,
               cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The largest scaled logit per (batch, head) [B, H] fp32, from the forward kernel without softmax or
    V."""
    check_device(q, k)
    return attention_max_logits_op(q, k, cu_seqlens, float(scale), bool(causal))


__all__ = ["INTERPRET", "flash_attention", "max_logits"]
