"""Flash-attention backward (the FlashAttention-2 scheme): P is recomputed from the saved LSE, and
delta_i = rowsum(dO_i * O_i) - dLSE_i, so dS = P * (dP - delta) with dP = dO V^T.

One program per (key block, KV head) accumulates dK and dV over the query blocks of every query head sharing
that KV head (GQA/MQA). dQ comes either from a second kernel, one program per (query block, head), which
recomputes P and dP (deterministic), or from fp32 atomic adds in the first kernel (fewer matmuls, the
default: common.DQ_ATOMIC). Rows that saw no key have LSE = -inf in the forward; here it reads as +inf so
their P is exactly 0.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (INTERPRET, INTERPRET_BWD, document_tables, dot_precision, dot_transposed, head_blocks,
                     key_range, last_dim_contiguous, pair_mask, pair_mask_t, pick_kernel, query_block)
from .forward import LOG2E


@triton.jit
def _delta_kernel(O, DO, DLSE, DELTA, sob, sot, soh, sdb, sdt, sdh, H, Tq, DV: tl.constexpr,
                  HAS_DLSE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask = (offs_m < Tq)[:, None] & (offs_dv < DV)[None, :]
    o = tl.load(O + b * sob + h * soh + offs_m[:, None] * sot + offs_dv[None, :], mask=mask, other=0.0)
    do = tl.load(DO + b * sdb + h * sdh + offs_m[:, None] * sdt + offs_dv[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = (b * H + h) * Tq + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLSE + row, mask=offs_m < Tq, other=0.0)
    tl.store(DELTA + row, delta, mask=offs_m < Tq)


@triton.jit
def _load_lse2(LSE, row, ok):
    """log2-domain LSE of rows; rows without keys (or out of range) as +inf, so exp2(s - lse) = 0."""
    lse = tl.load(LSE + row, mask=ok, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse) * 1.4426950408889634


@triton.jit
def _dkdv_blocks(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, dq_base, sqt, sdot, sdqt,
                 offs_n, seg_k, SEG, start, end, Tq, Tk, DQK: tl.constexpr, DV: tl.constexpr, qk_scale, scale,
                 CAUSAL: tl.constexpr, VARLEN: tl.constexpr, MASKED: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
                 ATOMIC_DQ: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        row_ok = offs_m < Tq
        qkt, qt1, qt2 = dot_transposed(k1, k2, q_base, offs_m, sqt, row_ok, DQK, BLOCK_D1, BLOCK_D2, UPCAST,
                                       PRECISION)
        lse2 = _load_lse2(lse_base, offs_m, row_ok)
        pt = tl.exp2(qkt * qk_scale - lse2[None, :])
        if MASKED:
            pt = tl.where(pair_mask_t(offs_n, offs_m, Tq, Tk, seg_k, SEG, CAUSAL, VARLEN), pt, 0.0)
        do = tl.load(do_base + offs_m[:, None] * sdot + offs_dv[None, :],
                     mask=row_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
        if UPCAST:
            do = do.to(tl.float32)
        dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
        dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
        delta = tl.load(delta_base + offs_m, mask=row_ok, other=0.0)
        dst = (pt * (dpt - delta[None, :])).to(qt1.dtype)
        dk1 = tl.dot(dst, tl.trans(qt1), dk1, input_precision=PRECISION)
        if BLOCK_D2 > 0:
            dk2 = tl.dot(dst, tl.trans(qt2), dk2, input_precision=PRECISION)
        if ATOMIC_DQ:  # this key block's share of dQ = dS K; keys past Tk load as 0 and add nothing
            ds = tl.trans(dst)
            dq_ptrs = dq_base + offs_m[:, None] * sdqt
            dq1 = tl.dot(ds, k1, input_precision=PRECISION) * scale
            tl.atomic_add(dq_ptrs + offs_d1[None, :], dq1, mask=row_ok[:, None] & (offs_d1 < DQK)[None, :],
                          sem="relaxed")
            if BLOCK_D2 > 0:
                offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
                dq2 = tl.dot(ds, k2, input_precision=PRECISION) * scale
                tl.atomic_add(dq_ptrs + offs_d2[None, :], dq2,
                              mask=row_ok[:, None] & (offs_d2 < DQK)[None, :], sem="relaxed")
    return dk1, dk2, dv


@triton.jit
def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DVO, DQACC, SEG, DSTART, DEND,
                 sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh,
                 sdkb, sdkt, sdkh, sdvb, sdvt, sdvh, sdqb, sdqt, sdqh,
                 H, GROUP, Tq, Tk, DQK: tl.constexpr, DV: tl.constexpr, qk_scale, scale,
                 CAUSAL: tl.constexpr, VARLEN: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
                 BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_bk = tl.program_id(1)
    Hkv = H // GROUP
    b = (pid_bk // Hkv).to(tl.int64)
    hk = (pid_bk % Hkv).to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    col_ok = offs_n < Tk
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = K + b * skb + hk * skh
    k1 = tl.load(k_base + offs_n[:, None] * skt + offs_d1[None, :],
                 mask=col_ok[:, None] & (offs_d1 < DQK)[None, :], other=0.0)
    if UPCAST:
        k1 = k1.to(tl.float32)
    k2 = k1
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        k2 = tl.load(k_base + offs_n[:, None] * skt + offs_d2[None, :],
                     mask=col_ok[:, None] & (offs_d2 < DQK)[None, :], other=0.0)
        if UPCAST:
            k2 = k2.to(tl.float32)
    v = tl.load(V + b * svb + hk * svh + offs_n[:, None] * svt + offs_dv[None, :],
                mask=col_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    seg_k = offs_n
    zero = tl.zeros([], tl.int32)
    # Query rows [lo, hi) may see this key block; rows [mid, tail) see all of it (no mask work); with
    # documents, rows past tail would reach into the next document, so whole blocks only.
    if VARLEN:
        seg_k = tl.load(SEG + offs_n, mask=col_ok, other=-2)
        starts = tl.load(DSTART + offs_n, mask=col_ok, other=Tk)
        lo = zero + tl.min(starts, 0)
        hi = zero + tl.max(tl.load(DEND + offs_n, mask=col_ok, other=0), 0)
        one_doc = lo == tl.max(tl.where(col_ok, starts, 0), 0)
        need = lo
        if CAUSAL:
            lo = tl.maximum(lo, n0)
            need = zero + n0 + BLOCK_N - 1  # first row that sees the block's last key
        mid = tl.where(one_doc, tl.minimum(lo + tl.cdiv(tl.maximum(need - lo, 0), BLOCK_M) * BLOCK_M, hi), hi)
        tail = mid + (hi - mid) // BLOCK_M * BLOCK_M
    else:
        hi = zero + Tq
        if CAUSAL:
            offset = Tk - Tq
            lo = tl.maximum(zero + n0 - offset, 0)
            need = n0 + BLOCK_N - 1 - offset  # first row that sees the block's last key
            mid = tl.minimum(lo + tl.cdiv(tl.maximum(need - lo, 0), BLOCK_M) * BLOCK_M, Tq)
        else:
            lo = zero
            mid = zero
        tail = hi  # rows past Tq load as no-ops (q = dO = 0, LSE = +inf)

    dk1 = tl.zeros([BLOCK_N, BLOCK_D1], tl.float32)
    dk2 = dk1  # placeholder when Dqk fits one block
    if BLOCK_D2 > 0:
        dk2 = tl.zeros([BLOCK_N, BLOCK_D2], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)
    for g in range(GROUP):
        h = hk * GROUP + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        lse_base = LSE + (b * H + h) * Tq
        delta_base = DELTA + (b * H + h) * Tq
        dq_base = DQACC + b * sdqb + h * sdqh
        dk1, dk2, dv = _dkdv_blocks(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, dq_base,
                                    sqt, sdot, sdqt, offs_n, seg_k, SEG, lo, mid, Tq, Tk, DQK, DV, qk_scale,
                                    scale, CAUSAL, VARLEN, True, BLOCK_M, BLOCK_D1, BLOCK_D2, BLOCK_DV,
                                    ATOMIC_DQ, UPCAST, PRECISION)
        dk1, dk2, dv = _dkdv_blocks(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base, dq_base,
                                    sqt, sdot, sdqt, offs_n, seg_k, SEG, mid, tail, Tq, Tk, DQK, DV, qk_scale,
                                    scale, CAUSAL, VARLEN, False, BLOCK_M, BLOCK_D1, BLOCK_D2, BLOCK_DV,
                                    ATOMIC_DQ, UPCAST, PRECISION)
        if VARLEN:
            dk1, dk2, dv = _dkdv_blocks(dk1, dk2, dv, k1, k2, v, q_base, do_base, lse_base, delta_base,
                                        dq_base, sqt, sdot, sdqt, offs_n, seg_k, SEG, tail, hi, Tq, Tk, DQK,
                                        DV, qk_scale, scale, CAUSAL, VARLEN, True, BLOCK_M, BLOCK_D1,
                                        BLOCK_D2, BLOCK_DV, ATOMIC_DQ, UPCAST, PRECISION)

    dk_base = DK + b * sdkb + hk * sdkh + offs_n[:, None] * sdkt
    tl.store(dk_base + offs_d1[None, :], (dk1 * scale).to(DK.dtype.element_ty),
             mask=col_ok[:, None] & (offs_d1 < DQK)[None, :])
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        tl.store(dk_base + offs_d2[None, :], (dk2 * scale).to(DK.dtype.element_ty),
                 mask=col_ok[:, None] & (offs_d2 < DQK)[None, :])
    tl.store(DVO + b * sdvb + hk * sdvh + offs_n[:, None] * sdvt + offs_dv[None, :],
             dv.to(DVO.dtype.element_ty), mask=col_ok[:, None] & (offs_dv < DV)[None, :])


@triton.jit
def _dq_blocks(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, skt, svt, offs_m, seg_q, SEG, start, end,
               Tq, Tk, DQK: tl.constexpr, DV: tl.constexpr, qk_scale,
               CAUSAL: tl.constexpr, VARLEN: tl.constexpr, MASKED: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
               UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    offs_dv = tl.arange(0, BLOCK_DV)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        col_ok = offs_n < Tk
        qk, kt1, kt2 = dot_transposed(q1, q2, k_base, offs_n, skt, col_ok, DQK, BLOCK_D1, BLOCK_D2, UPCAST,
                                      PRECISION)
        p = tl.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            p = tl.where(pair_mask(offs_m, offs_n, Tq, Tk, seg_q, SEG, CAUSAL, VARLEN), p, 0.0)
        vt = tl.load(v_base + offs_n[None, :] * svt + offs_dv[:, None],
                     mask=col_ok[None, :] & (offs_dv < DV)[:, None], other=0.0)
        if UPCAST:
            vt = vt.to(tl.float32)
        dp = tl.dot(do, vt, input_precision=PRECISION)
        ds = (p * (dp - delta[:, None])).to(kt1.dtype)
        dq1 = tl.dot(ds, tl.trans(kt1), dq1, input_precision=PRECISION)
        if BLOCK_D2 > 0:
            dq2 = tl.dot(ds, tl.trans(kt2), dq2, input_precision=PRECISION)
    return dq1, dq2


@triton.jit
def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, SEG, DSTART, DEND,
               sqb, sqt, sqh, skb, skt, skh, svb, svt, svh, sdob, sdot, sdoh, sdqb, sdqt, sdqh,
               H, GROUP, Tq, Tk, DQK: tl.constexpr, DV: tl.constexpr, qk_scale, scale,
               CAUSAL: tl.constexpr, VARLEN: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
               BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
    b, h, hk, m0, offs_m, row_ok = query_block(H, GROUP, Tq, BLOCK_M, CAUSAL)
    offs_d1 = tl.arange(0, BLOCK_D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    q_base = Q + b * sqb + h * sqh + offs_m[:, None] * sqt
    q1 = tl.load(q_base + offs_d1[None, :], mask=row_ok[:, None] & (offs_d1 < DQK)[None, :], other=0.0)
    if UPCAST:
        q1 = q1.to(tl.float32)
    q2 = q1
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        q2 = tl.load(q_base + offs_d2[None, :], mask=row_ok[:, None] & (offs_d2 < DQK)[None, :], other=0.0)
        if UPCAST:
            q2 = q2.to(tl.float32)
    do = tl.load(DO + b * sdob + h * sdoh + offs_m[:, None] * sdot + offs_dv[None, :],
                 mask=row_ok[:, None] & (offs_dv < DV)[None, :], other=0.0)
    if UPCAST:
        do = do.to(tl.float32)
    row = (b * H + h) * Tq + offs_m
    lse2 = _load_lse2(LSE, row, row_ok)
    delta = tl.load(DELTA + row, mask=row_ok, other=0.0)
    seg_q = offs_m
    if VARLEN:
        seg_q = tl.load(SEG + offs_m, mask=row_ok, other=-1)

    dq1 = tl.zeros([BLOCK_M, BLOCK_D1], tl.float32)
    dq2 = dq1
    if BLOCK_D2 > 0:
        dq2 = tl.zeros([BLOCK_M, BLOCK_D2], tl.float32)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    lo, full, hi = key_range(m0, offs_m, row_ok, Tq, Tk, DSTART, DEND, CAUSAL, VARLEN, BLOCK_M, BLOCK_N)
    dq1, dq2 = _dq_blocks(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, skt, svt, offs_m, seg_q, SEG, lo,
                          full, Tq, Tk, DQK, DV, qk_scale, CAUSAL, VARLEN, False, BLOCK_N, BLOCK_D1, BLOCK_D2,
                          BLOCK_DV, UPCAST, PRECISION)
    dq1, dq2 = _dq_blocks(dq1, dq2, q1, q2, do, lse2, delta, k_base, v_base, skt, svt, offs_m, seg_q, SEG,
                          full, hi, Tq, Tk, DQK, DV, qk_scale, CAUSAL, VARLEN, True, BLOCK_N, BLOCK_D1,
                          BLOCK_D2, BLOCK_DV, UPCAST, PRECISION)

    dq_base = DQ + b * sdqb + h * sdqh + offs_m[:, None] * sdqt
    tl.store(dq_base + offs_d1[None, :], (dq1 * scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None] & (offs_d1 < DQK)[None, :])
    if BLOCK_D2 > 0:
        offs_d2 = BLOCK_D1 + tl.arange(0, BLOCK_D2)
        tl.store(dq_base + offs_d2[None, :], (dq2 * scale).to(DQ.dtype.element_ty),
                 mask=row_ok[:, None] & (offs_d2 < DQK)[None, :])


def _configs(shapes):
    return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s) for m, n, w, s in shapes]


# (BLOCK_M, BLOCK_N, warps, stages), chosen so that each head-dim pair (128/128, 192/128) has several that
# compile for sm_90 without register spills (checked with ptxas); the dK, dV accumulators are the register
# hogs, BLOCK_N * (Dqk + Dv) fp32 values per program. The first of each list is the untuned default.
_KEY = ["DQK", "DV", "GROUP", "CAUSAL", "VARLEN"]
_DKDV_SHAPES = [(16, 128, 8, 2), (32, 128, 8, 2), (16, 64, 8, 2), (32, 64, 8, 2), (16, 128, 8, 3),
                (16, 32, 4, 2)]
_DQ_SHAPES = [(128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 4, 3), (64, 32, 4, 3), (64, 64, 8, 2)]
_dkdv_tuned = triton.autotune(_configs(_DKDV_SHAPES), key=_KEY)(_dkdv_kernel)
# timing a candidate adds into the dQ buffer, so it is zeroed before each
_dkdv_atomic_tuned = triton.autotune(_configs(_DKDV_SHAPES), key=_KEY, reset_to_zero=["DQACC"])(_dkdv_kernel)
_dq_tuned = triton.autotune(_configs(_DQ_SHAPES), key=_KEY)(_dq_kernel)


def attention_backward(do, dlse, q, k, v, o, lse, cu_seqlens, scale: float, causal: bool, atomic: bool):
    """-> (dq, dk, dv) in the dtypes of q, k, v. dlse (or None) is the gradient of the LSE output; atomic: dQ
    from fp32 atomic adds in the dK/dV kernel, else from its own deterministic kernel."""
    q, k, v, o, do = (last_dim_contiguous(x) for x in (q, k, v, o, do))
    B, Tq, H, Dqk = q.shape
    Tk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    d1, d2, dv_block = head_blocks(Dqk, Dv)
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = torch.empty_like(lse)
    has_dlse = dlse is not None
    dlse = dlse.contiguous() if has_dlse else lse
    block = 64
    _delta_kernel[(triton.cdiv(Tq, block), B * H)](
        o, do, dlse, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        H, Tq, Dv, HAS_DLSE=has_dlse, BLOCK_M=block, BLOCK_DV=dv_block,
    )
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    varlen = cu_seqlens is not None
    seg, dstart, dend = document_tables(cu_seqlens, Tk, q.device) if varlen else (lse, lse, lse)
    common = dict(CAUSAL=causal, VARLEN=varlen, BLOCK_D1=d1, BLOCK_D2=d2, BLOCK_DV=dv_block, UPCAST=INTERPRET,
                  PRECISION=dot_precision(q.dtype))
    strides = [*q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3]]
    dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32) if atomic else dq
    kernel, launch = pick_kernel(_dkdv_kernel, _dkdv_atomic_tuned if atomic else _dkdv_tuned, INTERPRET_BWD)
    kernel[lambda meta: (triton.cdiv(Tk, meta["BLOCK_N"]), B * Hkv)](
        q, k, v, do, lse, delta, dk, dv, dq_acc, seg, dstart, dend, *strides, *dk.stride()[:3],
        *dv.stride()[:3], *dq_acc.stride()[:3], H, H // Hkv, Tq, Tk, Dqk, Dv, scale * LOG2E, scale,
        ATOMIC_DQ=atomic, **common, **launch,
    )
    if atomic:
        return dq_acc.to(q.dtype), dk, dv
    kernel, launch = pick_kernel(_dq_kernel, _dq_tuned, INTERPRET_BWD)
    kernel[lambda meta: (triton.cdiv(Tq, meta["BLOCK_M"]), B * H)](
        q, k, v, do, lse, delta, dq, seg, dstart, dend, *strides, *dq.stride()[:3],
        H, H // Hkv, Tq, Tk, Dqk, Dv, scale * LOG2E, scale, **common, **launch,
    )
    return dq, dk, dv
