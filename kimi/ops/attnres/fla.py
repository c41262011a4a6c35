"""fla-core's fused AttnRes (fla.ops.attnres.fused_attnres, in the optional fla-core package) behind the
depth mix's calling convention: model.attnres.backend=fla. CUDA only (its kernels autotune on a GPU).

Its key norm carries a weight, which ours does not have (the model folds any key weight into the query): it
gets ones. Its output norm shares the key norm's eps, so the pre-norm is fused only when the two eps agree
(they do in the model: both are model.norm_eps), and it normalises the mix in fp32 without first rounding it
to the sources' dtype as the unfused path does: bf16 results differ from ours at bf16's precision.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from typing import Sequence

import torch

from .reference import mix_then_norm, pre_norm


def missing() -> str | None:
    """Why model.attnres.backend=fla cannot run on this installation (None: it can), without importing fla."""
    spec = importlib.util.find_spec("fla")
    if spec is None:
        return "the fla-core package is not installed"
    if not any(os.path.isfile(os.path.join(loc, "ops", "attnres", "fused.py"))
               for loc in spec.submodule_search_locations or ()):
        try:
            version = importlib.metadata.version("fla-core")
        except importlib.metadata.PackageNotFoundError:
            version = "(version unknown)"
        return f"the installed fla-core {version} has no fused AttnRes (fla.ops.attnres.fused_attnres)"
    return None


def fla_depth_mix(query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float,
                  norm_weight: torch.Tensor | None = None, norm_eps: float = 0.0) -> torch.Tensor:
    reason = missing()
    if reason is not None:
        raise ImportError(f"model.attnres.backend=fla: {reason}; install a fla-core that has it or set "
                          "model.attnres.backend=auto")
    if not sources[0].is_cuda:
        raise RuntimeError("model.attnres.backend=fla runs on CUDA tensors only: set "
                           "model.attnres.backend=auto")
    try:  # missing() said it is there; a broken install still ends in one line
        from fla.ops.attnres import fused_attnres
    except ImportError as exc:
        raise ImportError(f"model.attnres.backend=fla: fla-core's fused AttnRes does not import ({exc}); set "
                          "model.attnres.backend=auto") from exc

    if query is None:  # one source, weight 1 (see depth_attention)
        return mix_then_norm(None, sources, eps, norm_weight, norm_eps)
    fuse = norm_weight is not None and norm_eps == eps
    out = fused_attnres(query, list(sources), torch.ones_like(query), norm_weight if fuse else None,
                        rms_eps=eps)
    if norm_weight is not None and not fuse:
        return pre_norm(out, norm_weight, norm_eps)
    return out
