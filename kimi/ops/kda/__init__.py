"""Kimi Delta Attention ops with flash-linear-attention's calling convention, so implementations swap freely.

    chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              cu_seqlens=None, backend=None) -> (o, final_state)
    fused_recurrent_kda(...same...) -> (o, final_state)

q, k: [B, T, H, K]; v: [B, T, H, V]; g: [B, T, H, K], log-space decay already activated (<= 0);
beta: [B, T, H]; states: [B, H, K, V] in fp32 (fp64 for fp64 inputs). scale defaults to K ** -0.5 and
multiplies q; q and k are not normalised here (the layer does that). o has v's dtype and shape.

With cu_seqlens (offsets [N + 1] into T) B must be 1 and the N packed sequences are independent: the state
restarts at every boundary, initial_state and final_state are [N, H, K, V].

backend=None picks by device: the Triton kernels (kimi.ops.kda.triton) for CUDA tensors, PyTorch otherwise.
backend="triton" on CPU tensors runs the kernels under the Triton interpreter (TRITON_INTERPRET=1).
backend="fla" calls fla-core's kernels (kimi/ops/kda/fla.py; CUDA and the optional fla-core package).

Failures (kimi.ops.dispatch): with backend=None (model.kda.backend=auto) a Triton kernel that fails to compile
or launch sends that op (chunk_kda or fused_recurrent_kda) to its PyTorch path ("chunk", "recurrent") for the
rest of the process, with one warning; with backend="triton" it raises TritonKernelError. For chunk_kda with
gradients the choice is made at forward time: the forward and backward kernels are first probed on a tiny
input of the same dtypes and head dims, so a backward kernel that cannot compile falls back before the
forward runs (the module docstring of kimi.ops.dispatch says why, and what is not covered).
"""

from functools import partial

import torch

from kimi.ops.dispatch import Guard, auto_picks_triton, needs_grad

from .chunk import CHUNK_SIZE, bounded, chunk_kda_torch
from .fla import fla_chunk, fla_recurrent
from .naive import naive_recurrent_kda


def _triton_chunk(q, k, v, g, beta, scale, initial_state, cu_seqlens=None, lower_bound=None):
    from .triton import chunk_kda_triton  # imports triton, so only once asked for

    return chunk_kda_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens, lower_bound)


def _triton_recurrent(q, k, v, g, beta, scale, initial_state, cu_seqlens=None):
    from .triton import fused_recurrent_kda_triton

    return fused_recurrent_kda_triton(q, k, v, g, beta, scale, initial_state, cu_seqlens)


# Every backend computes (o, final_state) for a batch of equal-length sequences from a validated,
# possibly-None initial state; packing (cu_seqlens) is handled once, here, for all of them, except by
# backends marked takes_cu_seqlens, which get it as a last argument and run all sequences in one launch.
_triton_chunk.takes_cu_seqlens = _triton_recurrent.takes_cu_seqlens = True
_CHUNK_BACKENDS = {"naive": naive_recurrent_kda, "chunk": chunk_kda_torch, "triton": _triton_chunk,
                   "fla": fla_chunk}
_RECURRENT_BACKENDS = {"naive": naive_recurrent_kda, "recurrent": naive_recurrent_kda,
                       "triton": _triton_recurrent, "fla": fla_recurrent}


def _pick_backend(backend: str | None, backends: dict, default: str, op: str, device: torch.device):
    """Resolve a backend name to its function; None means Triton for CUDA tensors, `default` otherwise."""
    name = backend if backend is not None else ("triton" if auto_picks_triton(device) else default)
    if name not in backends:
        raise ValueError(f"{op}: unknown backend {backend!r}; allowed: {sorted(backends)}")
    return backends[name]


def _check(q, k, v, g, beta, initial_state, cu_seqlens) -> None:
    if q.dim() != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if g.shape != q.shape:
        raise ValueError(f"g must have q's shape {tuple(q.shape)}, got {tuple(g.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, V] = [{B}, {T}, {H}, V], got {tuple(v.shape)}")
    if beta.shape != q.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = [{B}, {T}, {H}], got {tuple(beta.shape)}")
    n = B
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens packs sequences along T and needs B == 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
            raise ValueError(f"cu_seqlens must be a 1-D integer tensor [N + 1], got {cu_seqlens}")
        n = cu_seqlens.numel() - 1
        # The values are checked eagerly only: under torch.compile reading them would break the graph.
        offsets = [] if torch.compiler.is_compiling() else cu_seqlens.tolist()
        rising = all(a <= b for a, b in zip(offsets, offsets[1:]))
        if offsets and (offsets[0] != 0 or offsets[-1] != T or not rising):
            raise ValueError(f"cu_seqlens must rise from 0 to T = {T}, got {offsets}")
    if initial_state is not None and initial_state.shape != (n, H, K, v.shape[-1]):
        what = "N (sequences in cu_seqlens)" if cu_seqlens is not None else "B"
        expected, got = [n, H, K, v.shape[-1]], tuple(initial_state.shape)
        raise ValueError(f"initial_state must be [{what}, H, K, V] = {expected}, got {got}")


