"""What the depth-mix op checks before a launch, and the interpreter switch."""

from __future__ import annotations

import torch

from kimi.ops.dispatch import is_fake
from kimi.ops.triton_interpreter import INTERPRET

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """The per-token statistics' dtype (and the kernels' compute dtype): fp64 for fp64 sources, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_inputs(query: torch.Tensor, sources, norm_weight: torch.Tensor | None) -> None:
    """One-line errors for what the kernels cannot take."""
    if not sources:
        raise ValueError("attnres depth mix: no sources to mix")
    first = sources[0]
    tensors = [query, *sources] + ([] if norm_weight is None else [norm_weight])
    if any(not t.is_cuda and not is_fake(t) for t in tensors) and not INTERPRET:
        raise RuntimeError("model.attnres.backend=triton needs CUDA tensors (on CPU the Triton kernel runs "
                           "only interpreted, with TRITON_INTERPRET=1 set before triton is imported): use "
                           "model.attnres.backend=auto or torch")
    if first.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"attnres depth mix (Triton) takes fp16/bf16/fp32/fp64 sources, got {first.dtype}")
    if any(s.shape != first.shape or s.dtype != first.dtype or s.device != first.device for s in sources):
        raise ValueError("attnres depth mix: every source must have the same shape, dtype and device, got "
                         f"{[(tuple(s.shape), s.dtype) for s in sources]}")
    D = first.shape[-1]
    weight = None if norm_weight is None else tuple(norm_weight.shape)
    if query.shape != (D,) or weight not in (None, (D,)):
        raise ValueError(f"attnres depth mix: the query and the norm weight must be [{D}], got "
                         f"{tuple(query.shape)} and {weight}")
