"""The KDA layer's elementwise inputs in one Triton pass each, forward and backward, as custom ops:

    l2norm(x)                 = x / sqrt(sum_d x_d^2 + eps)                  per head (last dim)
    kda_gate(f, A_log, dt_b)  = -exp(A_log[h]) * softplus(f + dt_b[h, :])    f: [B, T, H, K], fp32 out
        or, with a lower bound L < 0 (Kimi K3's safe gate), L * sigmoid(exp(A_log[h]) * (f + dt_b[h, :]))

In PyTorch each is a chain of 4-6 kernels that each read and write the whole tensor; here one.
Gradients: d l2norm: dx = r (dy - y sum(dy y)) with r = 1 / sqrt(sum x^2 + eps), y = x r.
d gate: df = dg (-exp(A_log)) sigmoid(f + dt_b); dt_b and A_log gather df and dg * g over tokens. Safe gate,
s = sigmoid(a x) with a = exp(A_log), x = f + dt_b: df = dg L s (1 - s) a; A_log gathers df * x.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import check_device, scratch

ROWS = 16  # rows (tokens x heads) per program


@triton.jit
def l2norm_fwd_kernel(x, y, rstd, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr, eps):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    ptr = rows.to(tl.int64)[:, None] * D + cols[None, :]
    b_x = tl.load(x + ptr, mask=mask, other=0).to(tl.float32)
    r = 1 / tl.sqrt(tl.sum(b_x * b_x, axis=1) + eps)
    tl.store(y + ptr, (b_x * r[:, None]).to(y.dtype.element_ty), mask=mask)
    tl.store(rstd + rows, r, mask=rows < N)


@triton.jit
def l2norm_bwd_kernel(x, rstd, dy, dx, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    mask = (rows < N)[:, None] & (cols < D)[None, :]
    ptr = rows.to(tl.int64)[:, None] * D + cols[None, :]
    r = tl.load(rstd + rows, mask=rows < N, other=0)
    b_y = tl.load(x + ptr, mask=mask, other=0).to(tl.float32) * r[:, None]
    b_dy = tl.load(dy + ptr, mask=mask, other=0).to(tl.float32)
    b_dx = r[:, None] * (b_dy - b_y * tl.sum(b_dy * b_y, axis=1)[:, None])
    tl.store(dx + ptr, b_dx.to(dx.dtype.element_ty), mask=mask)


@triton.jit
def _softplus(x):
    """log(1 + exp(x)) as torch.nn.functional.softplus (x above 20 passes through), with log1p(z) for small
    z = exp(-|x|) written out so tiny values keep their relative precision."""
    z = tl.exp(-tl.abs(x))
    log1p = tl.where(z < 1e-4, z * (1 - z * (0.5 - z / 3)), tl.log(1 + z))
    return tl.where(x > 20, x, tl.maximum(x, 0) + log1p)


@triton.jit
def _gate_inputs(f, A_log, dt_bias, N, H, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr):
    """This program's block of (token, head) rows: offsets, mask, x = f + dt_bias and a = exp(A_log)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)  # (token, head) pairs
    cols = tl.arange(0, BK)
    mask = (rows < N)[:, None] & (cols < K)[None, :]
    heads = rows % H
    ptr = rows.to(tl.int64)[:, None] * K + cols[None, :]
    x = tl.load(f + ptr, mask=mask, other=0).to(tl.float32)
    x += tl.load(dt_bias + heads[:, None] * K + cols[None, :], mask=mask, other=0).to(tl.float32)
    a = tl.exp(tl.load(A_log + heads, mask=rows < N, other=0).to(tl.float32))
    return ptr, mask, x, a


@triton.jit
def gate_fwd_kernel(f, A_log, dt_bias, g, N, H, lower, K: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
                    SAFE: tl.constexpr):
    ptr, mask, x, a = _gate_inputs(f, A_log, dt_bias, N, H, K, BK, BR)
    if SAFE:
        tl.store(g + ptr, lower * tl.sigmoid(a[:, None] * x), mask=mask)
    else:
        tl.store(g + ptr, -a[:, None] * _softplus(x), mask=mask)


@triton.jit
def gate_bwd_kernel(f, A_log, dt_bias, dg, df, N, H, lower, K: tl.constexpr, BK: tl.constexpr,
                    BR: tl.constexpr, SAFE: tl.constexpr):
    ptr, mask, x, a = _gate_inputs(f, A_log, dt_bias, N, H, K, BK, BR)
    b_dg = tl.load(dg + ptr, mask=mask, other=0).to(tl.float32)
    if SAFE:
        s = tl.sigmoid(a[:, None] * x)
        b_df = b_dg * lower * s * (1 - s) * a[:, None]
    else:
        b_df = -a[:, None] * b_dg * tl.sigmoid(x)
    tl.store(df + ptr, b_df.to(df.dtype.element_ty), mask=mask)


