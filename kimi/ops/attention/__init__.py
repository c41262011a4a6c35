"""Softmax attention that can also report, per head, the largest scaled logit (for QK-Clip).

    attention(q, k, v, causal=True, scale=None, cu_seqlens=None, return_max_logits=False, backend=None,
              deterministic=None)

q [B, Tq, H, Dqk], k [B, Tk, Hkv, Dqk], v [B, Tk, Hkv, Dv] (H a multiple of Hkv; Dv may differ from Dqk)
-> o [B, Tq, H, Dv], or (o, max_logits [B, H] fp32) with return_max_logits. scale defaults to Dqk ** -0.5.
With a causal mask the queries are the last Tq key positions (decoding with a cache, or a context-parallel
rank's shard over the keys gathered up to it). cu_seqlens: offsets [N + 1] of documents packed along the key
positions (B = 1); no token attends across a boundary (the Triton kernel takes Tq = Tk, SDPA any Tq <= Tk).

Two backends compute it. "sdpa" (the default for CPU tensors, and the reference): SDPA for the output and,
only when asked, a separate pass for the max logits (SDPA does not expose its row maxima): on CUDA fp16/bf16
tensors the Triton forward kernel reduced to Q K^T and a row max (one matmul, no softmax, no V), elsewhere a
query-chunked PyTorch pass. "triton" (the default for CUDA tensors in fp16/bf16): a flash-attention kernel
whose online softmax already tracks every row's max, so the max logits cost one extra store
(kimi/ops/attention/triton/). It takes fp32 too, with exact fp32 dots (no tensor cores, so slow: not the
default). Choose one with `backend=`; "triton" on CPU tensors needs TRITON_INTERPRET=1 set before triton is
imported. "auto": what backend=None picks, except that where that is Triton each shape is first timed against
SDPA, forward and backward, and the faster of the two that agree is kept (kimi/ops/attention/auto.py;
model.attention.backend=auto). deterministic (Triton backward only): True builds dQ in its own kernel,
bitwise reproducible; False adds it up with fp32 atomics, about twice as fast on an H200; None: the process
default (kimi/ops/attention/triton/common.py DQ_ATOMIC, atomic unless KIMI_ATTENTION_DQ=separate).

Failures (kimi.ops.dispatch): with backend=None a Triton kernel that fails to compile or launch sends
attention to "sdpa" for the rest of the process, with one warning; with backend="triton" it raises
TritonKernelError. With gradients the choice is made at forward time: the forward and backward kernels are
first probed on a tiny input of the same dtype, head counts and dims and mask kind, so a backward kernel
that cannot compile falls back before the forward runs (kimi.ops.dispatch's docstring says why).
"""

import torch
import torch.nn.functional as F

from kimi.ops.dispatch import Guard, auto_picks_triton, needs_grad

from .auto import choose, register
from .reference import attention_mask, naive_attention

# Elements of one [B, H, chunk, Tk] fp32 score block in the max-logit pass: bounds its memory (64 MiB).
_MAX_LOGIT_BLOCK = 1 << 24


