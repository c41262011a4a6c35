"""Triton flash attention (kimi.ops.attention, backend "triton") against SDPA's flash backend, and the cost
of asking it for QK-Clip's max logits.

On a GPU, for each T: forward and forward+backward times in bf16, causal, B = tokens // T, for head dims
128/128 (NoPE) and 192/128 (NoPE + RoPE; SDPA's flash kernel needs equal q/k/v head dims, so it gets v
zero-padded to 192, what one does without a kernel that takes Dv != Dqk). Goals (issue 5): within 1.1x of
SDPA, max logits under 2%. Also the SDPA path's separate max-logit pass, the cost without a fused kernel.
On a GPU it first checks the compiled kernels (bf16, fp16; forward and gradients) against fp32 at odd
lengths, with fixed tiles; --check-only stops there (about a minute, mostly compilation).
On CPU timing means nothing: it runs a correctness spot-check under the Triton interpreter instead.
--dry-run runs the GPU code (check and timing) on CPU, interpreted, on tiny check cases and whatever sizes
are given: plumbing, not measurements (bench/gpu_check.py --dry-run). --skip-check times without checking.
--auto reports what model.attention.backend=auto picks at each shape, with the two backends' times as
its own timing measured them (bench/gpu_check.py's attention_auto step).
--compile-check (no GPU needed) compiles every kernel and tile candidate for sm_90 (--arch 90, default),
sm_80 (--arch 80) or both (--arch all) with triton's ptxas and reports registers, spills and shared memory
(attention_sm90_compile.json, attention_sm80_compile.json); bench/compile_check.py does the compiling.

    python bench/attention.py [--T 2048 4096 8192 16384] [--tokens 16384] [--heads 16]
                              [--dims 128/128 192/128] [--check-only | --skip-check] [--out PATH]
                              [--compile-check [--arch 90|80|all]]

Prints markdown tables and writes bench/results/attention.json (attention_gpu_check.json with --check-only,
attention_cpu_check.json on CPU), or --out. A failed GPU check exits 1 (after writing).
"""

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

