"""Chunkwise KDA forward in Triton (docs/algorithms.md section 1.3), as five launches:

1. `chunk_cumsum`: G, the in-chunk cumulative log-decay.
2. `scores_kernel`, per chunk: L[t, s] = sum_d k_t k_s exp(G_t - G_s) (s < t) and
   A_qk[t, s] = sum_d q_t k_s exp(G_t - G_s) (s <= t). Pairs in different 16-token sub-chunks are matmuls
   anchored at the first row a of t's sub-chunk, exp(G_t - G_s) = exp(G_t - G_a) exp(G_a - G_s), both
   factors <= 1; pairs inside one sub-chunk come from a [t, s, d] tile of G_t - G_s set to -inf where
   s > t before exponentiating (the tokens layout: a [t, d] tile per key token s). No exponential of a
   positive number is ever taken (padded rows included, see common.load_G), so any gate strength is safe in
   fp32.
3. `solve_kernel`, per chunk: (I + Diag(beta) L)^-1 by forward substitution on the four 16 x 16 diagonal
   blocks, then block substitution for the rest; and `wu_kernel`: W = M (exp(G) K), U = M V with
   M = (I + Diag(beta) L)^-1 Diag(beta).
   The same pass stores KG = exp(G_C - G) K, the keys decayed to the chunk's end.
4. `state_kernel`, per (sequence, head, value block): the only sequential pass, chunk by chunk:
   V_new = U - W S, S <- Diag(exp(G_C)) S + KG^T V_new. Stores every entering state.
5. `output_kernel`, per chunk: O = (Q exp(G)) S + A_qk V_new.

The backward (chunk_bwd.py) reruns 1-4 rather than keeping their outputs from the forward.
"""

import torch
import triton
import triton.language as tl

from .common import (CHUNK, SCORES_GRID, SUB, check_head_dims, chunk_bounds, chunk_cumsum, dot_precision,
                     key_token, load_G, load_G_row, load_rows, mm, scratch, state_block, state_program,
                     tiles)


