"""Fused recurrent KDA for decoding: one program per (sequence, head, value block) keeps its slice of the
state in registers and steps through the sequence's tokens (usually one) with the update of
kimi/ops/kda/recurrent.py: decay, delta-rule write, read-out. Forward only."""

import triton
import triton.language as tl

from .common import check_device, scratch, tiles


@triton.jit
def recurrent_kernel(q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, H, K: tl.constexpr, V: tl.constexpr,
                     BK: tl.constexpr, BV: tl.constexpr, HAS_INIT: tl.constexpr):
    n, h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    state_ptr = (n * H + h).to(tl.int64) * K * V + ck[:, None] * V + cv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_INIT:
        state = tl.load(h0 + state_ptr, mask=state_mask, other=0).to(tl.float32)
    for t in range(bos, eos):
        b_q = tl.load(q + (t * H + h) * K + ck, mask=mk, other=0).to(tl.float32) * scale
        b_k = tl.load(k + (t * H + h) * K + ck, mask=mk, other=0).to(tl.float32)
        b_g = tl.load(g + (t * H + h) * K + ck, mask=mk, other=0).to(tl.float32)
        b_v = tl.load(v + (t * H + h) * V + cv, mask=mv, other=0).to(tl.float32)
        b_beta = tl.load(beta + t * H + h).to(tl.float32)
        state = state * tl.exp(b_g)[:, None]
        residual = b_v - tl.sum(b_k[:, None] * state, axis=0)
        state = state + b_k[:, None] * (b_beta * residual)[None, :]
        b_o = tl.sum(b_q[:, None] * state, axis=0)
        tl.store(o + (t * H + h) * V + cv, b_o.to(o.dtype.element_ty), mask=mv)
    tl.store(ht + state_ptr, state, mask=state_mask)


def recurrent_fwd(q, k, v, g, beta, scale: float, initial_state, cu_seqlens, final_state=None):
    """Packed inputs (q, k, g [1, T, H, K], ...); writes the final state into `final_state` when given
    (which may be `initial_state` itself: each program reads its state slice before writing it)."""
    check_device(q, k, v, g, beta)
    _, T, H, K = q.shape
    V = v.shape[-1]
    N = cu_seqlens.numel() - 1
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = scratch(*v.shape, like=v, dtype=v.dtype)
    if final_state is None:
        final_state = scratch(N, H, K, V, like=q)
    h0 = initial_state.contiguous() if initial_state is not None else final_state
    BK, _, BV, _, _ = tiles(K, V)
    if N:
        recurrent_kernel[(N, H, triton.cdiv(V, BV))](
            q, k, v, g, beta, o, h0, final_state, cu_seqlens, scale, H, K, V, BK, BV,
            initial_state is not None)
    return o, final_state
