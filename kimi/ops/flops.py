"""FLOP formulas for torch's flop counter (torch.utils.flop_counter.FlopCounterMode): our custom ops, and the
aten ops the model runs that torch has no formula for, so that the counter sees a whole training step.

Convention, the one KimiModel.flops_per_token declares (kimi/model/transformer.py, docs/benchmarks.md):
model FLOPs, not hardware FLOPs. A multiply-add is 2 FLOPs; elementwise work (norms, gates, softmax's
exponentials) is not counted, as torch counts none; a backward is what autograd needs beyond the forward
(twice the forward for a matmul), never a kernel's recomputation of forward values. Causal attention
counts the (query, key) pairs the mask allows: half the square, as a flash kernel skipping masked tiles
runs it, with the queries at the end of the keys (a decoding or context-parallel query block sees the
keys before it whole). Packed documents (cu_seqlens) count each document's own square, where the offsets
can be read (not on meta or fake tensors, where the whole row is taken, an upper bound).

Registered here (importing kimi.ops does it), where torch 2.13 counts 0: torch._grouped_mm (the MoE
experts), the CPU SDPA kernel (attention on CPU) and triangular solves (the PyTorch KDA chunk path's).
Registered by the modules that define them (register_attention_ops, register_kda_ops: importing
kimi.ops.attention.triton.op and kimi.ops.kda.triton.op does it): the Triton attention and KDA ops. The
fused gates and L2 norms (kimi::kda_gate_*, kimi::l2norm_*) are elementwise and have none. The AttnRes
depth mix (aten.mv on the PyTorch path, the fused kimi::attnres_mix) stays at 0, as the declared count
leaves it out (under 1% of every preset's step: tests/ops/test_flop_count.py).
"""

from __future__ import annotations

from math import prod

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula

aten = torch.ops.aten


def _register(targets, formula, raw: bool = False) -> None:
    """Register `formula` for each op not already counted (a newer torch may bring its own; a module that
    defines ops registers them once however often it is imported)."""
    new = [t for t in targets if t not in flop_registry]
    if new:
        register_flop_formula(new, get_raw=raw)(formula)


def _readable(t: torch.Tensor | None) -> bool:
    """Whether t holds values to read (not None, meta or a fake tensor under tracing)."""
    from kimi.ops.dispatch import is_fake

    return t is not None and not is_fake(t) and t.device.type != "meta"


def _lengths(cu_seqlens: torch.Tensor | None, total: int) -> list[int]:
    """The packed documents' lengths, or [total] where there are none or they cannot be read."""
    return cu_seqlens.diff().tolist() if _readable(cu_seqlens) else [total]


def attention_pairs(q_len: int, k_len: int, causal: bool) -> float:
    """(query, key) pairs a causal mask allows with the queries at the end of the keys (all without one)."""
    if not causal:
        return float(q_len * k_len)
    q_len = min(q_len, k_len)
    return q_len * (k_len - q_len) + q_len * q_len / 2


def attention_flops(heads: int, pairs: float, d_qk: int, d_v: int) -> float:
    """Forward: q.k (2 Dqk) and p v (2 Dv) per pair and query head. The backward is twice this (dS and dV,
    dQ and dK)."""
    return heads * pairs * 2 * (d_qk + d_v)


# ---- aten ops ------------------------------------------------------------------------------------------
def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """torch._grouped_mm: 2 M K N whichever operand the groups split. 2-D x 3-D (the experts' forward, and
    the input gradient): [M, K] rows against [G, K, N]; 2-D x 2-D (the weight gradient): [M, K] x [K, N] with
    K split into groups, out [G, M, N]; 3-D x 2-D: [G, M, K] against [K, N] with N split; 3-D x 3-D: G
    batched products."""
    M, K = a_shape[-2:]
    N = b_shape[-1]
    if len(a_shape) == 3 and len(b_shape) == 3:
        return 2 * a_shape[0] * M * K * N
    return 2 * M * K * N


def triangular_solve_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """aten.linalg_solve_triangular, A [..., n, n]: n multiply-adds over the triangle, n FLOPs, per element of
    the solution."""
    return prod(out_shape) * a_shape[-1]


def _cpu_sdpa_pairs(query, key, is_causal, attn_mask) -> float:
    """Pairs per (batch row, head) of the CPU SDPA kernel: is_causal is top-left aligned (our attention sets
    it only when Tq == Tk); an explicit mask counts what it allows, averaged over what it broadcasts to."""
    Tq, Tk = query.shape[-2], key.shape[-2]
    if is_causal:  # query i sees keys 0..i
        return Tq * Tq / 2 if Tq <= Tk else Tk * Tk / 2 + (Tq - Tk) * Tk
    if not _readable(attn_mask):  # none, or no values to read: every pair
        return float(Tq * Tk)
    allowed = attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf")
    return float(allowed.sum()) * Tq * Tk / allowed.numel()


def cpu_sdpa_flops(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None,
                   out_val=None) -> float:
    """aten._scaled_dot_product_flash_attention_for_cpu, q [B, H, Tq, D], k/v [B, Hkv, Tk, D]."""
    B, H, _, Dqk = query.shape
    return B * attention_flops(H, _cpu_sdpa_pairs(query, key, is_causal, attn_mask), Dqk, value.shape[-1])


