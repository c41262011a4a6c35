"""The fused depth mix's kernels: forward (one program per token) and backward (one program per run of
tokens, so the query's and the norm weight's gradients are summed in registers, not written per token).

Per token, with N sources v_i [D] (pointers in a tuple, so nothing is stacked) and the pseudo-query q:

    r_i = 1 / sqrt(mean(v_i^2) + eps),  s_i = r_i (q . v_i),  a_i = softmax_i(s),  h = sum_i a_i v_i
    and with the norm folded in:  y = w * hr * rho,  hr = h rounded to the sources' dtype,
                                  rho = 1 / sqrt(mean(hr^2) + norm_eps)

The forward is an online softmax: each source is loaded once, h accumulates in registers, and only the log
of the softmax's denominator (lse) and rho are stored per token. The backward recomputes the weights
a_i = exp(s_i - lse) and h from the sources (first pass), turns dy into dh through the norm, then (second
pass) writes, with c = dh . h = sum_j a_j dh . v_j,

    dv_i = a_i dh + ds_i r_i (q - r_i v_i s_i / D),   ds_i = a_i (dh . v_i - c)
    dq  += sum_i ds_i r_i v_i,                         dw  += dy * hr * rho

The second pass re-reads rows the first has just read (N D values per token: 36 KiB for `1b` in bf16),
from the caches rather than memory: bench/attnres.py's roofline counts each source once per direction.
ACC is the compute dtype: fp64 for fp64 inputs, fp32 otherwise.
"""

import triton
import triton.language as tl


@triton.jit
def _score(v, q, eps, D: tl.constexpr):
    """(r, s): a source row's inverse RMS and its score q . v * r."""
    r = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    return r, tl.sum(v * q, axis=0) * r


@triton.jit
def _pick(ptrs, i, N: tl.constexpr):
    """ptrs[i] for a loop index i: a chain of selects (a tuple takes constant indices only)."""
    p = ptrs[0]
    for k in tl.static_range(1, N):
        p = tl.where(i == k, ptrs[k], p)
    return p


@triton.jit
def mix_fwd_kernel(srcs, q, w, out, lse, rstd, eps, norm_eps, N: tl.constexpr, D: tl.constexpr,
                   BD: tl.constexpr, HAS_NORM: tl.constexpr, ACC: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BD)
    mask = cols < D
    off = t * D + cols
    b_q = tl.load(q + cols, mask=mask, other=0).to(ACC)
    acc = tl.load(srcs[0] + off, mask=mask, other=0).to(ACC)
    _, m = _score(acc, b_q, eps, D)
    denom = tl.full([], 1.0, ACC)
    for i in tl.static_range(1, N):
        v = tl.load(srcs[i] + off, mask=mask, other=0).to(ACC)
        _, s = _score(v, b_q, eps, D)
        m_new = tl.maximum(m, s)
        shrink = tl.exp(m - m_new)
        p = tl.exp(s - m_new)
        denom = denom * shrink + p
        acc = acc * shrink + p * v
        m = m_new
    tl.store(lse + t, m + tl.log(denom))
    h = acc / denom
    if HAS_NORM:
        h = h.to(out.dtype.element_ty).to(ACC)  # what the unfused norm reads: the mix in the sources' dtype
        rho = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / D + norm_eps)
        tl.store(rstd + t, rho)
        h = h * rho * tl.load(w + cols, mask=mask, other=0).to(ACC)
    tl.store(out + off, h.to(out.dtype.element_ty), mask=mask)


@triton.jit
def mix_bwd_kernel(srcs, dsrcs, q, w, dout, lse, rstd, dq_part, dw_part, T, rows, eps, norm_eps,
                   N: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, HAS_NORM: tl.constexpr,
                   ACC: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BD)
    mask = cols < D
    b_q = tl.load(q + cols, mask=mask, other=0).to(ACC)
    if HAS_NORM:
        b_w = tl.load(w + cols, mask=mask, other=0).to(ACC)
    dq = tl.zeros([BD], ACC)
    dw = tl.zeros([BD], ACC)
    for j in range(rows):
        t = pid.to(tl.int64) * rows + j
        ok = t < T  # rows past the end read zeros, write nothing and add nothing
        m = mask & (cols * 0 + t < T)
        off = t * D + cols
        b_lse = tl.load(lse + t, mask=ok, other=0).to(ACC)
        dy = tl.load(dout + off, mask=m, other=0).to(ACC)
        h = tl.zeros([BD], ACC)
        for i in tl.static_range(N):
            v = tl.load(srcs[i] + off, mask=m, other=0).to(ACC)
            _, s = _score(v, b_q, eps, D)
            h += tl.exp(s - b_lse) * v
        if HAS_NORM:
            rho = tl.load(rstd + t, mask=ok, other=0).to(ACC)
            hr = h.to(dout.dtype.element_ty).to(ACC)
            xhat = hr * rho
            dw += dy * xhat
            u = dy * b_w
            ux = tl.sum(u * xhat, axis=0)
            dh = rho * (u - xhat * (ux / D))
            # c = dh . h. The norm's gradient is nearly orthogonal to its input: dh . hr = ux eps rho^2
            # exactly, taken in closed form rather than as a dot product that cancels to a few bits
            c = ux * norm_eps * rho * rho + tl.sum(dh * (h - hr), axis=0)
        else:
            dh = dy
            c = tl.sum(dh * h, axis=0)
        for i in range(N):  # not unrolled: unrolled, the loads of every source were live at once (spills)
            dsrc = _pick(dsrcs, i, N)
            v = tl.load(_pick(srcs, i, N) + off, mask=m, other=0).to(ACC)
            r, s = _score(v, b_q, eps, D)
            a = tl.exp(s - b_lse)
            if N == 1:  # weight 1 whatever the score: exactly no gradient through it
                ds = a * 0.0
            else:
                ds = a * (tl.sum(dh * v, axis=0) - c)
            n = v * r
            dv = a * dh + (ds * r) * (b_q - n * (s / D))
            tl.store(dsrc + off, dv.to(dsrc.dtype.element_ty), mask=m)
            dq += ds * n
    tl.store(dq_part + pid.to(tl.int64) * D + cols, dq, mask=mask)
    if HAS_NORM:
        tl.store(dw_part + pid.to(tl.int64) * D + cols, dw, mask=mask)
