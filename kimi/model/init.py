"""Initialisation as data: each layer lists, per parameter name, how to fill it (``init_rules``), so the
same values can be produced for a whole tensor on one device or for the full tensor behind any shard.

A rule is ``fill(tensor, generator)``; ``generator`` None draws from torch's global generator. The model
seeds one generator per parameter from its name (``param_seed``), which makes every parameter's value
independent of the order of initialisation and of which other parameters a rank holds.
"""

from __future__ import annotations

import hashlib
import math
from typing import Callable, Dict

import torch
from torch import nn

Fill = Callable[[torch.Tensor, "torch.Generator | None"], object]
Rules = Dict[str, Fill]


def normal(std: float) -> Fill:
    return lambda t, g: nn.init.normal_(t, std=std, generator=g)


def uniform(low: float, high: float) -> Fill:
    return lambda t, g: nn.init.uniform_(t, low, high, generator=g)


def constant(value: float) -> Fill:
    return lambda t, g: nn.init.constant_(t, value)


def log_uniform_decay(t: torch.Tensor, g: torch.Generator | None) -> None:
    """A_log = log U(1, 16): decay rates exp(A_log) spread over [1, 16], so heads start with different
    memory lengths."""
    t.copy_(torch.empty_like(t).uniform_(1, 16, generator=g).log())


def dt_bias(t: torch.Tensor, g: torch.Generator | None) -> None:
    """Mamba's dt init: softplus(dt_bias) = dt ~ logU(1e-3, 1e-1), i.e. dt_bias = dt + log(1 - exp(-dt))."""
    dt = torch.empty_like(t).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
    t.copy_(dt + torch.log(-torch.expm1(-dt)))


def prefixed(prefix: str, rules: Rules) -> Rules:
    return {f"{prefix}.{name}": fill for name, fill in rules.items()}


@torch.no_grad()
def apply_rules(module: nn.Module, rules: Rules, generator: torch.Generator | None = None) -> None:
    """Fill every parameter of `module` named in `rules` (names relative to the module)."""
    params = dict(module.named_parameters())
    for name, fill in rules.items():
        fill(params[name], generator)


def param_seed(base: int, name: str) -> int:
    """A 63-bit seed from a base seed and a parameter name, stable across processes and machines."""
    digest = hashlib.sha256(f"{base}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)
