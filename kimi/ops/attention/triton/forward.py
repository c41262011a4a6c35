"""Flash-attention forward: O, the log-sum-exp of every row and, on request, every row's largest scaled
logit, which online softmax tracks anyway (the running row max), so QK-Clip's statistic costs one store.

One program owns BLOCK_M query rows of one (batch, head); it streams key/value blocks, first the ones every
row may fully see (no mask work), then the boundary ones (causal diagonal, document edges, the ragged end).
Scores live in the log2 domain (exp2 is the hardware instruction); LSE and max logits are stored in natural
units. A row that may see no key gets O = 0, LSE = -inf, max logit = -inf, and never a NaN.

With MAX_ONLY the same kernel streams the same key blocks but keeps only the running row max: Q K^T and a
max, no exponentials, no V, no O or LSE. That is the max-logit pass of the SDPA path (kimi.ops.attention),
which gets its output from SDPA: one matmul of the attention's seven (deterministic dQ) or five (atomic).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (INTERPRET, INTERPRET_FWD, document_tables, dot_precision, dot_transposed, head_blocks,
                     key_range, last_dim_contiguous, pair_mask, pick_kernel, query_block)

LOG2E = math.log2(math.e)


@triton.jit
def _fwd_blocks(acc, l_i, m_i, q1, q2, k_base, v_base, skt, svt, offs_m, seg_q, SEG, start, end, Tq, Tk,
                DQK: tl.constexpr, DV: tl.constexpr, qk_scale,
                CAUSAL: tl.constexpr, VARLEN: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
                UPCAST: tl.constexpr, PRECISION: tl.constexpr, MAX_ONLY: tl.constexpr):
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < Tk
        qk, _, _ = dot_transposed(q1, q2, k_base, offs_n, skt, col_ok, DQK, BLOCK_D1, BLOCK_D2, UPCAST,
                                  PRECISION)
        s = qk * qk_scale
        if MASKED:
            s = tl.where(pair_mask(offs_m, offs_n, Tq, Tk, seg_q, SEG, CAUSAL, VARLEN), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if not MAX_ONLY:
            if MASKED:  # a row with no allowed key so far keeps m = -inf; subtract 0 instead of -inf - -inf
                m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            else:
                m_sub = m_new
            p = tl.exp2(s - m_sub[:, None])
            alpha = tl.exp2(m_i - m_sub)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + offs_n[:, None] * svt + offs_dv[None, :],
                        mask=col_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
            if UPCAST:
                v = v.to(tl.float32)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _fwd_kernel(Q, K, V, O, LSE, ROWMAX, SEG, DSTART, DEND,
                sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sob, sot, soh,
                H, GROUP, Tq, Tk, DQK: tl.constexpr, DV: tl.constexpr, qk_scale,
                CAUSAL: tl.constexpr, VARLEN: tl.constexpr, STORE_MAX: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
                BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
                MAX_ONLY: tl.constexpr):
    b, h, hk, m0, offs_m, row_ok = query_block(H, GROUP, Tq, BLOCK_M, CAUSAL)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    q1 = tl.load(q_base + offs_m[:, None] * sqt + offs_d1[None, :],
                 mask=row_ok[:, None] & (offs_d1 < DQK)[None, :], other=0.0)
    if UPCAST:
        q1 = q1.to(tl.float32)
    q2 = q1  # placeholder when Dqk fits one block
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_base + offs_m[:, None] * sqt + offs_d2[None, :],
                     mask=row_ok[:, None] & (offs_d2 < DQK)[None, :], other=0.0)
        if UPCAST:
            q2 = q2.to(tl.float32)
    seg_q = offs_m  # placeholder without documents
    if VARLEN:
        seg_q = tl.load(SEG + offs_m, mask=row_ok, other=-1)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    lo, full, hi = key_range(m0, offs_m, row_ok, Tq, Tk, DSTART, DEND, CAUSAL, VARLEN, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q1, q2, k_base, v_base, skt, svt, offs_m, seg_q, SEG, lo, full,
                                Tq, Tk, DQK, DV, qk_scale, CAUSAL, VARLEN, False, BLOCK_N, BLOCK_D1, BLOCK_D2,
                                BLOCK_DV, UPCAST, PRECISION, MAX_ONLY)
    acc, l_i, m_i = _fwd_blocks(acc, l_i, m_i, q1, q2, k_base, v_base, skt, svt, offs_m, seg_q, SEG, full, hi,
                                Tq, Tk, DQK, DV, qk_scale, CAUSAL, VARLEN, True, BLOCK_N, BLOCK_D1, BLOCK_D2,
                                BLOCK_DV, UPCAST, PRECISION, MAX_ONLY)
    row = (b * H + h) * Tq + offs_m
    if MAX_ONLY:
        tl.store(ROWMAX + row, m_i * 0.6931471805599453, mask=row_ok)
    else:
        seen = l_i > 0.0
        l_safe = tl.where(seen, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = O + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=row_ok[:, None] & (offs_dv < DV)[None, :])
        lse = tl.where(seen, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))  # log2 -> natural
        tl.store(LSE + row, lse, mask=row_ok)
        if STORE_MAX:
            tl.store(ROWMAX + row, m_i * 0.6931471805599453, mask=row_ok)


def _fwd_configs():
    # (BLOCK_M, BLOCK_N, warps, stages); all compile for sm_90 without register spills at 128/128 and
    # 192/128 (checked with ptxas), except 128x128, kept for smaller head dims
    shapes = [(128, 64, 8, 3), (128, 32, 8, 3), (128, 64, 8, 4), (64, 64, 4, 3), (64, 32, 4, 3),
              (128, 128, 8, 3)]
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


# STORE_MAX is not part of the key: with and without max logits run the same tiles, so the cost of asking
# for them is the store alone. MAX_ONLY is: without the P V product other tiles may win.
_fwd_tuned = triton.autotune(_fwd_configs(), key=["DQK", "DV", "GROUP", "CAUSAL", "VARLEN", "MAX_ONLY"])(
    _fwd_kernel)


def attention_forward(q, k, v, cu_seqlens, scale: float, causal: bool, return_max_logits: bool):
    """-> (o [B, Tq, H, Dv], lse [B, H, Tq] fp32, max_logits [B, H] fp32, or [0] when not asked for)."""
    q, k, v = (last_dim_contiguous(x) for x in (q, k, v))
    B, Tq, H, Dqk = q.shape
    Tk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    d1, d2, dv = head_blocks(Dqk, Dv)
    o = q.new_empty(B, Tq, H, Dv)
    lse = torch.empty(B, H, Tq, device=q.device, dtype=torch.float32)
    rowmax = torch.empty(B, H, Tq, device=q.device, dtype=torch.float32) if return_max_logits else lse
    if o.numel() == 0 or lse.numel() == 0:  # nothing to launch; empty rows follow the no-key convention
        o.zero_()
        lse.fill_(float("-inf"))
        max_logits = lse.new_full((B, H), float("-inf")) if return_max_logits else lse.new_empty(0)
        return o, lse, max_logits
    varlen = cu_seqlens is not None
    seg, dstart, dend = document_tables(cu_seqlens, Tk, q.device) if varlen else (lse, lse, lse)
    kernel, launch = pick_kernel(_fwd_kernel, _fwd_tuned, INTERPRET_FWD)

    def grid(meta):
        return (triton.cdiv(Tq, meta["BLOCK_M"]), B * H)

    kernel[grid](
        q, k, v, o, lse, rowmax, seg, dstart, dend,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        H, H // Hkv, Tq, Tk, Dqk, Dv, scale * LOG2E,
        CAUSAL=causal, VARLEN=varlen, STORE_MAX=return_max_logits,
        BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_DV=dv, UPCAST=INTERPRET, PRECISION=dot_precision(q.dtype),
        MAX_ONLY=False, **launch,
    )
    if return_max_logits:
        max_logits = rowmax.amax(dim=-1)
    else:
        max_logits = lse.new_empty(0)
    return o, lse, max_logits


def attention_max_logits(q, k, cu_seqlens, scale: float, causal: bool) -> torch.Tensor:
    """The per-(batch, head) largest scaled logit over allowed pairs, [B, H] fp32 (-inf where none is)."""
    q, k = (last_dim_contiguous(x) for x in (q, k))
    B, Tq, H, Dqk = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    rowmax = torch.empty(B, H, Tq, device=q.device, dtype=torch.float32)
    if rowmax.numel() == 0 or Tk == 0:
        return rowmax.new_full((B, H), float("-inf"))
    d1, d2, _ = head_blocks(Dqk, 16)
    varlen = cu_seqlens is not None
    seg, dstart, dend = document_tables(cu_seqlens, Tk, q.device) if varlen else (rowmax,) * 3
    kernel, launch = pick_kernel(_fwd_kernel, _fwd_tuned, INTERPRET_FWD)
    # V and O are never read or written under MAX_ONLY: k and q stand in for their pointers and strides
    kernel[lambda meta: (triton.cdiv(Tq, meta["BLOCK_M"]), B * H)](
        q, k, k, q, rowmax, rowmax, seg, dstart, dend,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        k.stride(0), k.stride(1), k.stride(2), q.stride(0), q.stride(1), q.stride(2),
        H, H // Hkv, Tq, Tk, Dqk, 16, scale * LOG2E,
        CAUSAL=causal, VARLEN=varlen, STORE_MAX=True,
        BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_DV=16, UPCAST=INTERPRET, PRECISION=dot_precision(q.dtype),
        MAX_ONLY=True, **launch,
    )
    return rowmax.amax(dim=-1)