@triton.jit
def scores_kernel(q, k, Gc, L, Aqk, cu_seqlens, chunks, scale, H, K: tl.constexpr, BK: tl.constexpr,
                  BKD: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                  BOUNDED: tl.constexpr, PREC_D: tl.constexpr, SPLIT: tl.constexpr, TOKENS: tl.constexpr):
    """BOUNDED: every gate is >= -80 / BC (kimi.ops.kda.chunk.bounded), so G falls by at most 80 inside a
    sub-chunk and the diagonal blocks are anchored matmuls too, exp(G_a - G_s) <= e^80 being finite in fp32.
    Their products take PREC_D, fp32's precision: the diagonal's q_t k_t terms enter dq and dk and cancel in
    dg only if they are not rounded to half precision (bf16 operands there made dg 40x less accurate).
    SPLIT: one program per (chunk, head, sub-chunk), grid (NT, H, C // BC); otherwise one per (chunk, head)
    walking its sub-chunks in turn (common.scores_grid). TOKENS (split too): every product over slices of
    BKD key channels and the general diagonal block one key token at a time (_scores_rows_by_slice)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    t0, last = chunk_bounds(cu_seqlens, chunks, i_c, C)
    if TOKENS:
        _scores_rows_by_slice(q, k, Gc, L, Aqk, t0, last, h, H, tl.program_id(2), scale, K, BK, BKD, C, BC,
                              PREC, BOUNDED, PREC_D)
    elif SPLIT:
        _scores_rows(q, k, Gc, L, Aqk, t0, last, h, H, tl.program_id(2), scale, K, BK, BKD, C, BC, PREC,
                     BOUNDED, PREC_D, SPLIT)
    else:
        for i in tl.static_range(C // BC):
            _scores_rows(q, k, Gc, L, Aqk, t0, last, h, H, i, scale, K, BK, BKD, C, BC, PREC, BOUNDED, PREC_D,
                         SPLIT)


@triton.jit
def _scores_rows(q, k, Gc, L, Aqk, t0, last, h, H, i, scale, K: tl.constexpr, BK: tl.constexpr,
                 BKD: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                 BOUNDED: tl.constexpr, PREC_D: tl.constexpr, SPLIT: tl.constexpr):
    """scores_kernel's work for sub-chunk i: its rows of L and A_qk, all C columns."""
    ck = tl.arange(0, BK)
    mk = ck < K
    o = tl.arange(0, BC)
    rows = t0 + i * BC + o
    q_i = load_rows(q, rows, last, h, H, ck, K, mk) * scale
    k_i = load_rows(k, rows, last, h, H, ck, K, mk)
    G_i = load_G(Gc, rows, last, h, H, ck, K, mk)
    out_mask = (rows <= last)[:, None] & (o < BC)[None, :]
    out_ptr = (rows[:, None] * H + h) * C + o[None, :]
    # Split layouts take the diagonal block first, so the rows' q, k and G are free before the anchored
    # ones are formed (at 4 warps, 168 registers on sm_90 against 192 in the other order); the serial
    # layout keeps the other order, which spills less there (its bounded form 112 B in this one).
    if SPLIT:
        _diagonal(q, k, Gc, L, Aqk, rows, out_ptr, out_mask, t0 + i * BC, last, h, H, i, scale, K, BK, BKD,
                  BC, PREC_D, BOUNDED)
    G_a = load_G_row(Gc, t0 + i * BC, last, h, H, ck, K, mk)
    to_anchor = tl.exp(G_i - G_a[None, :])
    qa, ka = q_i * to_anchor, k_i * to_anchor
    for j in range(0, i):
        cols = t0 + j * BC + o
        from_anchor = tl.exp(G_a[None, :] - load_G(Gc, cols, last, h, H, ck, K, mk))
        k_j = load_rows(k, cols, last, h, H, ck, K, mk) * from_anchor
        k_jT = tl.trans(k_j)
        tl.store(L + out_ptr + j * BC, mm(ka, k_jT, PREC), mask=out_mask)
        tl.store(Aqk + out_ptr + j * BC, mm(qa, k_jT, PREC), mask=out_mask)
    if not SPLIT:
        _diagonal(q, k, Gc, L, Aqk, rows, out_ptr, out_mask, t0 + i * BC, last, h, H, i, scale, K, BK, BKD,
                  BC, PREC_D, BOUNDED)
    _store_zeros_right(L, Aqk, out_ptr, out_mask, i, C, BC)


@triton.jit
def _diagonal(q, k, Gc, L, Aqk, rows, out_ptr, out_mask, a, last, h, H, i, scale, K: tl.constexpr,
              BK: tl.constexpr, BKD: tl.constexpr, BC: tl.constexpr, PREC_D: tl.constexpr,
              BOUNDED: tl.constexpr):
    """Sub-chunk i's diagonal block of L (strictly lower) and A_qk (lower), computed and stored."""
    b_kk, b_qk = _diagonal_by_slice(q, k, Gc, rows, a, last, h, H, scale, K, BK, BKD, BC, PREC_D, BOUNDED)
    _store_diagonal(L, Aqk, b_kk, b_qk, out_ptr + i * BC, out_mask, BC)


@triton.jit
def _store_diagonal(L, Aqk, b_kk, b_qk, ptr, mask, BC: tl.constexpr):
    o = tl.arange(0, BC)
    tl.store(L + ptr, tl.where(o[:, None] > o[None, :], b_kk, 0.0), mask=mask)
    tl.store(Aqk + ptr, tl.where(o[:, None] >= o[None, :], b_qk, 0.0), mask=mask)


