"""CUDA autocast's casting policy, on the CPU: what a GPU run's activation trace (kimi.plan.activations) runs
its forward under.

A GPU's bf16 step runs under CUDA's autocast, whose lists differ from the CPU's: CUDA computes exp, log,
rsqrt, pow, softplus, rms_norm and the losses in fp32 and gives softmax, log_softmax, cumsum and sum an fp32
output, where CPU autocast leaves them in bf16. What autograd keeps differs with them (a 4-byte copy or
output where the CPU keeps 2 bytes), so a trace under CPU autocast undercounts a GPU's activations. Fake CUDA
tensors cannot run the model on a CPU-only torch (its C++ device guards abort), so the trace stays on fake CPU
tensors and this module gives CPU autocast CUDA's rules for the ops where they differ: kernels registered at
the AutocastCPU dispatch key, for as long as the context is open, that cast as CUDA's kernels cast
(ATen/autocast_mode.h): fp32 ops take their bf16 and fp16 inputs in fp32, the fp32-output ops get
dtype=float32, the promoting ops take their floating inputs in the widest dtype among them. The
lower-precision (matmul) list is left to CPU autocast, which casts the same matmuls and caches the weights'
copies as CUDA's does.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Iterator

import torch

# ATen/autocast_mode.h (torch 2.13): AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE and AT_FORALL_PROMOTE, as
# "op" or "op.overload"; tests/plan/test_cuda_autocast.py checks them against the installed torch's header
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa")
FP32_OUTPUT = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
               "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
               "sum.dim_IntList")
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _op(name: str):
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _floating(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


def _cast(x, dtype):
    if isinstance(x, (list, tuple)):
        return type(x)(_cast(y, dtype) for y in x)
    return x.to(dtype) if _floating(x) and x.dtype != dtype else x


def _fp32(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            return op(*(_cast(a, torch.float32) for a in args),
                      **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
    return kernel


def _fp32_output(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if args and _floating(args[0]) and kwargs.get("dtype") is None:
                kwargs = {**kwargs, "dtype": torch.float32}
            return op(*args, **kwargs)
    return kernel


def _promote(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            every = (*args, *kwargs.values())
            flat = [x for a in every for x in (a if isinstance(a, (list, tuple)) else [a])]
            dtypes = [x.dtype for x in flat if _floating(x)]
            if len(set(dtypes)) > 1:
                wide = functools.reduce(torch.promote_types, dtypes)
                args = tuple(_cast(a, wide) for a in args)
                kwargs = {k: _cast(v, wide) for k, v in kwargs.items()}
            return op(*args, **kwargs)
    return kernel


@contextlib.contextmanager
def cuda_policy() -> Iterator[None]:
    """CPU autocast casts as CUDA's autocast does (module docstring) while this is open."""
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel": CPU autocast's
            for names, wrap in ((FP32, _fp32), (FP32_OUTPUT, _fp32_output), (PROMOTE, _promote)):
                for name in names:
                    try:
                        op = _op(name)
                    except AttributeError:  # not in this torch
                        continue
                    lib.impl(name, wrap(op), "AutocastCPU")
        yield
    finally:
        lib._destroy()
