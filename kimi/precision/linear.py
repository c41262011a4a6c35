"""The block projections' fp8 and MXFP8 matmuls, through torchao (imported here: the fp8 extra).

Both modules are nn.Linear subclasses that keep the layer's own high-precision `weight` Parameter (the
optimizer's master, what checkpoints hold) and quantise it, the input and the output gradient on the fly in
every forward and backward. Each casts its input as autocast would cast a linear's (bf16 under
trainer.precision=fp8|mxfp8) and runs its matmuls with autocast off: torchao's float8 module only follows
CUDA's autocast, and its emulated matmul would otherwise run in bf16 on CPU instead of fp32 over the
quantised operands, which is what the hardware's fp8 and MXFP8 matmuls compute.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torchao.float8.config import Float8LinearConfig
from torchao.float8.float8_linear import Float8Linear
from torchao.prototype.moe_training.mxfp8_linear import _to_mxfp8_then_scaled_mm
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

from kimi.ops import autocast_dtype


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return autocast_dtype(x.device.type) or x.dtype


class Fp8Linear(Float8Linear):
    """torchao's Float8Linear (recipe in `config`; `config.emulate`: the matmul in fp32 over dequantised fp8
    operands, on any device)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(_compute_dtype(x))  # before autocast is turned off
        with torch.autocast(x.device.type, enabled=False):
            return super().forward(x)


class MXFP8Linear(nn.Linear):
    """MXFP8 (E4M3 elements, block 32, E8M0 scales, RCEIL rounding) for the forward GEMM and both backward
    GEMMs, through torchao's differentiable ``_to_mxfp8_then_scaled_mm``; emulated: torchao's to_mx and a
    matmul over the dequantised blocks. The weight is cast to the compute dtype first (what FSDP's bf16
    gather would hand it): torchao's MX matmul takes both operands in one dtype."""

    kernel = KernelPreference.AUTO

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x)
        with torch.autocast(x.device.type, enabled=False):
            out = _to_mxfp8_then_scaled_mm(x.to(dtype), self.weight.to(dtype), self.kernel,
                                           ScaleCalculationMode.RCEIL)
        out = out.to(dtype)  # the native kernel returns bf16 whatever its inputs (an fp32 forward: sampling)
        return out if self.bias is None else out + self.bias.to(out.dtype)


def fp8_config(recipe: str, emulate: bool, fsdp_all_gather: bool = False) -> Float8LinearConfig:
    """torchao's config for a recipe name (tensorwise | rowwise | rowwise_with_gw_hp); fsdp_all_gather
    (tensorwise only): the weight becomes torchao's WeightWithDynamicFloat8CastTensor, which FSDP2 gathers
    as fp8 (kimi/precision/fsdp_float8.py)."""
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather)


def to_fp8(linear: nn.Linear, config: Float8LinearConfig) -> Fp8Linear:
    return Fp8Linear.from_float(linear, config=config)


def to_mxfp8(linear: nn.Linear, emulate: bool) -> MXFP8Linear:
    with torch.device("meta"):
        new = MXFP8Linear(linear.in_features, linear.out_features, bias=False)
    new.weight, new.bias = linear.weight, linear.bias
    if emulate:
        new.kernel = KernelPreference.EMULATED
    return new
