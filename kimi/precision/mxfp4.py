"""MXFP4 (OCP Microscaling v1.0) for the routed experts' weights: the quantise-dequantise that
quantisation-aware training puts in the forward, with a straight-through gradient, and the packed form an
exported checkpoint stores.

A block is 32 consecutive elements along the last (input) dimension; each element is an E2M1 code (sign and
magnitude 0, 0.5, 1, 1.5, 2, 3, 4 or 6) and each block shares one E8M0 scale, a uint8 biased exponent s
meaning 2^(s - 127). Stored: ``weight_packed`` [..., n / 2] uint8, two codes a byte, the even element in the
low nibble, and ``weight_scale`` [..., n / 32] uint8. Quantisation is torchao's ``to_mx`` (RCEIL scales: the
block maximum never saturates) of the weight rounded to bf16 first: what FSDP's bf16 gather hands the layer,
so every layout (and the exporter, from the fp32 masters) quantises the same numbers.
"""

from __future__ import annotations

import torch

BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of codes 0-7; bit 3 is the sign


def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] (n a multiple of 32) -> (packed [..., n / 2] uint8, scale [..., n / 32] uint8)."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    scale, packed = to_mx(w.detach().to(torch.bfloat16).contiguous(), torch.float4_e2m1fn_x2, BLOCK,
                          ScaleCalculationMode.RCEIL)
    return packed.view(torch.uint8), scale.view(torch.uint8)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values `packed` and `scale` (quantize's format) stand for, [..., n] in `dtype`."""
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()  # even element: low nibble
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    values = table[codes & 7] * (1 - 2 * (codes >> 3)).float()
    factor = torch.exp2(scale.float() - 127).masked_fill(scale == 255, float("nan"))  # 255: E8M0's NaN
    values = values.unflatten(-1, (-1, BLOCK)) * factor[..., None]
    return values.flatten(-2).to(dtype)


class _FakeQuantize(torch.autograd.Function):
    """dequantize(quantize(w)) forward; the gradient passes through unchanged (straight-through), so the
    optimizer updates the high-precision master as if the forward had used it."""

    @staticmethod
    def forward(ctx, w: torch.Tensor) -> torch.Tensor:
        return dequantize(*quantize(w), dtype=w.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def fake_quantize(w: torch.Tensor) -> torch.Tensor:
    """w as its MXFP4 values (same shape and dtype), with a straight-through gradient."""
    return _FakeQuantize.apply(w)