def _call(fn, q, k, v, g, beta, scale, initial_state, cu_seqlens):
    """(o, final_state) from one backend, packing (cu_seqlens) handled for those that do not take it."""
    if getattr(getattr(fn, "func", fn), "takes_cu_seqlens", False):  # fn, or a partial of it
        return fn(q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if cu_seqlens is None:
        return fn(q, k, v, g, beta, scale, initial_state)
    # Each packed sequence runs alone: simple and exact.
    offsets = cu_seqlens.tolist()
    outputs, states = [], []
    for i, (start, end) in enumerate(zip(offsets, offsets[1:])):
        part = (x[:, start:end] for x in (q, k, v, g, beta))
        o_i, s_i = fn(*part, scale, None if initial_state is None else initial_state[i : i + 1])
        outputs.append(o_i)
        states.append(s_i)
    return torch.cat(outputs, dim=1), torch.cat(states, dim=0)


_FORCED_HINT = "backend='triton', i.e. model.kda.backend=triton"
_CHUNK_GUARD = Guard("chunk_kda", _FORCED_HINT)
_RECURRENT_GUARD = Guard("fused_recurrent_kda", _FORCED_HINT)
_PROBE_T = 16  # tokens of the probe input: a short chunk, same kernels and tiles as any length


def _probe_chunk(q, k, v, g, beta, initial_state, cu_seqlens, with_dht: bool, bounded: bool) -> None:
    """The chunk forward and backward kernels once on zeros shaped like these inputs but _PROBE_T long."""
    from .triton.op import kda_chunk_bwd, kda_chunk_fwd

    q_, k_, v_, g_, beta_ = (x.new_zeros(1, _PROBE_T, *x.shape[2:]) for x in (q, k, v, g, beta))
    h0 = None if initial_state is None else initial_state.new_zeros(1, *initial_state.shape[1:])
    cu_dtype = torch.int32 if cu_seqlens is None else cu_seqlens.dtype
    cu = torch.tensor([0, _PROBE_T], dtype=cu_dtype, device=q.device)
    o, ht = kda_chunk_fwd(q_, k_, v_, g_, beta_, 1.0, h0, cu, bounded)
    kda_chunk_bwd(q_, k_, v_, g_, beta_, 1.0, h0, cu, torch.zeros_like(o),
                  torch.zeros_like(ht) if with_dht else None, bounded)


def _run(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, guard=None,
         fallback=None, forced=False, lower_bound=None):
    """Check, then run `fn`; a Triton `fn` (guard given) falls back to `fallback` (kimi.ops.dispatch)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    args = (q, k, v, g, beta, scale, initial_state, cu_seqlens)
    if guard is None:
        o, state = _call(fn, *args)
    elif not guard.use_triton(forced):
        o, state = _call(fallback, *args)
    else:
        if guard is _CHUNK_GUARD and needs_grad(q, k, v, g, beta, initial_state):
            key = (q.device, *((x.dtype, tuple(x.shape[2:])) for x in (q, k, v, g, beta)),
                   None if initial_state is None else initial_state.dtype,
                   None if cu_seqlens is None else cu_seqlens.dtype, output_final_state, bounded(lower_bound))
            def probe():
                _probe_chunk(q, k, v, g, beta, initial_state, cu_seqlens, output_final_state, key[-1])

            if not guard.probe(key, "kda_chunk_fwd/kda_chunk_bwd", probe, forced):
                fn = fallback
        kernel = "kda_chunk_fwd" if guard is _CHUNK_GUARD else "kda_recurrent_fwd"
        o, state = guard.call(kernel, lambda *a: _call(fn, *a), lambda *a: _call(fallback, *a), forced, *args)
    return o, state if output_final_state else None


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA over whole sequences (training, prefill). backend: "triton" (default for CUDA tensors), "chunk"
    (PyTorch, the default otherwise), "fla" (fla-core's) or "naive". lower_bound: every g is >= it (Kimi
    K3's safe gate), which lets the chunk paths (PyTorch, Triton, fla) take their faster bounded form
    (kimi/ops/kda/chunk.py)."""
    torch_chunk = partial(chunk_kda_torch, lower_bound=lower_bound)
    fn = _pick_backend(backend, _CHUNK_BACKENDS, "chunk", "chunk_kda", q.device)
    guard = _CHUNK_GUARD if fn is _triton_chunk else None
    if fn in (chunk_kda_torch, _triton_chunk, fla_chunk):
        fn = partial(fn, lower_bound=lower_bound)
    return _run(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, guard,
                torch_chunk,
                backend is not None, lower_bound)


def fused_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA token by token (decoding: usually T = 1, state carried). backend: "triton" (default for CUDA
    tensors; forward only), "recurrent" (PyTorch, the default otherwise), "fla" (fla-core's) or "naive"."""
    fn = _pick_backend(backend, _RECURRENT_BACKENDS, "recurrent", "fused_recurrent_kda", q.device)
    guard = _RECURRENT_GUARD if fn is _triton_recurrent else None
    return _run(fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, guard,
                naive_recurrent_kda, backend is not None)


__all__ = ["CHUNK_SIZE", "chunk_kda", "fused_recurrent_kda", "naive_recurrent_kda"]