def _grid(n: int):
    return (triton.cdiv(n, ROWS),)


@torch.library.custom_op("kimi::l2norm_fwd", mutates_args=())
def l2norm_fwd(x: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    x = x.contiguous()
    D = x.shape[-1]
    N = x.numel() // D
    y, rstd = scratch(*x.shape, like=x, dtype=x.dtype), scratch(*x.shape[:-1], like=x)
    if N:
        l2norm_fwd_kernel[_grid(N)](x, y, rstd, N, D, triton.next_power_of_2(D), ROWS, eps)
    return y, rstd


@l2norm_fwd.register_fake
def _(x, eps):
    return torch.empty_like(x), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("kimi::l2norm_bwd", mutates_args=())
def l2norm_bwd(x: Tensor, rstd: Tensor, dy: Tensor) -> Tensor:
    x, dy = x.contiguous(), dy.contiguous()
    D = x.shape[-1]
    N = x.numel() // D
    dx = scratch(*x.shape, like=x, dtype=x.dtype)
    if N:
        l2norm_bwd_kernel[_grid(N)](x, rstd, dy, dx, N, D, triton.next_power_of_2(D), ROWS)
    return dx


@l2norm_bwd.register_fake
def _(x, rstd, dy):
    return torch.empty_like(x)


def _l2norm_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])


def _l2norm_backward(ctx, dy, drstd):
    x, rstd = ctx.saved_tensors
    return l2norm_bwd(x, rstd, dy), None


l2norm_fwd.register_autograd(_l2norm_backward, setup_context=_l2norm_setup)


# lower: 0.0 for Kimi Linear's softplus gate, else the safe gate's (negative) lower bound
@torch.library.custom_op("kimi::kda_gate_fwd", mutates_args=())
def kda_gate_fwd(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower: float) -> Tensor:
    f = f.contiguous()
    H, K = f.shape[-2:]
    N = f.numel() // K
    g = scratch(*f.shape, like=f)
    if N:
        gate_fwd_kernel[_grid(N)](f, A_log.contiguous(), dt_bias.contiguous(), g, N, H, float(lower), K,
                                  triton.next_power_of_2(K), ROWS, lower != 0)
    return g


@kda_gate_fwd.register_fake
def _(f, A_log, dt_bias, lower):
    return f.new_empty(f.shape, dtype=torch.float32)


@torch.library.custom_op("kimi::kda_gate_bwd", mutates_args=())
def kda_gate_bwd(f: Tensor, A_log: Tensor, dt_bias: Tensor, dg: Tensor, lower: float) -> Tensor:
    f, dg = f.contiguous(), dg.contiguous()
    H, K = f.shape[-2:]
    N = f.numel() // K
    df = scratch(*f.shape, like=f)
    if N:
        gate_bwd_kernel[_grid(N)](f, A_log.contiguous(), dt_bias.contiguous(), dg, df, N, H, float(lower), K,
                                  triton.next_power_of_2(K), ROWS, lower != 0)
    return df


@kda_gate_bwd.register_fake
def _(f, A_log, dt_bias, dg, lower):
    return f.new_empty(f.shape, dtype=torch.float32)


def _gate_setup(ctx, inputs, output):
    f, A_log, dt_bias, ctx.lower = inputs
    ctx.save_for_backward(f, A_log, dt_bias, output)


def _gate_backward(ctx, dg):
    f, A_log, dt_bias, g = ctx.saved_tensors
    df = kda_gate_bwd(f, A_log, dt_bias, dg, ctx.lower)
    H, K = f.shape[-2:]
    d_dt_bias = df.reshape(-1, H * K).sum(0)  # dt_bias enters exactly where f does
    if ctx.lower:  # d/dA of L sigmoid(exp(A) x) = df * x: exp(A) x's derivative in A is itself
        x = f.float() + dt_bias.float().view(H, K)
        d_A_log = (df * x).reshape(-1, H, K).sum((0, 2))
    else:
        d_A_log = (dg * g).reshape(-1, H, K).sum((0, 2))  # d(-exp(A) s)/dA = -exp(A) s = g
    return df.to(f.dtype), d_A_log.to(A_log.dtype), d_dt_bias.to(dt_bias.dtype), None


kda_gate_fwd.register_autograd(_gate_backward, setup_context=_gate_setup)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum x^2 + eps) over the last dim, in x's dtype (fp32 inside)."""
    check_device(x)
    return l2norm_fwd(x, float(eps))[0]


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None = None) -> Tensor:
    """f [..., H, K] -> g = -exp(A_log[h]) * softplus(f + dt_bias[h * K + k]) in fp32, or with a lower bound
    L < 0, L * sigmoid(exp(A_log[h]) * (f + dt_bias[h * K + k]))."""
    check_device(f)
    return kda_gate_fwd(f, A_log, dt_bias, float(lower_bound or 0.0))