@triton.jit
def _store_zeros_right(L, Aqk, ptr, mask, i, C: tl.constexpr, BC: tl.constexpr):
    """The blocks right of sub-chunk i's diagonal (s > t): zero, written so the buffers need no memset."""
    for j in range(i + 1, C // BC):
        tl.store(L + ptr + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=mask)
        tl.store(Aqk + ptr + j * BC, tl.zeros([BC, BC], dtype=tl.float32), mask=mask)


@triton.jit
def _scores_rows_by_slice(q, k, Gc, L, Aqk, t0, last, h, H, i, scale, K: tl.constexpr, BK: tl.constexpr,
                          BKD: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                          BOUNDED: tl.constexpr, PREC_D: tl.constexpr):
    """The tokens layout's work for sub-chunk i, the sums of _scores_rows with only [BC, BKD] tiles live:
    each block's product accumulates over slices of BKD key channels (the rows' slices reread for each
    earlier sub-chunk j, from cache), and the general diagonal block takes one key token at a time."""
    o = tl.arange(0, BC)
    a = t0 + i * BC
    rows = a + o
    out_mask = (rows <= last)[:, None] & (o < BC)[None, :]
    out_ptr = (rows[:, None] * H + h) * C + o[None, :]
    if BOUNDED:
        b_kk, b_qk = _diagonal_by_slice(q, k, Gc, rows, a, last, h, H, scale, K, BK, BKD, BC, PREC_D, BOUNDED)
    else:
        b_kk = tl.zeros([BC, BC], dtype=tl.float32)
        b_qk = tl.zeros([BC, BC], dtype=tl.float32)
        for d0 in range(0, BK, BKD):
            cd = d0 + tl.arange(0, BKD)
            md = cd < K
            kk, qk = _diagonal_by_token(load_rows(q, rows, last, h, H, cd, K, md) * scale,
                                        load_rows(k, rows, last, h, H, cd, K, md),
                                        load_G(Gc, rows, last, h, H, cd, K, md), k, Gc, a, last, h, H, cd, K,
                                        md, BC)
            b_kk += kk
            b_qk += qk
    _store_diagonal(L, Aqk, b_kk, b_qk, out_ptr + i * BC, out_mask, BC)
    for j in range(0, i):  # earlier sub-chunks, anchored at a as in _scores_rows
        cols = t0 + j * BC + o
        b_kk = tl.zeros([BC, BC], dtype=tl.float32)
        b_qk = tl.zeros([BC, BC], dtype=tl.float32)
        for d0 in range(0, BK, BKD):
            cd = d0 + tl.arange(0, BKD)
            md = cd < K
            G_ad = load_G_row(Gc, a, last, h, H, cd, K, md)
            to_anchor = tl.exp(load_G(Gc, rows, last, h, H, cd, K, md) - G_ad[None, :])
            k_jT = tl.trans(load_rows(k, cols, last, h, H, cd, K, md)
                            * tl.exp(G_ad[None, :] - load_G(Gc, cols, last, h, H, cd, K, md)))
            b_kk += mm(load_rows(k, rows, last, h, H, cd, K, md) * to_anchor, k_jT, PREC)
            b_qk += mm(load_rows(q, rows, last, h, H, cd, K, md) * scale * to_anchor, k_jT, PREC)
        tl.store(L + out_ptr + j * BC, b_kk, mask=out_mask)
        tl.store(Aqk + out_ptr + j * BC, b_qk, mask=out_mask)
    _store_zeros_right(L, Aqk, out_ptr, out_mask, i, C, BC)


@triton.jit
def _diagonal_by_slice(q, k, Gc, rows, a, last, h, H, scale, K: tl.constexpr, BK: tl.constexpr,
                       BKD: tl.constexpr, BC: tl.constexpr, PREC_D: tl.constexpr, BOUNDED: tl.constexpr):
    """The diagonal block of L and A_qk (rows a .. a + BC - 1), a slice of BKD key channels at a time
    (bounding the tiles live beside the rows): anchored matmuls when BOUNDED, else [t, s, d] tiles of the
    decays, the exponent set to -inf where s > t before exponentiating."""
    o = tl.arange(0, BC)
    causal = (o[:, None] >= o[None, :])[:, :, None]
    b_kk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qk = tl.zeros([BC, BC], dtype=tl.float32)
    for d0 in range(0, BK, BKD):
        cd = d0 + tl.arange(0, BKD)
        md = cd < K
        q_d = load_rows(q, rows, last, h, H, cd, K, md) * scale
        k_d = load_rows(k, rows, last, h, H, cd, K, md)
        G_d = load_G(Gc, rows, last, h, H, cd, K, md)
        if BOUNDED:  # one more anchored matmul; the pairs s > t are masked after it
            G_ad = load_G_row(Gc, a, last, h, H, cd, K, md)
            to_a = tl.exp(G_d - G_ad[None, :])
            k_aT = tl.trans(k_d * tl.exp(G_ad[None, :] - G_d))
            b_kk += mm(k_d * to_a, k_aT, PREC_D)
            b_qk += mm(q_d * to_a, k_aT, PREC_D)
        else:
            decay = tl.exp(tl.where(causal, G_d[:, None, :] - G_d[None, :, :], float("-inf")))
            k_decayed = decay * k_d[None, :, :]
            b_kk += tl.sum(k_d[:, None, :] * k_decayed, axis=2)
            b_qk += tl.sum(q_d[:, None, :] * k_decayed, axis=2)
    return b_kk, b_qk


@triton.jit
def _diagonal_by_token(q_i, k_i, G_i, k, Gc, a, last, h, H, ck, K, mk, BC: tl.constexpr):
    """The diagonal block of L and A_qk (rows a .. a + BC - 1; q_i, k_i, G_i their [BC, D] tiles of the key
    channels ck) one key token s at a time: column s is sum_d x_t k_s exp(G_t - G_s) over t >= s, a
    [BC, D] tile whose exponent is set to -inf where t < s before exponentiating, as in the [t, s, d]
    form. Those tiles ([BC, BC, BKD], several alive at once) held most of the kernel's registers; this
    holds one tile more than the rows, for BC short steps (the order fla-core's intra-chunk kernels take
    too)."""
    o = tl.arange(0, BC)
    b_kk = tl.zeros([BC, BC], dtype=tl.float32)
    b_qk = tl.zeros([BC, BC], dtype=tl.float32)
    for s in range(0, BC):
        k_s, e = key_token(k, Gc, G_i, a, s, last, h, H, ck, K, mk, BC)
        ke = e * k_s[None, :]
        column = o[None, :] == s
        b_kk += tl.where(column, tl.sum(k_i * ke, axis=1)[:, None], 0.0)
        b_qk += tl.where(column, tl.sum(q_i * ke, axis=1)[:, None], 0.0)
    return b_kk, b_qk


@triton.jit
def _load_block(A, t0, last, i, j, h, H, C: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    rows = t0 + i * BC + o
    m = (rows <= last)[:, None] & (o < BC)[None, :]
    return tl.load(A + (rows[:, None] * H + h) * C + j * BC + o[None, :], mask=m, other=0)


@triton.jit
def _store_block(A, x, t0, last, i, j, h, H, C: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    rows = t0 + i * BC + o
    m = (rows <= last)[:, None] & (o < BC)[None, :]
    tl.store(A + (rows[:, None] * H + h) * C + j * BC + o[None, :], x, mask=m)


@triton.jit
def _beta_block(L, beta, t0, last, i, j, h, H, C: tl.constexpr, BC: tl.constexpr):
    """Diag(beta) L, block (i, j)."""
    rows = t0 + i * BC + tl.arange(0, BC)
    b = tl.load(beta + rows * H + h, mask=rows <= last, other=0).to(tl.float32)
    return b[:, None] * _load_block(L, t0, last, i, j, h, H, C, BC)


@triton.jit
def solve_kernel(L, beta, Ainv, cu_seqlens, chunks, H, C: tl.constexpr, BC: tl.constexpr):
    """Ainv = (I + StrictLower(Diag(beta) L))^-1 for C = 4 BC.

    The four diagonal blocks are inverted together ([4, BC, BC]) by forward substitution, row r at a time:
    X_r = e_r - sum_{c < r} A[r, c] X_c, rows c < r of X being final. Then block (i, j < i) of the inverse
    is -D_i sum_{j <= m < i} A_im Ainv_mj, D_i the inverted diagonal blocks (solving (I + A) X = I one
    block row down)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    t0, last = chunk_bounds(cu_seqlens, chunks, i_c, C)
    nb = tl.arange(0, C // BC)[:, None, None]
    r = tl.arange(0, BC)
    rows = t0 + nb * BC + r[None, :, None]
    cols = nb * BC + r[None, None, :]
    valid = (rows <= last) & (cols >= 0)
    b = tl.load(beta + rows * H + h, mask=rows <= last, other=0).to(tl.float32)
    A = b * tl.load(L + (rows * H + h) * C + cols, mask=valid, other=0)
    identity = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
    X = tl.zeros([C // BC, BC, BC], dtype=tl.float32) + identity[None, :, :]
    for i in range(1, BC):
        at_i = r[None, :, None] == i
        a_i = tl.sum(tl.where(at_i, A, 0.0), axis=1)
        X = tl.where(at_i, X - tl.sum(a_i[:, :, None] * X, axis=1)[:, None, :], X)
    tl.store(Ainv + (rows * H + h) * C + cols, X.to(Ainv.dtype.element_ty), mask=valid)
    # The diagonal blocks feed the block substitution from registers, in fp32, whatever Ainv stores.
    D0 = tl.sum(tl.where(nb == 0, X, 0.0), axis=0)
    D1 = tl.sum(tl.where(nb == 1, X, 0.0), axis=0)
    D2 = tl.sum(tl.where(nb == 2, X, 0.0), axis=0)
    D3 = tl.sum(tl.where(nb == 3, X, 0.0), axis=0)
    A10 = _beta_block(L, beta, t0, last, 1, 0, h, H, C, BC)
    A20 = _beta_block(L, beta, t0, last, 2, 0, h, H, C, BC)
    A21 = _beta_block(L, beta, t0, last, 2, 1, h, H, C, BC)
    A30 = _beta_block(L, beta, t0, last, 3, 0, h, H, C, BC)
    A31 = _beta_block(L, beta, t0, last, 3, 1, h, H, C, BC)
    A32 = _beta_block(L, beta, t0, last, 3, 2, h, H, C, BC)
    X10 = -mm(D1, mm(A10, D0, 0), 0)
    X21 = -mm(D2, mm(A21, D1, 0), 0)
    X32 = -mm(D3, mm(A32, D2, 0), 0)
    X20 = -mm(D2, mm(A20, D0, 0) + mm(A21, X10, 0), 0)
    X31 = -mm(D3, mm(A31, D1, 0) + mm(A32, X21, 0), 0)
    X30 = -mm(D3, mm(A30, D0, 0) + mm(A31, X10, 0) + mm(A32, X20, 0), 0)
    out_ty = Ainv.dtype.element_ty
    _store_block(Ainv, X10.to(out_ty), t0, last, 1, 0, h, H, C, BC)
    _store_block(Ainv, X20.to(out_ty), t0, last, 2, 0, h, H, C, BC)
    _store_block(Ainv, X21.to(out_ty), t0, last, 2, 1, h, H, C, BC)
    _store_block(Ainv, X30.to(out_ty), t0, last, 3, 0, h, H, C, BC)
    _store_block(Ainv, X31.to(out_ty), t0, last, 3, 1, h, H, C, BC)
    _store_block(Ainv, X32.to(out_ty), t0, last, 3, 2, h, H, C, BC)
    for i in tl.static_range(C // BC):
        for j in tl.static_range(i + 1, C // BC):
            _store_block(Ainv, tl.zeros([BC, BC], dtype=out_ty), t0, last, i, j, h, H, C, BC)


@triton.jit
def load_square(A, t0, last, h, H, C: tl.constexpr):
    """A chunk's [C, C] block of a [T, H, C] buffer (rows past the end read 0)."""
    o = tl.arange(0, C)
    rows = t0 + o
    return tl.load(A + (rows[:, None] * H + h) * C + o[None, :], mask=(rows <= last)[:, None], other=0)


@triton.jit
def wu_kernel(q, k, v, beta, Gc, Ainv, W, U, KG, QG, cu_seqlens, chunks, scale, H, K: tl.constexpr,
              V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, WITH_QG: tl.constexpr,
              PREC: tl.constexpr):
    """W = Ainv Diag(beta) (exp(G) K), U = Ainv Diag(beta) V, KG = exp(G_C - G) K (keys decayed to the
    chunk's end: the state write) and, for the backward, QG = scale exp(G) Q (the state read)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    t0, last = chunk_bounds(cu_seqlens, chunks, i_c, C)
    rows = t0 + tl.arange(0, C)
    valid = rows <= last
    A = load_square(Ainv, t0, last, h, H, C)
    b = tl.load(beta + rows * H + h, mask=valid, other=0).to(tl.float32)
    ck = tl.arange(0, BK)
    mk = ck < K
    out_k = (rows[:, None] * H + h) * K + ck[None, :]
    mask_k = valid[:, None] & mk[None, :]
    G = load_G(Gc, rows, last, h, H, ck, K, mk)
    b_k = load_rows(k, rows, last, h, H, ck, K, mk)
    tl.store(W + out_k, mm(A, b_k * tl.exp(G) * b[:, None], PREC).to(W.dtype.element_ty), mask=mask_k)
    G_last = load_G_row(Gc, last, last, h, H, ck, K, mk)
    tl.store(KG + out_k, (b_k * tl.exp(G_last[None, :] - G)).to(KG.dtype.element_ty), mask=mask_k)
    if WITH_QG:
        b_q = load_rows(q, rows, last, h, H, ck, K, mk)
        tl.store(QG + out_k, (b_q * scale * tl.exp(G)).to(QG.dtype.element_ty), mask=mask_k)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = cv < V
        b_v = load_rows(v, rows, last, h, H, cv, V, mv)
        tl.store(U + (rows[:, None] * H + h) * V + cv[None, :],
                 mm(A, b_v * b[:, None], PREC).to(U.dtype.element_ty), mask=valid[:, None] & mv[None, :])


@triton.jit
def state_kernel(KG, Gc, W, U, h0, Hs, VN, ht, cu_seqlens, first_chunk, H, K: tl.constexpr, V: tl.constexpr,
                 BK: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr, HAS_INIT: tl.constexpr,
                 PREC: tl.constexpr):
    n, h, bos, eos, c0, ck, cv, mk, mv, state_off, state_mask, state = state_program(
        h0, cu_seqlens, first_chunk, H, K, V, BK, BVS, HAS_INIT)
    for c in range(tl.cdiv(eos - bos, C)):
        t0 = bos + c * C
        last = tl.minimum(t0 + C, eos) - 1
        rows = t0 + tl.arange(0, C)
        tl.store(Hs + ((c0 + c) * H + h) * K * V + state_off, state.to(Hs.dtype.element_ty), mask=state_mask)
        v_new = load_rows(U, rows, last, h, H, cv, V, mv) - mm(load_rows(W, rows, last, h, H, ck, K, mk),
                                                               state, PREC)
        tl.store(VN + (rows[:, None] * H + h) * V + cv[None, :], v_new.to(VN.dtype.element_ty),
                 mask=(rows <= last)[:, None] & mv[None, :])
        G_last = load_G_row(Gc, last, last, h, H, ck, K, mk)
        state = state * tl.exp(G_last)[:, None] + mm(tl.trans(load_rows(KG, rows, last, h, H, ck, K, mk)),
                                                     v_new, PREC)
    tl.store(ht + (n * H + h).to(tl.int64) * K * V + state_off, state, mask=state_mask)


@triton.jit
def output_kernel(q, Gc, Aqk, Hs, VN, o, cu_seqlens, chunks, scale, H, K: tl.constexpr, V: tl.constexpr,
                  BK: tl.constexpr, BV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr):
    i_c, h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    t0, last = chunk_bounds(cu_seqlens, chunks, i_c, C)
    rows = t0 + tl.arange(0, C)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    decay = tl.exp(load_G(Gc, rows, last, h, H, ck, K, mk))
    q_decayed = load_rows(q, rows, last, h, H, ck, K, mk) * scale * decay
    state = tl.load(Hs + (i_c * H + h).to(tl.int64) * K * V + ck[:, None] * V + cv[None, :],
                    mask=mk[:, None] & mv[None, :], other=0)
    b_o = mm(q_decayed, state, PREC) + mm(load_square(Aqk, t0, last, h, H, C),
                                          load_rows(VN, rows, last, h, H, cv, V, mv), PREC)
    tl.store(o + (rows[:, None] * H + h) * V + cv[None, :], b_o.to(o.dtype.element_ty),
             mask=(rows <= last)[:, None] & mv[None, :])


def forward_intermediates(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunks, first_chunk, NT, prec,
                          bounded: bool = False, backward: bool = False):
    """Steps 1-4 on packed [T, H, D] views. Returns a dict of the intermediates and the final states.

    What feeds only matmuls (Aqk, Ainv, W, KG, QG, the entering states Hs, V_new) is stored in the
    inputs' dtype: `mm` rounds its operands to that dtype anyway, so half-precision storage loses little
    and halves the bytes. G and L stay fp32 (exponentials, the fp32 substitution), and so does U, which
    enters V_new = U - W S unrounded: V_new is small where the state predicts the values well."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    BK, BKD, BV, _, _ = tiles(K, V)
    check_head_dims(q.dtype, K, V, q.device)
    BVS = state_block(N, H, V, q.device, q.dtype)
    dt = q.dtype
    Gc = chunk_cumsum(g, cu_seqlens, chunks, NT)
    L = scratch(T, H, CHUNK, like=q)  # [C, C] per chunk, row by row
    Aqk, Ainv = scratch(T, H, CHUNK, like=q, dtype=dt), scratch(T, H, CHUNK, like=q, dtype=dt)
    W, KG = scratch(T, H, K, like=q, dtype=dt), scratch(T, H, K, like=q, dtype=dt)
    U = scratch(T, H, V, like=q)  # fp32: V_new = U - W S cancels, and U enters it as is
    QG = scratch(T, H, K, like=q, dtype=dt) if backward else W  # W: a placeholder pointer, never written
    Hs = scratch(NT, H, K, V, like=q, dtype=dt)
    VN = scratch(T, H, V, like=q, dtype=dt)
    ht = scratch(N, H, K, V, like=q)
    if NT:
        # serial:8 (the default): with 4 warps, the [t, s, d] decay tiles and the [C, K] rows spill
        # registers at K = 128
        split = SCORES_GRID["split"]
        scores_kernel[(NT, H, CHUNK // SUB) if split else (NT, H)](
            q, k, Gc, L, Aqk, cu_seqlens, chunks, scale, H, K, BK, BKD, CHUNK, SUB, prec, bounded,
            dot_precision(torch.float32), split, SCORES_GRID["tokens"], num_warps=SCORES_GRID["warps"])
        solve_kernel[(NT, H)](L, beta, Ainv, cu_seqlens, chunks, H, CHUNK, SUB)
        wu_kernel[(NT, H)](q, k, v, beta, Gc, Ainv, W, U, KG, QG, cu_seqlens, chunks, scale, H, K, V, BK, BV,
                           CHUNK, backward, prec, num_warps=8)
    if N:
        h0 = initial_state if initial_state is not None else ht
        state_kernel[(N, H, triton.cdiv(V, BVS))](
            KG, Gc, W, U, h0, Hs, VN, ht, cu_seqlens, first_chunk, H, K, V, BK, BVS, CHUNK,
            initial_state is not None, prec, num_stages=1)  # a pipelined chunk loop overflows shared memory
    return dict(Gc=Gc, L=L, Aqk=Aqk, Ainv=Ainv, W=W, U=U, KG=KG, QG=QG, Hs=Hs, VN=VN), ht


def intermediates_bytes(T: int, H: int, K: int, V: int, N: int, NT: int, dtype: torch.dtype,
                        backward: bool = False) -> int:
    """The bytes of forward_intermediates' dict for these shapes (the final states apart): a planner sees
    an op's outputs only, and adds these (kimi.ops.SCRATCH)."""
    b, f = torch.empty((), dtype=dtype).element_size(), 4
    # Gc, L, Aqk and Ainv, W and KG, U, VN, and QG for the backward
    per_token = (K * f + CHUNK * f + 2 * CHUNK * b + 2 * K * b + V * f + V * b
                 + (K * b if backward else 0))
    return T * H * per_token + NT * H * K * V * b  # Hs


def chunk_fwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunks, first_chunk, NT, prec,
              bounded: bool = False):
    """o [T, H, V] (v's dtype) and the final states [N, H, K, V] (fp32) of packed [T, H, D] inputs."""
    T, H, K = q.shape
    V = v.shape[-1]
    BK, _, BV, _, _ = tiles(K, V)
    mid, ht = forward_intermediates(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunks, first_chunk,
                                    NT, prec, bounded)
    o = scratch(*v.shape, like=v, dtype=v.dtype)
    if NT:
        output_kernel[(NT, H, triton.cdiv(V, BV))](
            q, mid["Gc"], mid["Aqk"], mid["Hs"], mid["VN"], o, cu_seqlens, chunks, scale, H, K, V, BK, BV,
            CHUNK, prec)
    return o, ht
