"""Fused Attention Residuals depth mixes: the softmax over sources and, optionally, the RMSNorm that follows
the mix (the sublayer's pre-norm, with its weight) in one kernel each way (kimi/ops/attnres/triton/).

    FusedDepthMix(backend, fallback)(query, sources, eps)                       -> the mix
    FusedDepthMix(backend, fallback).normed(query, sources, eps, weight, norm_eps) -> its pre-norm's output

A FusedDepthMix is what the residual streams call as their mix function (kimi.model.attnres.depth_mix picks it
for model.attnres.backend triton, fla and auto); `normed` is the form they use when a norm follows. Equal to
the unfused composition (reference.py: kimi.model.attnres.depth_attention, then RMSNorm on the mix rounded
to the sources' dtype) up to the order of fp32 sums; the softmax and scores are fp32 (fp64 for fp64 inputs).

Backends: "triton" forces our kernel (CUDA tensors, or CPU tensors under TRITON_INTERPRET=1); "auto" takes it
for CUDA tensors and `fallback` (the PyTorch mix, eager or compiled) elsewhere; "fla" is fla-core's fused
AttnRes (fla.py). Failures follow kimi.ops.dispatch: with auto a Triton kernel that fails to compile or launch
sends the mix to `fallback` for the rest of the process, with one warning (forward and backward kernels are
probed on one token first when gradients are needed); forced, the failure is a TritonKernelError.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from kimi.ops.dispatch import Guard, auto_picks_triton, needs_grad

from .reference import depth_attention, mix_then_norm

BACKENDS = ("triton", "fla", "auto")
_GUARD = Guard("attnres depth mix", "model.attnres.backend=triton")


def _probe(query, sources, norm_weight) -> None:
    """The forward and backward kernels once on one token of zeros shaped and typed like these inputs."""
    from .triton import attnres_mix, attnres_mix_bwd

    one = [s.new_zeros(1, s.shape[-1]) for s in sources]
    weight = None if norm_weight is None else norm_weight.detach()
    out, lse, rstd = attnres_mix(query.detach(), one, weight, 1e-6, 1e-6)
    attnres_mix_bwd(torch.zeros_like(out), query.detach(), one, weight, lse, rstd, 1e-6, 1e-6)


def _triton(query, sources, eps, norm_weight, norm_eps):
    from .triton import depth_mix_triton  # imports triton: only once asked for

    return depth_mix_triton(query, sources, eps, norm_weight, norm_eps)


class FusedDepthMix:
    """A depth mix through a fused kernel (module docstring); `fallback` is the PyTorch mix that auto uses
    where Triton does not run (CPU tensors, or after a kernel failed)."""

    def __init__(self, backend: str, fallback: Callable = depth_attention):
        if backend not in BACKENDS:
            raise ValueError(f"attnres depth mix: unknown fused backend {backend!r}; allowed: "
                             f"{list(BACKENDS)}")
        self.backend, self.fallback = backend, fallback

    def __call__(self, query: torch.Tensor | None, sources: Sequence[torch.Tensor],
                 eps: float) -> torch.Tensor:
        return self.normed(query, sources, eps, None, 0.0)

    def normed(self, query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float,
               norm_weight: torch.Tensor | None, norm_eps: float) -> torch.Tensor:
        sources = list(sources)
        if len({s.dtype for s in sources}) > 1:
            # under autocast the embedding's source is fp32 and the sublayers' outputs bf16; the kernels take
            # one dtype, so they mix them as the PyTorch path does (its stack promotes), in sources[0]'s out
            wide = functools.reduce(torch.promote_types, (s.dtype for s in sources))
            out = self.normed(query, [s.to(wide) for s in sources], eps, norm_weight, norm_eps)
            return out.to(sources[0].dtype)
        if self.backend == "fla":
            from .fla import fla_depth_mix

            return fla_depth_mix(query, sources, eps, norm_weight, norm_eps)
        forced, first = self.backend == "triton", sources[0]
        if not (forced or auto_picks_triton(first.device)) or not _GUARD.use_triton(forced):
            return self._unfused(query, sources, eps, norm_weight, norm_eps)
        if query is None:  # the model's first sublayer: one source, weight 1 whatever the query
            if len(sources) != 1:
                raise ValueError("a sublayer without a pseudo-query must have exactly 1 source, got "
                                 f"{len(sources)}")
            query = torch.zeros(first.shape[-1], device=first.device,
                                dtype=torch.float64 if first.dtype == torch.float64 else torch.float32)
        if needs_grad(query, norm_weight, *sources):
            key = (first.device, first.dtype, len(sources), first.shape[-1], query.dtype,
                   None if norm_weight is None else norm_weight.dtype)
            probe = functools.partial(_probe, query, sources, norm_weight)
            if not _GUARD.probe(key, "attnres_mix/attnres_mix_bwd", probe, forced):
                return self._unfused(query, sources, eps, norm_weight, norm_eps)
        return _GUARD.call("attnres_mix", _triton, self._unfused, forced, query, sources, eps, norm_weight,
                           norm_eps)

    def _unfused(self, query, sources, eps, norm_weight, norm_eps):
        return mix_then_norm(query, sources, eps, norm_weight, norm_eps, self.fallback)
