"""The fused depth mix as torch custom ops with autograd, so torch.compile sees one opaque node and autograd
calls the Triton backward:

    kimi::attnres_mix(query, sources, norm_weight, eps, norm_eps) -> (out, lse, rstd)
    kimi::attnres_mix_bwd(dout, query, sources, norm_weight, lse, rstd, eps, norm_eps)
        -> (dsources, dquery, dweight)

What the backward keeps: the query, the norm weight, the sources themselves (the stream holds them anyway:
no copy, no stack) and two numbers per token (lse, rstd). norm_weight None: no norm (rstd is then empty).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, check_inputs, stat_dtype
from .kernels import mix_bwd_kernel, mix_fwd_kernel

# Backward programs per streaming multiprocessor: each sums dq and dw over its run of tokens, then the runs'
# partial sums ([programs, D] fp32) are added up by torch. Untuned (no GPU measurement yet).
PROGRAMS_PER_SM = 8
INTERPRET_ROWS = 3  # tokens per backward program under the interpreter: odd token counts leave a ragged run


def launch(D: int, backward: bool) -> tuple[int, int]:
    """(BD, num_warps): the row as one power-of-two tile, about 8 elements per thread per row vector in the
    forward and 4 in the backward, which holds more vectors at once (bench/attnres.py --compile-check
    reports the registers: at `1b`'s width neither kernel spills)."""
    BD = triton.next_power_of_2(D)
    return BD, max(1, min(16, BD // (128 if backward else 256)))


def acc_type(dtype: torch.dtype) -> tl.dtype:
    """The kernels' compute dtype (constexpr ACC) for sources of this dtype."""
    return tl.float64 if dtype == torch.float64 else tl.float32


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_per_program(T: int, device: torch.device) -> int:
    """Tokens per backward program."""
    if INTERPRET or device.type != "cuda":
        return INTERPRET_ROWS
    return max(1, triton.cdiv(T, PROGRAMS_PER_SM * _multiprocessors(device)))


def _flat(sources: list[Tensor]) -> tuple[Tensor, ...]:
    D = sources[0].shape[-1]
    return tuple(s.contiguous().view(-1, D) for s in sources)


@torch.library.custom_op("kimi::attnres_mix", mutates_args=())
def attnres_mix(query: Tensor, sources: list[Tensor], norm_weight: Tensor | None, eps: float,
                norm_eps: float) -> tuple[Tensor, Tensor, Tensor]:
    srcs = _flat(sources)
    T, D = srcs[0].shape
    stats = stat_dtype(srcs[0].dtype)
    out = torch.empty_like(srcs[0])
    lse = torch.empty(T, dtype=stats, device=out.device)
    rstd = torch.empty(T if norm_weight is not None else 0, dtype=stats, device=out.device)
    if T:
        BD, warps = launch(D, backward=False)
        weight = query if norm_weight is None else norm_weight.contiguous()  # a placeholder when unused
        mix_fwd_kernel[(T,)](srcs, query.contiguous(), weight, out, lse, rstd, float(eps), float(norm_eps),
                             len(srcs), D, BD, norm_weight is not None, acc_type(out.dtype), num_warps=warps)
    return out.view(sources[0].shape), lse, rstd


@attnres_mix.register_fake
def _(query, sources, norm_weight, eps, norm_eps):
    T = sources[0].numel() // sources[0].shape[-1]
    stats = stat_dtype(sources[0].dtype)
    return (torch.empty_like(sources[0]), sources[0].new_empty(T, dtype=stats),
            sources[0].new_empty(T if norm_weight is not None else 0, dtype=stats))


@torch.library.custom_op("kimi::attnres_mix_bwd", mutates_args=())
def attnres_mix_bwd(dout: Tensor, query: Tensor, sources: list[Tensor], norm_weight: Tensor | None,
                    lse: Tensor, rstd: Tensor, eps: float,
                    norm_eps: float) -> tuple[list[Tensor], Tensor, Tensor]:
    srcs = _flat(sources)
    T, D = srcs[0].shape
    dsrcs = [torch.empty_like(s) for s in srcs]  # one tensor per source: autograd adds each into its own grad
    rows = rows_per_program(T, dout.device)
    programs = triton.cdiv(T, rows)
    dq_part = torch.zeros(programs, D, dtype=lse.dtype, device=dout.device)
    dw_part = torch.zeros(programs if norm_weight is not None else 0, D, dtype=lse.dtype, device=dout.device)
    if T:
        BD, warps = launch(D, backward=True)
        weight = query if norm_weight is None else norm_weight.contiguous()
        mix_bwd_kernel[(programs,)](srcs, tuple(dsrcs), query.contiguous(), weight,
                                    dout.contiguous().view(T, D), lse, rstd, dq_part, dw_part, T, rows,
                                    float(eps), float(norm_eps), len(srcs), D, BD, norm_weight is not None,
                                    acc_type(srcs[0].dtype), num_warps=warps)
    dweight = query.new_empty(0) if norm_weight is None else dw_part.sum(0).to(norm_weight.dtype)
    return [d.view(s.shape) for d, s in zip(dsrcs, sources)], dq_part.sum(0).to(query.dtype), dweight


@attnres_mix_bwd.register_fake
def _(dout, query, sources, norm_weight, lse, rstd, eps, norm_eps):
    dweight = query.new_empty(0) if norm_weight is None else torch.empty_like(norm_weight)
    return [torch.empty_like(s) for s in sources], torch.empty_like(query), dweight


def _setup_context(ctx, inputs, output):
    query, sources, norm_weight, eps, norm_eps = inputs
    _, lse, rstd = output
    ctx.save_for_backward(query, norm_weight, lse, rstd, *sources)
    ctx.eps, ctx.norm_eps = eps, norm_eps
    ctx.mark_non_differentiable(lse, rstd)


def _backward(ctx, dout, _dlse, _drstd):
    query, norm_weight, lse, rstd, *sources = ctx.saved_tensors
    dsources, dquery, dweight = attnres_mix_bwd(dout, query, sources, norm_weight, lse, rstd, ctx.eps,
                                                 ctx.norm_eps)
    return dquery, dsources, None if norm_weight is None else dweight, None, None


attnres_mix.register_autograd(_backward, setup_context=_setup_context)


def depth_mix_triton(query: Tensor, sources: list[Tensor], eps: float, norm_weight: Tensor | None = None,
                     norm_eps: float = 0.0) -> Tensor:
    """sum_i softmax_i(query . RMSNorm(v_i)) v_i over `sources` (each [..., D], one dtype and shape), then
    with norm_weight RMSNorm(mix) * norm_weight as kimi.model.norm.RMSNorm computes it; in the sources'
    dtype."""
    check_inputs(query, sources, norm_weight)
    return attnres_mix(query, list(sources), norm_weight, float(eps), float(norm_eps))[0]
