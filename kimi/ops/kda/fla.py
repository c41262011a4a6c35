"""fla-core's KDA kernels (the optional `fla-core` package, flash-linear-attention) behind this package's
calling convention: backend="fla" of chunk_kda and fused_recurrent_kda, i.e. model.kda.backend=fla.

They run on CUDA only (fla's Triton kernels autotune and use GPU-only features, so not even the Triton
interpreter runs them). fla marks its entry points torch.compiler.disable: under parallel.compile each call is
a graph break between compiled pieces. The layer's l2norm and gate stay ours (fla takes activated gates);
a safe gate (lower_bound >= -5, Kimi K3's) takes fla's safe_gate path, its counterpart of our bounded one.
"""

from __future__ import annotations

from .chunk import bounded


def _kernels():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError as exc:
        raise ImportError(f"KDA backend 'fla' needs the fla-core package ({exc}); install it (pip install "
                          "fla-core) or set model.kda.backend=auto") from exc
    return chunk_kda, fused_recurrent_kda


def _long(cu_seqlens):
    return None if cu_seqlens is None else cu_seqlens.long()  # fla indexes with int64 offsets


def fla_chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens=None, lower_bound=None):
    chunk, _ = _kernels()
    safe = dict(safe_gate=True, lower_bound=lower_bound) if bounded(lower_bound) else {}
    return chunk(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                 cu_seqlens=_long(cu_seqlens), **safe)


def fla_recurrent(q, k, v, g, beta, scale, initial_state, cu_seqlens=None):
    _, recurrent = _kernels()
    return recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                     cu_seqlens=_long(cu_seqlens))


fla_chunk.takes_cu_seqlens = fla_recurrent.takes_cu_seqlens = True
