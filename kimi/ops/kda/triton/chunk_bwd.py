"""Chunkwise KDA backward in Triton. Nothing but the inputs is kept from the forward: steps 1-4 of
chunk_fwd.py are rerun (G, scores, inverse, W, U, the entering states and V_new), then

1. `state_bwd_kernel`, per (sequence, head, value block), chunks in reverse: with dS the gradient of the
   state leaving a chunk, dV_new = A_qk^T dO + KG dS, and the gradient of the state entering it is
   Diag(exp(G_C)) dS + QG^T dO - W^T dV_new (KG = exp(G_C - G) K and QG = scale exp(G) Q come from the
   rerun of step 3). Stores every chunk's dS and dV_new.
2. `chunk_bwd_kernel`, per chunk: everything that needs the states: the state read of O, the state write,
   V_new = U - W S, and back through the solve. With Z = Ainv^T [dW, dU] (Ainv = (I + A)^-1,
   A = StrictLower(Diag(beta) L)): d(beta X) = Z for X = [exp(G) K, V], and dA = -Z [W, U]^T.
   Leaves dA_qk and dL (the gradients of the two score matrices) for step 3.
3. `scores_bwd_kernel`, per chunk: back through the pairwise-decayed scores
   P[t, s] = sum_d x_t k_s exp(G_t - G_s), anchored exactly like the forward (off-diagonal sub-chunk
   blocks as matmuls, diagonal blocks as masked [t, s, d] tiles, or one key token at a time in the tokens
   layout, common.scores_grid); dG_t gains x_t dx_t and loses k_s dk_s.
4. `chunk_cumsum(reverse=True)`: dg from dG (G is the in-chunk cumulative sum of g).
"""

import torch
import triton
import triton.language as tl

from .chunk_fwd import forward_intermediates, intermediates_bytes, load_square
from .common import (CHUNK, SCORES_GRID, SUB, chunk_bounds, chunk_cumsum, dot_precision, key_block_precision,
                     key_token, load_G, load_G_row, load_rows, mm, narrow_operands_fault, scratch,
                     state_block, state_program, tiles)


@triton.jit
def state_bwd_kernel(QG, KG, Gc, W, Aqk, do, dht, DH, DVN, dh0, cu_seqlens, first_chunk, H, K: tl.constexpr,
                     V: tl.constexpr, BK: tl.constexpr, BVS: tl.constexpr, C: tl.constexpr,
                     HAS_DFINAL: tl.constexpr, PREC: tl.constexpr):
    n, h, bos, eos, c0, ck, cv, mk, mv, state_off, state_mask, dS = state_program(
        dht, cu_seqlens, first_chunk, H, K, V, BK, BVS, HAS_DFINAL)
    nt = tl.cdiv(eos - bos, C)
    for c_rev in range(nt):
        c = nt - 1 - c_rev
        t0 = bos + c * C
        last = tl.minimum(t0 + C, eos) - 1
        rows = t0 + tl.arange(0, C)
        tl.store(DH + ((c0 + c) * H + h) * K * V + state_off, dS.to(DH.dtype.element_ty), mask=state_mask)
        b_do = load_rows(do, rows, last, h, H, cv, V, mv)
        dv_new = (mm(tl.trans(load_square(Aqk, t0, last, h, H, C)), b_do, PREC)
                  + mm(load_rows(KG, rows, last, h, H, ck, K, mk), dS, PREC))
        tl.store(DVN + (rows[:, None] * H + h) * V + cv[None, :], dv_new.to(DVN.dtype.element_ty),
                 mask=(rows <= last)[:, None] & mv[None, :])
        G_last = load_G_row(Gc, last, last, h, H, ck, K, mk)
        q_g = load_rows(QG, rows, last, h, H, ck, K, mk)
        dS = (dS * tl.exp(G_last)[:, None] + mm(tl.trans(q_g), b_do, PREC)
              - mm(tl.trans(load_rows(W, rows, last, h, H, ck, K, mk)), dv_new, PREC))
    tl.store(dh0 + (n * H + h).to(tl.int64) * K * V + state_off, dS, mask=state_mask)