@torch.no_grad()
def _max_logits(q, k, scale, mask) -> torch.Tensor:
    """Max over allowed pairs of q.k * scale per (batch, head), scores built a few query rows at a time.

    It is a statistic for the optimizer, not part of the loss, hence no_grad.
    """
    B, Tq, H, _ = q.shape
    Tk = k.shape[1]
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # bf16 logits are too coarse
    k = k.repeat_interleave(H // k.shape[2], dim=2).to(dtype)
    rows = max(1, _MAX_LOGIT_BLOCK // max(1, B * H * Tk))
    out = torch.full((B, H), float("-inf"), device=q.device, dtype=dtype)
    for start in range(0, Tq, rows):
        scores = torch.einsum("bqhd,bkhd->bhqk", q[:, start : start + rows].to(dtype), k) * scale
        if mask is not None:
            scores = scores.masked_fill(~mask[start : start + rows], float("-inf"))
        out = torch.maximum(out, scores.amax(dim=(-2, -1)))
    return out.float()


_BACKENDS = ("sdpa", "triton")  # forced; None and "auto" choose


def _pick_backend(backend: str | None, q: torch.Tensor) -> str:
    if backend in (None, "auto"):
        triton_ok = auto_picks_triton(q.device) and q.dtype in (torch.float16, torch.bfloat16)
        return "triton" if triton_ok else "sdpa"
    if backend not in _BACKENDS:
        allowed = f"{list(_BACKENDS)}, 'auto' (timed per shape) or None (by device)"
        raise ValueError(f"attention: unknown backend {backend!r}; allowed: {allowed}")
    return backend


_GUARD = Guard("attention", "backend='triton'")
_PROBE_T = 16  # query (and key) positions of the probe input


def _probe(q, k, v, causal, scale, cu_seqlens, return_max_logits, atomic_dq) -> None:
    """The forward and backward kernels once on zeros shaped like these inputs but at most _PROBE_T long."""
    from .triton import common
    from .triton.op import flash_attention_backward_op, flash_attention_op

    atomic_dq = common.DQ_ATOMIC if atomic_dq is None else atomic_dq

    Tq, Tk = q.shape[1], k.shape[1]
    tq = max(1, min(Tq, _PROBE_T))
    tk = tq if Tq == Tk else max(1, min(Tk, 2 * _PROBE_T))
    q_ = q.new_zeros(1, tq, *q.shape[2:])
    k_, v_ = (x.new_zeros(1, tk, *x.shape[2:]) for x in (k, v))
    cu = None if cu_seqlens is None else torch.tensor([0, tq], dtype=cu_seqlens.dtype, device=q.device)
    o, lse, _ = flash_attention_op(q_, k_, v_, cu, float(scale), bool(causal), bool(return_max_logits),
                                   atomic_dq)
    flash_attention_backward_op(torch.zeros_like(o), None, q_, k_, v_, o, lse, cu, float(scale), bool(causal),
                                atomic_dq)


def _triton(q, k, v, causal, scale, cu_seqlens, return_max_logits, atomic_dq=None):
    from .triton import flash_attention  # imported on first use: triton fixes its mode at import

    o, _, max_logits = flash_attention(q, k, v, causal, scale, cu_seqlens, return_max_logits, atomic_dq)
    return (o, max_logits) if return_max_logits else o


_MAX_GUARD = Guard("attention max logits", "(never forced)")


def _max_pass(q, k, causal, scale, cu_seqlens, mask) -> torch.Tensor:
    """The SDPA path's max logits: the Triton row-max kernel where auto picks Triton for fp16/bf16, else (or
    after it failed once) the query-chunked PyTorch pass."""
    Tq, Tk = q.shape[1], k.shape[1]

    def torch_pass():
        full = mask if mask is not None or not (causal and Tq > 1) else attention_mask(Tq, Tk, causal, None,
                                                                                      q.device)
        return _max_logits(q, k, scale, full)

    triton_ok = (auto_picks_triton(q.device) and q.dtype in (torch.float16, torch.bfloat16)
                 and (cu_seqlens is None or Tq == Tk))
    if not (triton_ok and _MAX_GUARD.use_triton(False)):
        return torch_pass()
    from .triton import max_logits

    return _MAX_GUARD.call("attention_max_logits", lambda: max_logits(q, k, causal, scale, cu_seqlens),
                           torch_pass, False)


def _sdpa(q, k, v, causal, scale, cu_seqlens, return_max_logits, atomic_dq=None):
    Tq, H = q.shape[1], q.shape[2]
    Tk, Hkv = k.shape[1], k.shape[2]
    # SDPA's own is_causal aligns queries top-left, which is only right when Tq == Tk; otherwise (or with
    # documents) pass the explicit mask. A single query at the end of the keys sees everything: no mask.
    use_is_causal = causal and cu_seqlens is None and Tq == Tk
    mask = None
    if not use_is_causal and (cu_seqlens is not None or (causal and Tq > 1)):
        mask = attention_mask(Tq, Tk, causal, cu_seqlens, q.device)
    o = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=use_is_causal,
        scale=scale,
        enable_gqa=H != Hkv,
    ).transpose(1, 2)
    if not return_max_logits:
        return o
    return o, _max_pass(q, k, causal, scale, cu_seqlens, mask)


def runs_triton(q: torch.Tensor, backend: str | None = None) -> bool:
    """Whether attention(q, ..., backend=backend) would run the Triton kernel (not after a fallback)."""
    return _pick_backend(backend, q) == "triton" and _GUARD.use_triton(backend in _BACKENDS)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    return_max_logits: bool = False,
    backend: str | None = None,
    deterministic: bool | None = None,
):
    B, Tq, H, D = q.shape
    Tk, Hkv = k.shape[1], k.shape[2]
    if H % Hkv != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({Hkv})")
    if cu_seqlens is not None and B != 1:
        raise ValueError(f"cu_seqlens packs documents along T and needs B == 1, got B = {B}")
    scale = D**-0.5 if scale is None else scale
    atomic_dq = None if deterministic is None else not deterministic
    args = (q, k, v, causal, scale, cu_seqlens, return_max_logits, atomic_dq)
    forced = backend in _BACKENDS
    if _pick_backend(backend, q) == "triton" and _GUARD.use_triton(forced):
        # the kernel packs queries and keys alike: SDPA's mask does it
        if cu_seqlens is not None and Tq != Tk:
            return _sdpa(*args)
        if backend == "auto" and choose(*args) == "sdpa":
            return _sdpa(*args)
        if needs_grad(q, k, v):
            key = (q.device, q.dtype, k.dtype, v.dtype, H, Hkv, D, v.shape[-1], bool(causal), Tq == Tk,
                   None if cu_seqlens is None else cu_seqlens.dtype, bool(return_max_logits), atomic_dq)
            kernels = "flash_attention/flash_attention_backward"
            if not _GUARD.probe(key, kernels, lambda: _probe(*args), forced):
                return _sdpa(*args)
        return _GUARD.call("flash_attention", _triton, _sdpa, forced, *args)
    return _sdpa(*args)


register(triton=_triton, sdpa=_sdpa)  # what "auto" times

__all__ = ["attention", "naive_attention", "runs_triton"]