def cpu_sdpa_backward_flops(grad_out, query, key, value, out, logsumexp, dropout_p=0.0, is_causal=False, *,
                            attn_mask=None, scale=None, out_val=None) -> float:
    return 2 * cpu_sdpa_flops(query, key, value, dropout_p, is_causal, attn_mask=attn_mask)


# aten op -> (formula, whether it reads the arguments themselves rather than their shapes)
ATEN_FORMULAS = {
    aten._grouped_mm: (grouped_mm_flops, False),
    aten.linalg_solve_triangular: (triangular_solve_flops, False),
    aten._scaled_dot_product_flash_attention_for_cpu: (cpu_sdpa_flops, True),
    aten._scaled_dot_product_flash_attention_for_cpu_backward: (cpu_sdpa_backward_flops, True),
}
for _op, (_formula, _raw) in ATEN_FORMULAS.items():
    _register([_op], _formula, raw=_raw)


# ---- our custom ops ------------------------------------------------------------------------------------
def _flash_pairs(q: torch.Tensor, k: torch.Tensor, cu_seqlens, causal: bool) -> float:
    """Pairs per head summed over the batch rows (or, packed, over the documents)."""
    B, Tq, Tk = q.shape[0], q.shape[1], k.shape[1]
    if cu_seqlens is None or Tq != Tk:
        return B * attention_pairs(Tq, Tk, causal)
    return sum(attention_pairs(n, n, causal) for n in _lengths(cu_seqlens, Tq))


def flash_attention_flops(q, k, v, cu_seqlens, scale, causal, return_max_logits, atomic_dq,
                          out_val=None) -> float:
    """kimi::flash_attention: q [B, Tq, H, Dqk], k [B, Tk, Hkv, Dqk], v [B, Tk, Hkv, Dv]. The max logits
    ride along (one store)."""
    return attention_flops(q.shape[2], _flash_pairs(q, k, cu_seqlens, causal), q.shape[-1], v.shape[-1])


def flash_attention_backward_flops(do, dlse, q, k, v, o, lse, cu_seqlens, scale, causal, atomic_dq,
                                   out_val=None) -> float:
    """kimi::flash_attention_backward: twice the forward (the kernel's recomputed scores not counted)."""
    return 2 * flash_attention_flops(q, k, v, cu_seqlens, scale, causal, False, atomic_dq)


def attention_max_logits_flops(q, k, cu_seqlens, scale, causal, out_val=None) -> float:
    """kimi::attention_max_logits, the SDPA path's max-logit pass for QK-Clip: q.k over the allowed pairs,
    no softmax, no values. A statistic for the optimizer, so not in the model's declared count."""
    return q.shape[2] * _flash_pairs(q, k, cu_seqlens, causal) * 2 * q.shape[-1]


def register_attention_ops() -> None:
    """Formulas for kimi::flash_attention, its backward and kimi::attention_max_logits (defined in
    kimi/ops/attention/triton/op.py, which calls this)."""
    ops = torch.ops.kimi
    _register([ops.flash_attention], flash_attention_flops, raw=True)
    _register([ops.flash_attention_backward], flash_attention_backward_flops, raw=True)
    _register([ops.attention_max_logits], attention_max_logits_flops, raw=True)


def kda_chunk_flops(q, k, v, *args, out_shape=None, **kwargs) -> float:
    """kimi::kda_chunk_fwd, packed q, k [1, T, H, K], v [1, T, H, V]: the chunk form's count per token and
    head (kimi.ops.kda.chunk.chunk_flops_per_token), as KDA.flops_per_token declares it."""
    from kimi.ops.kda.chunk import chunk_flops_per_token

    _, T, H, K = q
    return T * H * chunk_flops_per_token(K, v[-1])


def kda_chunk_backward_flops(q, k, v, *args, out_shape=None, **kwargs) -> float:
    """kimi::kda_chunk_bwd: twice the forward (the kernel's recomputed intermediates not counted)."""
    return 2 * kda_chunk_flops(q, k, v)


def kda_recurrent_flops(q, k, v, *args, out_shape=None, **kwargs) -> float:
    """kimi::kda_recurrent_fwd(_), decoding token by token: per token and head the state's read k^T S, its
    correction k (v - k^T S)^T and the output q^T S, 2 K V each: the chunk form's 6 K V (no chunk, so none of
    its intra-chunk terms); the decay is elementwise."""
    _, T, H, K = q
    return T * H * 6 * K * v[-1]


def register_kda_ops() -> None:
    """Formulas for the Triton KDA ops (defined in kimi/ops/kda/triton/op.py, which calls this)."""
    ops = torch.ops.kimi
    _register([ops.kda_chunk_fwd], kda_chunk_flops)
    _register([ops.kda_chunk_bwd], kda_chunk_backward_flops)
    _register([ops.kda_recurrent_fwd, ops.kda_recurrent_fwd_], kda_recurrent_flops)
