"""backend="auto": for each attention shape, time the Triton kernel against SDPA (with its max-logit pass)
once, forward and backward on random inputs of that shape, and keep the faster one that agrees with SDPA.

The first call of a shape pays the timing (a few launches of each backend, Triton's compilation included in
its warm-up) and prints one line; later calls, the recomputed forwards of activation checkpointing among them,
read the cached choice, so a forward and its recompute always agree; the timing runs outside every dispatch
mode and saved-tensor hook (kimi.ops.dispatch.aside: in a checkpointed sublayer's first forward, checkpointing
would keep the timed runs' outputs or saved tensors as the region's). Under torch.compile the choice is made
while the graph is traced: `_timed` runs eagerly on real tensors (Dynamo treats its result as a constant), so
the compiled graph holds one backend and no graph break. Each process times for itself.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

WARMUP, REPEATS = 2, 5
# Output agreement with SDPA that a candidate must reach, relative to the output's largest magnitude: bf16
# rounding of the inputs and outputs stays far below it, a wrong kernel far above.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}

_CHOSEN: dict[tuple, str] = {}
TIMINGS: dict[tuple, dict[str, float]] = {}  # key -> seconds of each candidate that ran and agreed
LOG: Callable[[str], None] = lambda line: print(line, flush=True)  # noqa: E731 (tests capture it)
# Registered by kimi.ops.attention (which imports this module, not the other way round): name -> the backend,
# called as attention()'s (q, k, v, causal, scale, cu_seqlens, return_max_logits, atomic_dq); "sdpa" is the
# reference the others must agree with. attention() asks only while no Triton failure has sent it to SDPA.
CANDIDATES: dict[str, Callable] = {}


def register(**candidates: Callable) -> None:
    CANDIDATES.update(candidates)


def reset() -> None:
    _CHOSEN.clear()
    TIMINGS.clear()


def _seconds(fn: Callable[[], None], device: torch.device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _inputs(key: tuple):
    device, dtype, B, Tq, Tk, H, Hkv, D, Dv, causal, packed, max_logits, atomic_dq = key
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(B, T, h, d, device=device, dtype=dtype, generator=gen, requires_grad=True)
               for T, h, d in ((Tq, H, D), (Tk, Hkv, D), (Tk, Hkv, Dv)))
    cu = torch.tensor([0, Tk], dtype=torch.int32, device=device) if packed else None
    return (q, k, v, causal, D**-0.5, cu, max_logits, atomic_dq), torch.randn(B, Tq, H, Dv, device=device,
                                                                               dtype=dtype, generator=gen)


def _first(out):
    return out[0] if isinstance(out, tuple) else out


@torch._dynamo.assume_constant_result
def _timed(*key) -> str:
    from kimi.ops.dispatch import aside

    if key in _CHOSEN:
        return _CHOSEN[key]
    # aside: real tensors under torch.compile's fake mode too (every dispatch mode is left)
    with aside(), torch.enable_grad(), torch.autocast(key[0].type, enabled=False):
        args, grad = _inputs(key)
        expected = _first(CANDIDATES["sdpa"](*args)).detach().float()
        times = {}
        for name, fn in CANDIDATES.items():
            try:  # forward and backward once: a backward kernel that cannot run here fails here, not later
                out = _first(fn(*args))
                torch.autograd.grad(out, args[:3], grad)
            except Exception as exc:  # noqa: BLE001 (a kernel that cannot run here is not a candidate)
                LOG(f"[kimi] attention auto: {name} failed on this shape ({type(exc).__name__}: {exc})")
                continue
            error = (out.detach().float() - expected).abs().max() / expected.abs().max().clamp_min(1e-30)
            if name != "sdpa" and not error <= TOLERANCE.get(key[1], 5e-2):
                LOG(f"[kimi] attention auto: {name} differs from SDPA by {float(error):.1e} (relative): "
                    "skipped")
                continue
            times[name] = _seconds(lambda: torch.autograd.grad(_first(fn(*args)), args[:3], grad), key[0])
    choice = min(times, key=times.get) if times else "sdpa"
    _, dtype, B, Tq, Tk, H, Hkv, D, Dv = key[:9]
    shape = f"B={B} Tq={Tq} Tk={Tk} H={H}/{Hkv} D={D}/{Dv} {str(dtype).removeprefix('torch.')}"
    timing = ", ".join(f"{name} {1e3 * s:.3f} ms" for name, s in times.items())
    LOG(f"[kimi] attention auto ({shape}, forward+backward): {timing} -> {choice}")
    _CHOSEN[key], TIMINGS[key] = choice, times
    return choice


def choose(q, k, v, causal, scale, cu_seqlens, return_max_logits, atomic_dq) -> str:
    """The backend ("triton" or "sdpa") for this call's shape: timed on its first call, cached after."""
    B, Tq, H, D = q.shape
    _, Tk, Hkv, Dv = v.shape
    dims = (B, Tq, Tk, H, Hkv, D, Dv)
    if not all(isinstance(d, int) for d in dims):  # no concrete shape to time (dynamic shapes): the default
        return "triton"
    return _timed(q.device, q.dtype, *dims, bool(causal), cu_seqlens is not None, bool(return_max_logits),
                  atomic_dq)