@triton.jit
def chunk_bwd_kernel(q, k, v, beta, Gc, L, Ainv, W, U, Hs, VN, do, DH, DVN, dqs, dks, dv, dG, dbeta, dAqk, dL,
                     cu_seqlens, chunks, H, K: tl.constexpr, V: tl.constexpr, BKC: tl.constexpr,
                     BV: tl.constexpr, C: tl.constexpr, PREC: tl.constexpr, PREC_KB: tl.constexpr):
    """Two passes over the value blocks: first what needs no key channels (dV, dA_qk, the U part of dA),
    then, per block of BKC key channels, the state terms. Holding all K channels of the three [C, K]
    accumulators at once spilled registers at K = 128 (bench/results/kda_sm90_compile.json); the second
    pass rereads dO, V_new and dV_new once per key block instead. PREC_KB: the two products with a [C, BKC]
    operand (common.key_block_precision)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    t0, last = chunk_bounds(cu_seqlens, chunks, i_c, C)
    o = tl.arange(0, C)
    rows = t0 + o
    valid = rows <= last
    b_beta = tl.load(beta + rows * H + h, mask=valid, other=0).to(tl.float32)
    A_inv = load_square(Ainv, t0, last, h, H, C)
    d_Aqk = tl.zeros([C, C], dtype=tl.float32)
    d_A = tl.zeros([C, C], dtype=tl.float32)
    d_beta = tl.zeros([C], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        cv = i_v * BV + tl.arange(0, BV)
        mv = cv < V
        b_do = load_rows(do, rows, last, h, H, cv, V, mv)
        d_Aqk += mm(b_do, tl.trans(load_rows(VN, rows, last, h, H, cv, V, mv)), PREC)
        Z_U = mm(tl.trans(A_inv), load_rows(DVN, rows, last, h, H, cv, V, mv), PREC)  # dU = dV_new
        tl.store(dv + (rows[:, None] * H + h) * V + cv[None, :],
                 (b_beta[:, None] * Z_U).to(dv.dtype.element_ty), mask=valid[:, None] & mv[None, :])
        d_beta += tl.sum(Z_U * load_rows(v, rows, last, h, H, cv, V, mv), axis=1)
        d_A -= mm(Z_U, tl.trans(load_rows(U, rows, last, h, H, cv, V, mv)), PREC)
    # dA_qk is complete: stored now, not held through the key-block loop (on sm_90 that took the kernel's
    # spills from 200/252 B to 124/132 B)
    out2 = (rows[:, None] * H + h) * C + o[None, :]
    tl.store(dAqk + out2, tl.where(o[:, None] >= o[None, :], d_Aqk, 0.0), mask=valid[:, None])
    state_base = (i_c * H + h).to(tl.int64) * K * V
    for k0 in range(0, K, BKC):
        ck = k0 + tl.arange(0, BKC)
        mk = ck < K
        d_qs = tl.zeros([C, BKC], dtype=tl.float32)  # d(scaled q) through the state read, before exp(G)
        d_kend = tl.zeros([C, BKC], dtype=tl.float32)  # d(exp(G_C - G) K) through the state write
        d_W = tl.zeros([C, BKC], dtype=tl.float32)
        d_Glast = tl.zeros([BKC], dtype=tl.float32)  # d exp(G_C) through the decay of the entering state
        for i_v in range(tl.cdiv(V, BV)):
            cv = i_v * BV + tl.arange(0, BV)
            mv = cv < V
            state_ptr = state_base + ck[:, None] * V + cv[None, :]
            S = tl.load(Hs + state_ptr, mask=mk[:, None] & mv[None, :], other=0).to(tl.float32)
            dS = tl.load(DH + state_ptr, mask=mk[:, None] & mv[None, :], other=0).to(tl.float32)
            d_qs += mm(load_rows(do, rows, last, h, H, cv, V, mv), tl.trans(S), PREC)
            d_kend += mm(load_rows(VN, rows, last, h, H, cv, V, mv), tl.trans(dS), PREC)
            d_W -= mm(load_rows(DVN, rows, last, h, H, cv, V, mv), tl.trans(S), PREC)
            d_Glast += tl.sum(S * dS, axis=1)
        G = load_G(Gc, rows, last, h, H, ck, K, mk)
        G_last = load_G_row(Gc, last, last, h, H, ck, K, mk)
        b_k = load_rows(k, rows, last, h, H, ck, K, mk)
        decay = tl.exp(G)
        to_end = tl.exp(G_last[None, :] - G)
        k_decayed = b_k * decay
        Z_W = mm(tl.trans(A_inv), d_W, PREC_KB)
        d_kdecayed = b_beta[:, None] * Z_W
        d_beta += tl.sum(Z_W * k_decayed, axis=1)
        d_A -= mm(Z_W, tl.trans(load_rows(W, rows, last, h, H, ck, K, mk)), PREC_KB)
        out = (rows[:, None] * H + h) * K + ck[None, :]
        mask = valid[:, None] & mk[None, :]
        tl.store(dqs + out, d_qs * decay, mask=mask)
        tl.store(dks + out, d_kend * to_end + d_kdecayed * decay, mask=mask)
        k_end = b_k * to_end
        d_Glast = d_Glast * tl.exp(G_last) + tl.sum(d_kend * k_end, axis=0)
        d_G = d_kdecayed * k_decayed - d_kend * k_end + tl.where(rows[:, None] == last, d_Glast[None, :], 0.0)
        tl.store(dG + out, d_G, mask=mask)
    d_A = tl.where((o[:, None] > o[None, :]) & valid[:, None], d_A, 0.0)
    d_beta += tl.sum(d_A * load_square(L, t0, last, h, H, C), axis=1)
    tl.store(dL + out2, b_beta[:, None] * d_A, mask=valid[:, None])
    tl.store(dbeta + rows * H + h, d_beta.to(dbeta.dtype.element_ty), mask=valid)


@triton.jit
def _load_sq_block(A, t0, last, i, j, h, H, C: tl.constexpr, BC: tl.constexpr):
    o = tl.arange(0, BC)
    rows = t0 + i * BC + o
    ptr = A + (rows[:, None] * H + h) * C + j * BC + o[None, :]
    return tl.load(ptr, mask=(rows <= last)[:, None], other=0)


@triton.jit
def scores_bwd_kernel(q, k, Gc, dAqk, dL, dqs, dks, dq, dk, dG, cu_seqlens, chunks, scale, H, K: tl.constexpr,
                      BK: tl.constexpr, BKD: tl.constexpr, C: tl.constexpr, BC: tl.constexpr,
                      PREC: tl.constexpr, BOUNDED: tl.constexpr, PREC_D: tl.constexpr, SPLIT: tl.constexpr,
                      TOKENS: tl.constexpr):
    """For P = A_qk (x = q) and P = L (x = k): dx_t = sum_s dP[t, s] k_s exp(G_t - G_s) (row role) and
    dk_s = sum_t dP[t, s] x_t exp(G_t - G_s) (column role). Row role anchors at the first row of t's
    sub-chunk, column role at the last row of s's; diagonal blocks use the masked [t, s, d] decays.
    Every term is separate per key channel, so the work runs on slices of BKD channels. Completes dq, dk
    and dG (partial sums from chunk_bwd_kernel) for the sub-chunk's rows. BOUNDED (gates >= -80 / BC): the
    diagonal block joins both anchored sums as one more matmul each, at PREC_D as in scores_kernel.
    SPLIT: one program per (chunk, head, sub-chunk, channel slice), grid (NT, H, C // BC * ceil(K / BKD));
    otherwise one per (chunk, head) walking its sub-chunks and slices in turn. The same sums either way
    (units share no partial results); which is faster is a GPU's question (bench/kda.py --scores-grid).
    TOKENS: the general diagonal block one key token at a time (_bwd_diagonal_by_token)."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    t0, last = chunk_bounds(cu_seqlens, chunks, i_c, C)
    if SPLIT:
        unit = tl.program_id(2)
        slices = (K + BKD - 1) // BKD
        _scores_bwd_unit(q, k, Gc, dAqk, dL, dqs, dks, dq, dk, dG, t0, last, h, H, unit // slices,
                         unit % slices * BKD, scale, K, BKD, C, BC, PREC, BOUNDED, PREC_D, TOKENS)
    else:
        for i in tl.static_range(C // BC):
            for d0 in range(0, BK, BKD):
                _scores_bwd_unit(q, k, Gc, dAqk, dL, dqs, dks, dq, dk, dG, t0, last, h, H, i, d0, scale, K,
                                 BKD, C, BC, PREC, BOUNDED, PREC_D, TOKENS)


@triton.jit
def _scores_bwd_unit(q, k, Gc, dAqk, dL, dqs, dks, dq, dk, dG, t0, last, h, H, i, d0, scale, K: tl.constexpr,
                     BKD: tl.constexpr, C: tl.constexpr, BC: tl.constexpr, PREC: tl.constexpr,
                     BOUNDED: tl.constexpr, PREC_D: tl.constexpr, TOKENS: tl.constexpr):
    """scores_bwd_kernel's work for sub-chunk i's rows and key channels d0 .. d0 + BKD."""
    o = tl.arange(0, BC)
    causal = (o[:, None] >= o[None, :])[:, :, None]
    rows = t0 + i * BC + o
    dPq = _load_sq_block(dAqk, t0, last, i, i, h, H, C, BC)  # zero where s > t
    dPk = _load_sq_block(dL, t0, last, i, i, h, H, C, BC)
    cd = d0 + tl.arange(0, BKD)
    md = cd < K
    q_i = load_rows(q, rows, last, h, H, cd, K, md) * scale
    k_i = load_rows(k, rows, last, h, H, cd, K, md)
    G_i = load_G(Gc, rows, last, h, H, cd, K, md)
    # Row role, earlier sub-chunks j < i, through the anchor a = first row of sub-chunk i.
    G_a = load_G_row(Gc, t0 + i * BC, last, h, H, cd, K, md)
    dq_i = tl.zeros([BC, BKD], dtype=tl.float32)
    dk_row = tl.zeros([BC, BKD], dtype=tl.float32)
    for j in range(0, i):
        cols = t0 + j * BC + o
        k_j = load_rows(k, cols, last, h, H, cd, K, md) * tl.exp(
            G_a[None, :] - load_G(Gc, cols, last, h, H, cd, K, md))
        dq_i += mm(_load_sq_block(dAqk, t0, last, i, j, h, H, C, BC), k_j, PREC)
        dk_row += mm(_load_sq_block(dL, t0, last, i, j, h, H, C, BC), k_j, PREC)
    if BOUNDED:  # the diagonal block through the same anchor
        k_a = k_i * tl.exp(G_a[None, :] - G_i)
        dq_i += mm(dPq, k_a, PREC_D)
        dk_row += mm(dPk, k_a, PREC_D)
    from_anchor = tl.exp(G_i - G_a[None, :])
    dq_i *= from_anchor
    dk_row *= from_anchor
    # Column role, later sub-chunks m > i, through the anchor b = last row of sub-chunk i.
    G_b = load_G_row(Gc, t0 + i * BC + BC - 1, last, h, H, cd, K, md)
    dk_col = tl.zeros([BC, BKD], dtype=tl.float32)
    for m in range(i + 1, C // BC):
        rows_m = t0 + m * BC + o
        to_b = tl.exp(load_G(Gc, rows_m, last, h, H, cd, K, md) - G_b[None, :])
        q_m = load_rows(q, rows_m, last, h, H, cd, K, md) * scale * to_b
        k_m = load_rows(k, rows_m, last, h, H, cd, K, md) * to_b
        dk_col += mm(tl.trans(_load_sq_block(dAqk, t0, last, m, i, h, H, C, BC)), q_m, PREC)
        dk_col += mm(tl.trans(_load_sq_block(dL, t0, last, m, i, h, H, C, BC)), k_m, PREC)
    if BOUNDED:
        to_b = tl.exp(G_i - G_b[None, :])
        dk_col += mm(tl.trans(dPq), q_i * to_b, PREC_D) + mm(tl.trans(dPk), k_i * to_b, PREC_D)
    dk_col *= tl.exp(G_b[None, :] - G_i)
    if TOKENS and not BOUNDED:
        dq_d, dk_row_d, dk_col_d = _bwd_diagonal_by_token(q_i, k_i, G_i, k, Gc, dAqk, dL, rows, t0 + i * BC,
                                                          last, h, H, cd, K, md, C, BC, BKD, i * BC)
        dq_i += dq_d
        dk_row += dk_row_d
        dk_col += dk_col_d
    # diagonal block: [t, s, d] decays, exponent -inf where s > t before exponentiating
    if not BOUNDED and not TOKENS:
        decay = tl.exp(tl.where(causal, G_i[:, None, :] - G_i[None, :, :], float("-inf")))
        dq_i += tl.sum(dPq[:, :, None] * decay * k_i[None, :, :], axis=1)
        dk_row += tl.sum(dPk[:, :, None] * decay * k_i[None, :, :], axis=1)
        dk_col += tl.sum((dPq[:, :, None] * q_i[:, None, :] + dPk[:, :, None] * k_i[:, None, :])
                         * decay, axis=0)
    out = (rows[:, None] * H + h) * K + cd[None, :]
    mask = (rows <= last)[:, None] & md[None, :]
    d_qs = tl.load(dqs + out, mask=mask, other=0) + dq_i
    tl.store(dq + out, (d_qs * scale).to(dq.dtype.element_ty), mask=mask)
    d_k = tl.load(dks + out, mask=mask, other=0) + dk_row + dk_col
    tl.store(dk + out, d_k.to(dk.dtype.element_ty), mask=mask)
    d_G = tl.load(dG + out, mask=mask, other=0) + q_i * d_qs + k_i * (dk_row - dk_col)
    tl.store(dG + out, d_G, mask=mask)


@triton.jit
def _bwd_diagonal_by_token(q_i, k_i, G_i, k, Gc, dAqk, dL, rows, a, last, h, H, cd, K, md, C: tl.constexpr,
                           BC: tl.constexpr, BKD: tl.constexpr, col0):
    """The diagonal block's terms of (dq, dk by row, dk by column) for rows a .. a + BC - 1 and the key
    channels cd, one key token s at a time (as chunk_fwd._diagonal_by_token): with
    e[t] = exp(G_t - G_s) for t >= s (0 above the diagonal, its exponent set to -inf first),
    dq_t += dP_q[t, s] e[t] k_s, dk_t += dP_k[t, s] e[t] k_s and dk_s += sum_t (dP_q[t, s] q_t +
    dP_k[t, s] k_t) e[t]; the column dP[:, s] is read from the score gradients (col0 + s)."""
    o = tl.arange(0, BC)
    valid = rows <= last
    dq_d = tl.zeros([BC, BKD], dtype=tl.float32)
    dk_row = tl.zeros([BC, BKD], dtype=tl.float32)
    dk_col = tl.zeros([BC, BKD], dtype=tl.float32)
    for s in range(0, BC):
        k_s, e = key_token(k, Gc, G_i, a, s, last, h, H, cd, K, md, BC)
        dPq = tl.load(dAqk + (rows * H + h) * C + col0 + s, mask=valid, other=0)
        dPk = tl.load(dL + (rows * H + h) * C + col0 + s, mask=valid, other=0)
        ek = e * k_s[None, :]
        dq_d += dPq[:, None] * ek
        dk_row += dPk[:, None] * ek
        column = tl.sum((dPq[:, None] * q_i + dPk[:, None] * k_i) * e, axis=0)
        dk_col += tl.where(o[:, None] == s, column[None, :], 0.0)
    return dq_d, dk_row, dk_col


def chunk_bwd(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunks, first_chunk, NT, prec, do, dht,
              bounded: bool = False):
    """Gradients (dq, dk, dv, dg, dbeta, dh0) of packed [T, H, D] inputs; dht: [N, H, K, V] or None."""
    T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    BK, BKD, BV, _, BKC = tiles(K, V)
    BVS = state_block(N, H, V, q.device, q.dtype)
    mid, _ = forward_intermediates(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunks, first_chunk,
                                   NT, prec, bounded, backward=True)
    DH = scratch(NT, H, K, V, like=q, dtype=q.dtype)  # matmul operands only, like the forward's states
    DVN = scratch(T, H, V, like=q, dtype=q.dtype)
    dh0 = scratch(N, H, K, V, like=q)
    if N:
        state_bwd_kernel[(N, H, triton.cdiv(V, BVS))](
            mid["QG"], mid["KG"], mid["Gc"], mid["W"], mid["Aqk"], do, dht if dht is not None else dh0, DH,
            DVN, dh0, cu_seqlens, first_chunk, H, K, V, BK, BVS, CHUNK, dht is not None, prec,
            num_warps=8, num_stages=1)  # 4 warps spill at BVS = 64; a pipelined chunk loop overflows smem
    dqs, dks, dG = (scratch(T, H, K, like=q) for _ in range(3))  # fp32 partial sums
    dq, dk = scratch(*q.shape, like=q, dtype=q.dtype), scratch(*k.shape, like=k, dtype=k.dtype)
    dv = scratch(*v.shape, like=v, dtype=v.dtype)
    dbeta = scratch(T, H, like=beta, dtype=beta.dtype)
    dAqk, dL = scratch(T, H, CHUNK, like=q), scratch(T, H, CHUNK, like=q)
    if NT:
        chunk_bwd_kernel[(NT, H)](
            q, k, v, beta, mid["Gc"], mid["L"], mid["Ainv"], mid["W"], mid["U"], mid["Hs"], mid["VN"], do, DH,
            DVN, dqs, dks, dv, dG, dbeta, dAqk, dL, cu_seqlens, chunks, H, K, V, BKC, BV, CHUNK, prec,
            key_block_precision(prec, BKC, narrow_operands_fault(q.device)),
            num_warps=8, num_stages=1)  # four [C, C] and three [C, BKC] fp32 tiles; no loop pipelining
        split = SCORES_GRID["split"]
        grid = (NT, H, CHUNK // SUB * triton.cdiv(K, BKD)) if split else (NT, H)
        scores_bwd_kernel[grid](q, k, mid["Gc"], dAqk, dL, dqs, dks, dq, dk, dG, cu_seqlens, chunks, scale,
                                H, K, BK, BKD, CHUNK, SUB, prec, bounded, dot_precision(torch.float32), split,
                                SCORES_GRID["tokens"], num_warps=SCORES_GRID["warps"])
    dg = chunk_cumsum(dG, cu_seqlens, chunks, NT, reverse=True)
    return dq, dk, dv, dg.to(g.dtype), dbeta, dh0


def chunk_bwd_scratch(T: int, H: int, K: int, V: int, N: int, NT: int, dtype: torch.dtype,
                      g_dtype: torch.dtype) -> int:
    """Bytes chunk_bwd allocates beyond the gradients it returns, all alive at its end (the chunk tables
    apart, a few bytes per chunk): the recomputed intermediates and final states, the states' gradients
    (DH, DVN), the fp32 partial sums (dqs, dks, dG, dAqk, dL), and dg's fp32 sums where g is not fp32."""
    b, f = torch.empty((), dtype=dtype).element_size(), 4
    partial = T * H * (3 * K * f + 2 * CHUNK * f + V * b) + NT * H * K * V * b + N * H * K * V * f
    return (intermediates_bytes(T, H, K, V, N, NT, dtype, backward=True) + partial
            + (T * H * K * f if g_dtype != torch.float32 else 0))