# Before the kernels are defined, which is when triton reads it. --compile-check needs real kernels.
if (not torch.cuda.is_available() or "--dry-run" in sys.argv) and "--compile-check" not in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kimi.ops.attention import attention  # noqa: E402
from kimi.ops.attention.reference import naive_attention  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def make_inputs(B, T, H, dqk, dv, dtype, device, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q, k = (torch.randn(B, T, H, dqk, generator=gen, device=device, dtype=dtype) for _ in range(2))
    v = torch.randn(B, T, H, dv, generator=gen, device=device, dtype=dtype)
    return [x.requires_grad_() for x in (q, k, v)]


def scores_reference(q, k, v, causal, scale, cu_seqlens):
    """fp32 explicit-score attention -> (o, lse [B, H, Tq], max_logits [B, H]); for the GPU check."""
    o, max_logits, lse = naive_attention(q, k, v, causal, scale, cu_seqlens, return_lse=True)
    return o, lse, max_logits


# name: (B, Tq, Tk, H, Hkv, Dqk, Dv, causal, cu_seqlens); lengths off the tile sizes on purpose
GPU_CHECKS = {
    "causal 128/128": (2, 1000, 1000, 4, 4, 128, 128, True, None),
    "MQA 192/128": (1, 777, 777, 4, 1, 192, 128, True, None),
    "decode tail GQA": (2, 37, 1000, 4, 2, 128, 128, True, None),
    "packed GQA 192/128": (1, 1500, 1500, 4, 2, 192, 128, True, [0, 100, 611, 612, 1400]),
    "not causal 64/64": (2, 300, 500, 2, 2, 64, 64, False, None),
}
# the same kinds of case small enough for the interpreter (--dry-run)
DRY_CHECKS = {
    "causal 32/32": (1, 40, 40, 2, 2, 32, 32, True, None),
    "packed MQA 48/32": (1, 50, 50, 2, 1, 48, 32, True, [0, 7, 8, 50]),
    "not causal 16/16": (1, 20, 33, 1, 1, 16, 16, False, None),
}


# Context parallelism's MLA (kimi/ops/attention/latent.py): one block of queries over a prefix of latents
# up-projected a block at a time. name: (B, block, blocks, H, nope, rope, Dv, R)
LATENT_CHECKS = {
    "1b's MLA, 4 blocks of 512": (1, 512, 4, 4, 128, 0, 128, 512),
    "rope 64, 3 blocks of 300": (1, 300, 3, 4, 128, 64, 128, 512),
}
DRY_LATENT_CHECKS = {
    "2 blocks of 20": (1, 20, 2, 2, 16, 0, 16, 32),
    "rope 8, 3 blocks of 12": (1, 12, 3, 2, 16, 8, 16, 24),
}
LATENT_KEYS = ("o", "max_logits", "dq", "dc", "dr", "dw")


def latent_check(dtypes=(torch.bfloat16,), device="cuda", cases=None) -> list[dict]:
    """latent_attention (compiled on a GPU) against fp32 attention over the whole prefix up-projected at
    once: o, max logits and the gradients of q, the latents c, the shared rope keys r and the fp32
    up-projection w, which reaches the op cast to the activations' dtype as MLA casts it (attend_latents)."""
    from kimi.ops.attention.latent import latent_attention

    rows = []
    for dtype, (name, case) in itertools.product(dtypes, (LATENT_CHECKS if cases is None else cases).items()):
        B, block, blocks, H, nope, rope, dv, R = case
        gen = torch.Generator(device=device).manual_seed(1)
        Tk = block * blocks
        q = torch.randn(B, block, H, nope + rope, generator=gen, device=device).to(dtype)
        c = torch.randn(B, Tk, R, generator=gen, device=device).to(dtype)
        r = torch.randn(B, Tk, rope, generator=gen, device=device).to(dtype)
        w = torch.randn(H * (nope + dv), R, generator=gen, device=device) * R**-0.5
        do = torch.randn(B, block, H, dv, generator=gen, device=device).to(dtype)
        leaves = [x.detach().requires_grad_() for x in (q, c, r, w)]
        o, m = latent_attention(*leaves[:3], leaves[3].to(dtype), nope, block, return_max_logits=True)
        got = dict(zip(LATENT_KEYS, (o, m, *torch.autograd.grad(o, leaves, do))))
        ref = [x.detach().float().requires_grad_() for x in (q, c, r, w)]
        kv = (ref[1] @ ref[3].T).view(B, Tk, H, nope + dv)
        k = torch.cat([kv[..., :nope], ref[2][:, :, None].expand(-1, -1, H, -1)], dim=-1)
        o_ref, m_ref = naive_attention(ref[0], k, kv[..., nope:], causal=True)
        want = dict(zip(LATENT_KEYS, (o_ref, m_ref, *torch.autograd.grad(o_ref, ref, do.float()))))
        row = dict(dtype=str(dtype).split(".")[-1], case=name)
        for key in LATENT_KEYS:  # r has no elements without rope
            row[key] = ((got[key].float() - want[key]).norm() / want[key].norm().clamp_min(1e-30)).item()
        row["nan"] = any(t.isnan().any().item() for t in got.values())
        # the op rounds each block's keys and values to the dtype once up-projected (as MLA's forward does),
        # so the max logits carry that rounding too: every result gets the attention check's 2e-2
        row["ok"] = not row["nan"] and all(row[key] < 2e-2 for key in LATENT_KEYS)
        rows.append(row)
    print("\n| dtype | case | " + " | ".join(LATENT_KEYS)
          + " | ok |  (MLA over latent blocks, rel. error vs fp32)")
    print("|---|---|" + "---|" * (len(LATENT_KEYS) + 1))
    for r in rows:
        print(f"| {r['dtype']} | {r['case']} | " + " | ".join(f"{r[k]:.1e}" for k in LATENT_KEYS)
              + f" | {'ok' if r['ok'] else 'FAILED'} |")
    return rows


def gpu_check(dtypes=(torch.bfloat16, torch.float16), device="cuda", cases=None, plant=False) -> list[dict]:
    """Kernels on the GPU (compiled, not interpreted) against an fp32 reference built from the same
    rounded inputs: O, LSE, max logits, dQ, dK, dV. Fixed tiles, so it costs no autotuning. device="cpu"
    (with TRITON_INTERPRET=1) runs the same code interpreted; plant=True (tests) perturbs one result."""
    from kimi.ops.attention.triton import common, flash_attention

    common.AUTOTUNE, tuned, atomic = False, common.AUTOTUNE, common.DQ_ATOMIC
    rows = []
    cases = GPU_CHECKS if cases is None else cases
    for dtype, atomic_dq, (name, case) in itertools.product(dtypes, (False, True), cases.items()):
        B, Tq, Tk, H, Hkv, dqk, dv, causal, cu = case
        common.DQ_ATOMIC = atomic_dq
        gen = torch.Generator(device=device).manual_seed(0)
        q = torch.randn(B, Tq, H, dqk, generator=gen, device=device).to(dtype).requires_grad_()
        k = torch.randn(B, Tk, Hkv, dqk, generator=gen, device=device).to(dtype).requires_grad_()
        v = torch.randn(B, Tk, Hkv, dv, generator=gen, device=device).to(dtype).requires_grad_()
        cu_seqlens = None if cu is None else torch.tensor(cu, device=device)
        scale = dqk**-0.5
        o, lse, m = flash_attention(q, k, v, causal, scale, cu_seqlens, return_max_logits=True)
        do = torch.randn(o.shape, generator=gen, device=device).to(dtype)
        grads = torch.autograd.grad(o, (q, k, v), do)
        if plant and not rows:
            grads = (grads[0] * 1.1, *grads[1:])
        q32, k32, v32 = (x.detach().float().requires_grad_() for x in (q, k, v))
        o_ref, lse_ref, m_ref = scores_reference(q32, k32, v32, causal, scale, cu_seqlens)
        grads_ref = torch.autograd.grad(o_ref, (q32, k32, v32), do.float())
        got = {"o": o, "lse": lse, "max_logits": m, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
        want = {"o": o_ref, "lse": lse_ref, "max_logits": m_ref, "dq": grads_ref[0], "dk": grads_ref[1],
                "dv": grads_ref[2]}
        row = dict(dtype=str(dtype).split(".")[-1], case=name, dq_mode="atomic" if atomic_dq else "separate")
        for key in got:
            row[key] = ((got[key].float() - want[key]).norm() / want[key].norm()).item()
        row["nan"] = any(t.isnan().any().item() for t in got.values())
        # bf16 has 8 mantissa bits: ~1e-2 relative error on outputs; logits come from fp32 accumulation
        limit = {"max_logits": 1e-5, "lse": 1e-4}
        row["ok"] = not row["nan"] and all(row[key] < limit.get(key, 2e-2) for key in got)
        rows.append(row)
    common.AUTOTUNE, common.DQ_ATOMIC = tuned, atomic
    print("\n| dtype | case | dQ by | o | lse | max logits | dq | dk | dv | ok |  (relative error vs fp32)")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        errors = " | ".join(f"{r[key]:.1e}" for key in ("o", "lse", "max_logits", "dq", "dk", "dv"))
        print(f"| {r['dtype']} | {r['case']} | {r['dq_mode']} | {errors} | {'ok' if r['ok'] else 'FAILED'} |")
    return rows


def gpu_bench(args, device="cuda", done=lambda rows: None) -> dict:
    """Timing per (head dims, T); done(rows) after each, to keep what is measured should a later one hang."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from triton.testing import do_bench

    def ms(fn, grads=()):
        if device == "cpu":  # a dry run: the code path, not a measurement (one call after a warm-up)
            for x in grads:
                x.grad = None
            fn()
            start = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - start)
        return do_bench(fn, warmup=25, rep=100, grad_to_none=list(grads), return_mode="median")

    rows = []
    for dims in args.dims:
        dqk, dv = (int(x) for x in dims.split("/"))
        for T in args.T:
            B = max(1, args.tokens // T)
            q, k, v = make_inputs(B, T, args.heads, dqk, dv, torch.bfloat16, device)
            do = torch.randn(B, T, args.heads, dv, device=device, dtype=torch.bfloat16)
            # SDPA layout [B, H, T, D] as views of the same [B, T, H, D] storage; v padded when dv != dqk
            v_sdpa = F.pad(v.detach(), (0, dqk - dv)).requires_grad_() if dv != dqk else v
            do_sdpa = F.pad(do, (0, dqk - dv))

            def sdpa():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                       v_sdpa.transpose(1, 2), is_causal=True)
                return o.transpose(1, 2)

            def ours(max_logits, deterministic=True):
                return lambda: attention(q, k, v, backend="triton", return_max_logits=max_logits,
                                         deterministic=deterministic)

            def sdpa_path():  # SDPA's own pick of its kernels, plus the Triton row-max pass
                return attention(q, k, v, backend="sdpa", return_max_logits=True)

            def first(fn):
                return lambda: (lambda out: out[0] if isinstance(out, tuple) else out)(fn())

            # the output at this size against fp32 SDPA, on two heads of the first sequence (memory)
            with torch.no_grad():
                o = ours(True)()[0][:1, :, :2].float()
                heads = (x[:1, :, :2].float().transpose(1, 2) for x in (q, k, v))
                ref = F.scaled_dot_product_attention(*heads, is_causal=True).transpose(1, 2)
            err = ((o - ref).norm() / ref.norm()).item()
            row = dict(dims=dims, T=T, B=B, rel_err_vs_fp32=err)
            with torch.no_grad():
                row["sdpa_fwd_ms"] = ms(sdpa)
                row["triton_fwd_ms"] = ms(ours(False))
                row["triton_fwd_max_ms"] = ms(ours(True))
                row["sdpa_path_fwd_max_ms"] = ms(sdpa_path)
            row["sdpa_fwdbwd_ms"] = ms(lambda: sdpa().backward(do_sdpa), (q, k, v_sdpa))
            row["triton_fwdbwd_ms"] = ms(lambda: first(ours(False))().backward(do), (q, k, v))
            row["triton_fwdbwd_max_ms"] = ms(lambda: first(ours(True))().backward(do), (q, k, v))
            row["triton_fwdbwd_atomic_dq_ms"] = ms(lambda: first(ours(False, False))().backward(do),
                                                   (q, k, v))
            row["triton_fwdbwd_atomic_dq_max_ms"] = ms(lambda: first(ours(True, False))().backward(do),
                                                       (q, k, v))
            row["sdpa_path_fwdbwd_max_ms"] = ms(lambda: first(sdpa_path)().backward(do), (q, k, v))
            rows.append(row)
            print(row, flush=True)
            done(rows)
            # frees this size's tensors before the next: rebound, not deleted, as the closures above read them
            q = k = v = v_sdpa = do = do_sdpa = None
            torch.cuda.empty_cache()

    print("\n| dims | T | B | err | fwd SDPA ms | fwd ours ms | ratio | +max | fwd+bwd SDPA ms | ours ms "
          "| ratio | +max | atomic dQ ratio | SDPA-path max pass | with max: ours (atomic) | with max: SDPA "
          "path |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dims']} | {r['T']} | {r['B']} | {r['rel_err_vs_fp32']:.1e} | {r['sdpa_fwd_ms']:.3f} | "
              f"{r['triton_fwd_ms']:.3f} | {r['triton_fwd_ms'] / r['sdpa_fwd_ms']:.2f}x | "
              f"{100 * (r['triton_fwd_max_ms'] / r['triton_fwd_ms'] - 1):+.1f}% | "
              f"{r['sdpa_fwdbwd_ms']:.3f} | "
              f"{r['triton_fwdbwd_ms']:.3f} | {r['triton_fwdbwd_ms'] / r['sdpa_fwdbwd_ms']:.2f}x | "
              f"{100 * (r['triton_fwdbwd_max_ms'] / r['triton_fwdbwd_ms'] - 1):+.1f}% | "
              f"{r['triton_fwdbwd_atomic_dq_ms'] / r['sdpa_fwdbwd_ms']:.2f}x | "
              f"{100 * (r['sdpa_path_fwd_max_ms'] / r['sdpa_fwd_ms'] - 1):+.0f}% | "
              f"{r['triton_fwdbwd_atomic_dq_max_ms'] / r['sdpa_fwdbwd_ms']:.2f}x | "
              f"{r['sdpa_path_fwdbwd_max_ms'] / r['sdpa_fwdbwd_ms']:.2f}x |")
    # the backward's one switch (kimi/ops/attention/triton/common.py), both timed above
    dq_modes = {"separate": "a second kernel recomputes P and dP, deterministic "
                            "(model.attention.deterministic=true): triton_fwdbwd_ms",
                "atomic": "default: fp32 atomic adds in the dK/dV kernel, not bitwise deterministic: "
                          "triton_fwdbwd_atomic_dq_ms"}
    return dict(heads=args.heads, tokens=args.tokens, dtype="bfloat16", causal=True, dq_modes=dq_modes,
                rows=rows)


def auto_picks(args, device: str, done=lambda rows: None) -> list[dict]:
    """What model.attention.backend=auto picks at each shape (causal, with QK-Clip's max logits, bf16, B =
    tokens // T): kimi.ops.attention.auto's own timing of both backends, forward and backward, as a training
    run's first call of that shape makes it."""
    from kimi.ops.attention import auto

    rows = []
    for T, dims in itertools.product(args.T, args.dims):
        dqk, dv = map(int, dims.split("/"))
        B = max(1, args.tokens // T)
        q, k, v = make_inputs(B, T, args.heads, dqk, dv, torch.bfloat16, device)
        auto.reset()
        t0 = time.perf_counter()
        choice = auto.choose(q, k, v, True, dqk**-0.5, None, True, None)
        (times,) = auto.TIMINGS.values()
        rows.append({"T": T, "B": B, "dims": dims, "choice": choice, "seconds": time.perf_counter() - t0,
                     **{f"{name}_fwdbwd_ms": 1e3 * s for name, s in times.items()}})
        done(rows)
    return rows


def cpu_check() -> dict:
    """Small fp32 cases through the interpreted kernels against fp64, forward and backward."""
    print("Timing needs a GPU; running a correctness spot-check of the Triton kernels under the interpreter.")
    cases = {"causal 64/64": (2, 48, 2, 2, 64, 64, None), "MQA 192/128": (1, 64, 2, 1, 192, 128, None),
             "packed GQA 24/16": (1, 50, 4, 2, 24, 16, [0, 7, 31, 50])}
    rows = []
    for name, (B, T, H, Hkv, dqk, dv, cu) in cases.items():
        q, k, v = make_inputs(B, T, H, dqk, dv, torch.float32, "cpu")
        k, v = (x.detach()[:, :, :Hkv].contiguous().requires_grad_() for x in (k, v))
        cu_seqlens = None if cu is None else torch.tensor(cu)
        o, m = attention(q, k, v, cu_seqlens=cu_seqlens, return_max_logits=True, backend="triton")
        grads = torch.autograd.grad(o.square().sum(), (q, k, v))
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        o_ref, m_ref = naive_attention(q64, k64, v64, cu_seqlens=cu_seqlens)
        grads_ref = torch.autograd.grad(o_ref.square().sum(), (q64, k64, v64))
        err = {"o": o, "max_logits": m, "dq": grads[0], "dk": grads[1], "dv": grads[2]}
        ref = {"o": o_ref, "max_logits": m_ref.double(), "dq": grads_ref[0], "dk": grads_ref[1],
               "dv": grads_ref[2]}
        row = {"case": name}
        for key in err:
            row[key] = ((err[key].double() - ref[key]).norm() / ref[key].norm()).item()
        rows.append(row)
    print("\n| case | o | max logits | dq | dk | dv |  (relative error vs fp64)")
    print("|---|---|---|---|---|---|")
    for r in rows:
        errors = " | ".join(f"{r[key]:.1e}" for key in ("o", "max_logits", "dq", "dk", "dv"))
        print(f"| {r['case']} | {errors} |")
    worst = max(v for r in rows for k, v in r.items() if k != "case")
    print(f"\nworst relative error {worst:.1e} ({'ok' if worst < 1e-5 else 'FAILED'}: goal < 1e-5)")
    return dict(device="cpu (Triton interpreter)", torch=torch.__version__, dtype="float32", rows=rows)


def compile_check(args, arch: int = 90) -> dict:
    """Compile every kernel and tile candidate for sm_<arch> (90 Hopper, 80 Ampere) with the ptxas bundled
    with triton (no GPU needed) and report registers, spills and shared memory: a kernel that fails here
    fails on that GPU (bench/compile_check.py)."""
    import triton

    from compile_check import ARCHS, compile_kernel, spilled
    from kimi.ops.attention.triton import backward, common, forward

    if common.INTERPRET:
        raise SystemExit("--compile-check needs TRITON_INTERPRET unset")
    target, _, per_block = ARCHS[arch]
    pointers = {"LSE": "*fp32", "ROWMAX": "*fp32", "DELTA": "*fp32", "DLSE": "*fp32", "DQACC": "*fp32",
                "SEG": "*i32", "DSTART": "*i32", "DEND": "*i32"}
    kernels = {"fwd": (forward._fwd_kernel, forward._fwd_tuned.configs, dict(STORE_MAX=True, MAX_ONLY=False)),
               "fwd max only": (forward._fwd_kernel, forward._fwd_tuned.configs,
                                dict(STORE_MAX=True, MAX_ONLY=True)),
               "dkdv": (backward._dkdv_kernel, backward._dkdv_tuned.configs, dict(ATOMIC_DQ=False)),
               "dkdv+atomic dq": (backward._dkdv_kernel, backward._dkdv_tuned.configs, dict(ATOMIC_DQ=True)),
               "dq": (backward._dq_kernel, backward._dq_tuned.configs, {}),
               # the launch's fixed tiles (backward.py): BLOCK_M 64, triton's default warps and stages
               "delta": (backward._delta_kernel, [triton.Config(dict(BLOCK_M=64))], dict(HAS_DLSE=False)),
               "delta+dlse": (backward._delta_kernel, [triton.Config(dict(BLOCK_M=64))], dict(HAS_DLSE=True))}
    quick = getattr(args, "quick", False)  # the first tile candidate of each kernel, causal, not packed
    rows = []
    for dims in args.dims:
        dqk, dv = (int(x) for x in dims.split("/"))
        d1, d2, dvb = common.head_blocks(dqk, dv)
        for causal, varlen in ((True, False),) if quick else ((True, False), (True, True), (False, False)):
            for name, (kernel, configs, extra) in kernels.items():
                for cfg in configs if causal and not varlen and not quick else configs[:1]:
                    consts = dict(DQK=dqk, DV=dv, CAUSAL=causal, VARLEN=varlen, BLOCK_D1=d1, BLOCK_D2=d2,
                                  BLOCK_DV=dvb, UPCAST=False, PRECISION="tf32", **extra, **cfg.kwargs)
                    consts = {k: v for k, v in consts.items() if k in kernel.arg_names}
                    signature, attrs = {}, {}
                    for i, arg in enumerate(kernel.arg_names):
                        if arg in consts:
                            signature[arg] = "constexpr"
                        elif arg.isupper() and arg not in ("H", "GROUP"):
                            signature[arg] = pointers.get(arg, "*bf16")
                            attrs[(i,)] = [["tt.divisibility", 16]]
                        elif arg in ("qk_scale", "scale"):
                            signature[arg] = "fp32"
                        else:  # sizes and strides; real strides of contiguous bf16 tensors divide by 16
                            signature[arg] = "i32"
                            if arg.startswith("s"):
                                attrs[(i,)] = [["tt.divisibility", 16]]
                    row = dict(kernel=name, fn=kernel.__name__, dims=dims, causal=causal, varlen=varlen,
                               tiles=cfg.kwargs, warps=cfg.num_warps, stages=cfg.num_stages)
                    row.update(compile_kernel(kernel, signature, consts, attrs, arch, cfg.num_warps,
                                              cfg.num_stages))
                    rows.append(row)
                    print(row, flush=True)
    print(f"\n## {target}\n")
    print("| kernel | dims | mask | tiles (M, N) | warps | stages | regs | spill st/ld B | stack | smem B |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mask = ("causal" if r["causal"] else "full") + (" varlen" if r["varlen"] else "")
        tail = (f"FAILED: {r['error']} | | | " if "error" in r
                else f"{r['regs']} | {r['spill_stores']}/{r['spill_loads']} | {r['spill_stack']} | "
                f"{r['smem']}" + (" OVER" if r["smem_over_limit"] else ""))
        tiles = f"{r['tiles']['BLOCK_M']}, {r['tiles'].get('BLOCK_N', '-')}"
        print(f"| {r['kernel']} | {r['dims']} | {mask} | {tiles} | {r['warps']} | {r['stages']} | {tail} |")
    failed = sum("error" in r for r in rows)
    over = sum(bool(r.get("smem_over_limit")) for r in rows)
    print(f"\n{len(rows) - failed} of {len(rows)} compiled for {target}; {sum(map(spilled, rows))} spill; "
          f"{over} above {per_block} B of shared memory per block (cannot launch; autotuning skips them)")
    return dict(target=f"{target}, compiled, not run", triton=triton.__version__,
                smem_limit_per_block=per_block, kernels=sorted(kernels),
                functions=sorted({k[0].__name__ for k in kernels.values()}), rows=rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--tokens", type=int, default=16384, help="B * T per measurement")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dims", nargs="+", default=["128/128", "192/128"], help="Dqk/Dv pairs")
    parser.add_argument("--check-only", action="store_true", help="GPU: correctness check, no timing")
    parser.add_argument("--skip-check", action="store_true", help="GPU: timing only")
    parser.add_argument("--auto", action="store_true",
                        help="GPU: what model.attention.backend=auto picks at each --T and --dims, no check")
    parser.add_argument("--dry-run", action="store_true",
                        help="the GPU code on CPU, interpreted, tiny check cases: plumbing only")
    parser.add_argument("--plant-failure", action="store_true", help="tests: the GPU check must fail")
    parser.add_argument("--out", type=Path, default=None, help="the JSON's path (default: bench/results/)")
    parser.add_argument("--compile-check", action="store_true",
                        help="no GPU needed: compile all kernels for --arch, report registers and spills")
    parser.add_argument("--arch", default="90", choices=["90", "80", "all"], help="--compile-check target")
    parser.add_argument("--quick", action="store_true",
                        help="--compile-check: first tile candidate per kernel, causal only (a smoke test)")
    args = parser.parse_args()
    RESULTS.mkdir(exist_ok=True)
    if args.compile_check:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from compile_check import write_archs

        write_archs(compile_check, args, RESULTS, "attention")
        return
    elif torch.cuda.is_available() or args.dry_run:
        import triton

        device = "cpu" if args.dry_run else "cuda"
        name = "CPU (dry run, Triton interpreted)" if args.dry_run else torch.cuda.get_device_name()
        result = dict(device=name, torch=torch.__version__, triton=triton.__version__)
        if args.auto:
            path = args.out or RESULTS / "attention_auto.json"

            def save(rows, complete=False):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(dict(result, heads=args.heads, tokens=args.tokens, rows=rows,
                                                complete=complete), indent=2) + "\n")

            rows = auto_picks(args, device, save)
            save(rows, complete=True)
            print("| T | B | Dqk/Dv | picks | triton fwd+bwd | SDPA path fwd+bwd |\n"
                  "|---|---|---|---|---|---|")
            for r in rows:
                print(f"| {r['T']} | {r['B']} | {r['dims']} | {r['choice']} | "
                      f"{r.get('triton_fwdbwd_ms', 0):.3f} ms | {r.get('sdpa_fwdbwd_ms', 0):.3f} ms |")
            print(f"wrote {path}")
            return
        if not args.skip_check:
            checks = gpu_check(device=device, cases=DRY_CHECKS if args.dry_run else GPU_CHECKS,
                               plant=args.plant_failure)
            latent = latent_check(device=device, cases=DRY_LATENT_CHECKS if args.dry_run else LATENT_CHECKS)
            result.update(checks=checks, latent_checks=latent, ok=all(r["ok"] for r in checks + latent))
        path = args.out or RESULTS / ("attention_gpu_check.json" if args.check_only else "attention.json")
        if not args.check_only:
            def done(rows):
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = dict(result, heads=args.heads, tokens=args.tokens, rows=rows, complete=False)
                path.write_text(json.dumps(partial, indent=2) + "\n")

            result.update(gpu_bench(args, device, done), complete=True)
    else:
        result, path = cpu_check(), RESULTS / "attention_cpu_check.json"
    path = args.out or path
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    if result.get("ok") is False:
        failed = [f"{r['dtype']} {r['case']} ({r['dq_mode']} dQ)" for r in result["checks"] if not r["ok"]]
        failed += [f"{r['dtype']} MLA over latent blocks, {r['case']}"
                   for r in result.get("latent_checks", []) if not r["ok"]]
        raise SystemExit(f"attention check FAILED: {'; '.join(failed)}")


if __name__ == "__main__":
    main()
