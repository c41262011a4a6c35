"""The Triton KDA kernels as torch custom ops, so autograd and torch.compile see one opaque node each
(no graph break, no tracing into Triton), plus the functions kimi.ops.kda dispatches to.

Ops take packed inputs ([1, T, H, D] with cu_seqlens); the functions below pack a plain [B, T] batch as B
sequences of length T, so every kernel has one varlen code path.
"""

import torch
import triton
from torch import Tensor

from kimi.ops import SCRATCH
from kimi.ops.flops import register_kda_ops

from .chunk_bwd import chunk_bwd, chunk_bwd_scratch
from .chunk_fwd import chunk_fwd, intermediates_bytes
from ..chunk import bounded
from .common import CHUNK, check_device, check_offsets, chunk_table, dot_precision
from .recurrent import recurrent_fwd


def _packed(*xs: Tensor) -> list[Tensor]:
    """[1, T, H, ...] -> contiguous [T, H, ...]."""
    return [x[0].contiguous() for x in xs]


@torch.library.custom_op("kimi::kda_chunk_fwd", mutates_args=())
def kda_chunk_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                  initial_state: Tensor | None, cu_seqlens: Tensor,
                  bounded: bool = False) -> tuple[Tensor, Tensor]:
    chunks, first, NT = chunk_table(cu_seqlens, q.shape[1])
    h0 = None if initial_state is None else initial_state.contiguous()
    o, ht = chunk_fwd(*_packed(q, k, v, g, beta), scale, h0, cu_seqlens, chunks, first, NT,
                      dot_precision(q.dtype), bounded)
    return o.unsqueeze(0), ht


@kda_chunk_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, bounded=False):
    N, (H, K), V = cu_seqlens.shape[0] - 1, q.shape[2:], v.shape[-1]
    return torch.empty_like(v), q.new_empty(N, H, K, V, dtype=torch.float32)


@torch.library.custom_op("kimi::kda_chunk_bwd", mutates_args=())
def kda_chunk_bwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                  initial_state: Tensor | None, cu_seqlens: Tensor, do: Tensor, dht: Tensor | None,
                  bounded: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    chunks, first, NT = chunk_table(cu_seqlens, q.shape[1])
    h0 = None if initial_state is None else initial_state.contiguous()
    dht = None if dht is None else dht.float().contiguous()
    grads = chunk_bwd(*_packed(q, k, v, g, beta), scale, h0, cu_seqlens, chunks, first, NT,
                      dot_precision(q.dtype), do[0].contiguous(), dht, bounded)
    *grads, dh0 = grads
    return (*(x.unsqueeze(0) for x in grads), dh0)


@kda_chunk_bwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, bounded=False):
    N, (H, K), V = cu_seqlens.shape[0] - 1, q.shape[2:], v.shape[-1]
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g),
            torch.empty_like(beta), q.new_empty(N, H, K, V, dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, cu_seqlens, bounded = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.scale, ctx.bounded = scale, bounded
    ctx.set_materialize_grads(False)  # an unused final state passes None, and its kernel input is skipped


def _backward(ctx, do, dht):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    if do is None:
        do = torch.zeros_like(v)
    dq, dk, dv, dg, dbeta, dh0 = kda_chunk_bwd(q, k, v, g, beta, ctx.scale, initial_state, cu_seqlens, do,
                                               dht, ctx.bounded)
    dh0 = None if initial_state is None else dh0.to(initial_state.dtype)
    return dq, dk, dv, dg, dbeta, None, dh0, None, None


kda_chunk_fwd.register_autograd(_backward, setup_context=_setup_context)


def _shapes(q: Tensor, v: Tensor, cu_seqlens: Tensor) -> tuple[int, ...]:
    """(T, H, K, V, N, NT) of packed [1, T, H, D] inputs; NT as for N sequences of one length, since a fake
    tensor's cu_seqlens has no values."""
    T, H, K = q.shape[1:]
    N = cu_seqlens.shape[0] - 1
    return T, H, K, v.shape[-1], N, N * triton.cdiv(triton.cdiv(T, N), CHUNK) if N else 0


SCRATCH[torch.ops.kimi.kda_chunk_fwd.default] = (
    lambda q, k, v, g, beta, scale, h0, cu, *rest: intermediates_bytes(*_shapes(q, v, cu), q.dtype))
SCRATCH[torch.ops.kimi.kda_chunk_bwd.default] = (
    lambda q, k, v, g, beta, scale, h0, cu, *rest: chunk_bwd_scratch(*_shapes(q, v, cu), q.dtype, g.dtype))


@torch.library.custom_op("kimi::kda_recurrent_fwd", mutates_args=())
def kda_recurrent_fwd(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
                      initial_state: Tensor | None, cu_seqlens: Tensor, check: bool) -> tuple[Tensor, Tensor]:
    if check:  # a host sync: only for offsets from a caller, not the ones made below for a [B, T] batch
        check_offsets(cu_seqlens.tolist(), q.shape[1])
    return recurrent_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens)


