"""Numerical kernels of the model, each beside its pure-PyTorch reference."""

from __future__ import annotations

import torch


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast casts matmuls to on this device type, or None where it is off: for ops autocast does
    not cover (torch._grouped_mm, our own autograd functions), which must cast themselves."""
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


# What an op's launcher allocates beyond its outputs and frees before it returns (its scratch), by op
# overload: bytes(*args). A fake implementation makes the outputs only; kimi.plan.activations adds these to
# its traces. Registered by the modules that define the ops (kimi.ops.kda.triton.op).
SCRATCH: dict = {}

# importing the formulas registers them: torch's flop counter learns the aten ops it counts as 0 (the experts'
# grouped GEMM, CPU attention, triangular solves)
from .flops import ATEN_FORMULAS  # noqa: E402,F401
