"""What the forward and backward kernels share: head-dim blocking, document tables, the key range of a
query block, launch options, and the interpreter check.

Masking follows :func:`kimi.ops.attention.reference.attention_mask` exactly: with a causal mask query i sits
at key position Tk - Tq + i; with cu_seqlens every token carries a document index (positions past the last
offset form one more document, as there) and pairs from different documents are masked.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kimi.ops.documents import segment_ids
from kimi.ops.dispatch import is_fake
from kimi.ops.triton_interpreter import INTERPRET

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# The one configuration the interpreter uses (autotuning needs a GPU to time candidates); small blocks keep
# interpreted runs fast, and 32 != 16 exercises the code paths where query and key blocks differ.
INTERPRET_FWD = dict(BLOCK_M=32, BLOCK_N=16)
INTERPRET_BWD = dict(BLOCK_M=16, BLOCK_N=32)

# On a GPU the kernels autotune over a few tile shapes per (head dims, GQA group, mask kind); that compiles
# every candidate once (seconds each). False (or KIMI_ATTENTION_AUTOTUNE=0) uses each kernel's first
# candidate instead: quick checks, reproducible tiles. Read at every call.
AUTOTUNE: bool = os.environ.get("KIMI_ATTENTION_AUTOTUNE", "1") != "0"

# How the backward gets dQ, when a call does not say (atomic_dq=None). True (default): the dK/dV kernel adds
# each block's dQ share into an fp32 buffer with atomics (FlashAttention-2's way), 5 matmuls; the order of
# the fp32 sums, hence the last bits of dQ, varies run to run. On an H200 (bench/results/gpu/2026-11-30-h200)
# its forward+backward took 0.73-0.98x SDPA's time against 1.54-2.35x for False (or
# KIMI_ATTENTION_DQ=separate): a second kernel recomputes P and dP per query block, 7 matmuls, deterministic
# (the model's switch is model.attention.deterministic). Read at every call.
DQ_ATOMIC: bool = os.environ.get("KIMI_ATTENTION_DQ", "atomic") != "separate"


def pick_kernel(kernel, tuned, interpret_tiles: dict):
    """(callable kernel, extra launch options) for this call: fixed tiles when interpreting or not tuning."""
    if INTERPRET:
        return kernel, dict(interpret_tiles)
    if AUTOTUNE:
        return tuned, {}
    first = tuned.configs[0]
    return kernel, dict(first.kwargs, num_warps=first.num_warps, num_stages=first.num_stages)


def check_device(*tensors: torch.Tensor) -> None:
    """Raise a clear error where the kernels cannot run on these tensors."""
    if any(not t.is_cuda and not is_fake(t) for t in tensors) and not INTERPRET:
        raise RuntimeError(
            "attention backend 'triton' on CPU tensors runs only under the Triton interpreter: set "
            "TRITON_INTERPRET=1 in the environment before triton is first imported (or use backend='sdpa')"
        )
    dtype = tensors[0].dtype
    if dtype not in SUPPORTED_DTYPES or any(t.dtype != dtype for t in tensors):
        raise TypeError(
            f"attention backend 'triton' needs q, k, v of one dtype among fp16/bf16/fp32, got "
            f"{[t.dtype for t in tensors]}; use backend='sdpa' for others"
        )


def head_blocks(d_qk: int, d_v: int) -> tuple[int, int, int]:
    """(BLOCK_D1, BLOCK_D2, BLOCK_DV): Dqk as a power of two plus a smaller padded remainder (192 = 128 + 64,
    so MLA's nope + rope dims waste no work on padding), Dv padded; 16 is tl.dot's smallest inner size."""
    d1 = max(16, 1 << (d_qk.bit_length() - 1))
    rest = d_qk - d1
    d2 = 0 if rest <= 0 else max(16, triton.next_power_of_2(rest))
    return d1, d2, max(16, triton.next_power_of_2(d_v))


def document_tables(cu_seqlens: torch.Tensor, length: int, device: torch.device):
    """Per token: document index, first position and one-past-last position of its document (int32)."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seg = segment_ids(cu, length)
    starts = torch.cat([cu.new_zeros(1), cu[1:]])
    ends = torch.cat([cu[1:], cu.new_full((1,), length)]).clamp(max=length)
    return seg.int().contiguous(), starts[seg].int().contiguous(), ends[seg].int().contiguous()


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products; TF32 would cost 1e-3 relative error, not what fp32 asks for."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def key_range(m0, offs_m, row_ok, Tq, Tk, DSTART, DEND,
              CAUSAL: tl.constexpr, VARLEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys [lo, hi) that rows m0..m0+BLOCK_M may see; [lo, full) needs no mask (whole blocks only)."""
    zero = tl.zeros([], tl.int32)  # tensors, never constexprs, whatever Triton specialised Tq, Tk to
    if VARLEN:
        starts = tl.load(DSTART + offs_m, mask=row_ok, other=Tk)
        lo = zero + tl.min(starts, 0)
        hi = zero + tl.max(tl.load(DEND + offs_m, mask=row_ok, other=0), 0)
        one_doc = lo == tl.max(tl.where(row_ok, starts, 0), 0)
        # Inside one document every row sees the keys before the block's first row (causal) or all of its
        # document's keys (not causal); a block across a boundary masks everything.
        if CAUSAL:
            hi = tl.minimum(hi, m0 + BLOCK_M)
            visible = zero + m0
        else:
            visible = hi
        full = tl.where(one_doc, lo + tl.maximum(visible - lo, 0) // BLOCK_N * BLOCK_N, lo)
    else:
        lo = zero
        if CAUSAL:
            offset = Tk - Tq
            hi = tl.minimum(zero + m0 + BLOCK_M + offset, Tk)
            full = tl.maximum(tl.minimum(zero + m0 + offset, Tk), 0) // BLOCK_N * BLOCK_N
        else:
            hi = zero + Tk
            full = zero + Tk // BLOCK_N * BLOCK_N
    return lo, full, hi


@triton.jit
def pair_mask(offs_m, offs_n, Tq, Tk, seg_q, SEG, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """[BLOCK_M, BLOCK_N] allowed (query, key) pairs; out-of-range keys are never allowed."""
    ok = (offs_n < Tk)[None, :] & (offs_m < Tq)[:, None]
    if CAUSAL:
        ok = ok & ((offs_m + (Tk - Tq))[:, None] >= offs_n[None, :])
    if VARLEN:
        seg_k = tl.load(SEG + offs_n, mask=offs_n < Tk, other=-2)
        ok = ok & (seg_q[:, None] == seg_k[None, :])
    return ok


@triton.jit
def pair_mask_t(offs_n, offs_m, Tq, Tk, seg_k, SEG, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """pair_mask transposed, [BLOCK_N, BLOCK_M] (keys along rows), for the dK/dV kernel."""
    ok = (offs_n < Tk)[:, None] & (offs_m < Tq)[None, :]
    if CAUSAL:
        ok = ok & ((offs_m + (Tk - Tq))[None, :] >= offs_n[:, None])
    if VARLEN:
        seg_q = tl.load(SEG + offs_m, mask=offs_m < Tq, other=-1)
        ok = ok & (seg_k[:, None] == seg_q[None, :])
    return ok


@triton.jit
def dot_transposed(a1, a2, base, offs, stride, ok, DQK: tl.constexpr, BLOCK_D1: tl.constexpr,
                   BLOCK_D2: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    """a @ X^T for the rows `offs` of X (valid where `ok`) at base + row * stride, X's head dim in two tiles
    (a = [a1 | a2]); returns (a @ X^T, X^T's first tile, its second, which is the first when BLOCK_D2 = 0)."""
    offs_d1 = tl.arange(0, BLOCK_D1)
    xt1 = tl.load(base + offs[None, :] * stride + offs_d1[:, None],
                  mask=ok[None, :] & (offs_d1 < DQK)[:, None],
                  other=0.0)
    if UPCAST:
        xt1 = xt1.to(tl.float32)
    out = tl.dot(a1, xt1, input_precision=PRECISION)
    xt2 = xt1
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        xt2 = tl.load(base + offs[None, :] * stride + offs_d2[:, None],
                      mask=ok[None, :] & (offs_d2 < DQK)[:, None], other=0.0)
        if UPCAST:
            xt2 = xt2.to(tl.float32)
        out = tl.dot(a2, xt2, out, input_precision=PRECISION)
    return out, xt1, xt2


@triton.jit
def query_block(H, GROUP, Tq, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """This program's batch, query head, key/value head and query rows. Causal launches take the longest
    rows first, so the short ones fill the tail of the launch."""
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = (h // GROUP).to(tl.int64)
    h = h.to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    return b, h, hk, m0, offs_m, offs_m < Tq