@kda_recurrent_fwd.register_fake
def _(q, k, v, g, beta, scale, initial_state, cu_seqlens, check):
    N, (H, K), V = cu_seqlens.shape[0] - 1, q.shape[2:], v.shape[-1]
    return torch.empty_like(v), q.new_empty(N, H, K, V, dtype=torch.float32)


@torch.library.custom_op("kimi::kda_recurrent_fwd_", mutates_args=("state",))
def kda_recurrent_fwd_(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, state: Tensor,
                       cu_seqlens: Tensor, check: bool) -> Tensor:
    if check:
        check_offsets(cu_seqlens.tolist(), q.shape[1])
    return recurrent_fwd(q, k, v, g, beta, scale, state, cu_seqlens, final_state=state)[0]


@kda_recurrent_fwd_.register_fake
def _(q, k, v, g, beta, scale, state, cu_seqlens, check):
    return torch.empty_like(v)


def _pack_batch(q: Tensor, cu_seqlens: Tensor | None, *xs: Tensor) -> tuple[list[Tensor], Tensor]:
    """A [B, T] batch as B packed sequences of length T (cu_seqlens inputs are packed already)."""
    if cu_seqlens is not None:
        return list(xs), cu_seqlens
    B, T = q.shape[:2]
    packed = [x.reshape(1, B * T, *x.shape[2:]) for x in xs]
    return packed, torch.arange(B + 1, device=q.device, dtype=torch.int32) * T


def chunk_kda_triton(q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None, lower_bound=None):
    """Same contract as kimi.ops.kda.chunk.chunk_kda_torch, plus cu_seqlens taken in one launch;
    differentiable wrt q, k, v, g, beta and initial_state. States are fp32. lower_bound: every g is >= it
    (Kimi K3's safe gate); at -5 or above the score kernels take their bounded form
    (kimi.ops.kda.chunk.bounded)."""
    check_device(q, k, v, g, beta)
    B, T = q.shape[:2]
    (q, k, v, g, beta), cu = _pack_batch(q, cu_seqlens, q, k, v, g, beta)
    o, state = kda_chunk_fwd(q, k, v, g, beta, float(scale), initial_state, cu, bounded(lower_bound))
    return o.reshape(B, T, *o.shape[2:]), state


def fused_recurrent_kda_triton(q, k, v, g, beta, scale: float, initial_state=None, cu_seqlens=None,
                               inplace: bool = False):
    """Token-by-token KDA for decoding, forward only. inplace=True writes the final state into
    initial_state (fp32, contiguous) and returns it, allocating nothing per step but the output."""
    check_device(q, k, v, g, beta)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                       for x in (q, k, v, g, beta, initial_state)):
        raise RuntimeError("fused_recurrent_kda(backend='triton') is forward-only (decoding); "
                           "train through chunk_kda, or run under torch.no_grad()")
    B, T = q.shape[:2]
    (q, k, v, g, beta), cu = _pack_batch(q, cu_seqlens, q, k, v, g, beta)
    if inplace:
        if initial_state is None or initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
            raise ValueError("inplace=True needs initial_state as a contiguous fp32 tensor to update")
        o = kda_recurrent_fwd_(q, k, v, g, beta, float(scale), initial_state, cu, cu_seqlens is not None)
        state = initial_state
    else:
        o, state = kda_recurrent_fwd(q, k, v, g, beta, float(scale), initial_state, cu,
                                     cu_seqlens is not None)
    return o.reshape(B, T, *o.shape[2:]), state


register_kda_ops()  # FlopCounterMode counts them as the model declares them (kimi/ops/flops.py)
