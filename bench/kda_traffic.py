"""KDA chunk kernels' GPU memory traffic, counted from the code: bytes read and written per token and head.

Training setting: bf16 q, k, v, beta and output gradient do; fp32 gate g (as the model feeds it); head
dims K = V = 128 (--K, --V); chunk C = 64. Two implementations side by side, forward and backward:
- fla-core's chunk_kda, as installed (0.6.0), default path (use_gate_in_kernel=False, safe_gate=False,
  disable_recompute=False, no context parallelism, Triton backends): fla/ops/kda/{chunk.py, chunk_fwd.py,
  chunk_bwd.py, chunk_intra.py, chunk_intra_token_parallel.py, wy_fast.py}, fla/ops/common/chunk_delta_h.py,
  fla/ops/gla/chunk.py, fla/ops/utils/cumsum.py;
- ours: kimi/ops/kda/triton/{common.py, chunk_fwd.py, chunk_bwd.py}.

Counting rules. A tensor counts once per program (Triton instance) that loads it: programs share nothing
through caches, so a grid of V/BV value-block programs that each load all of k reads k V/BV times. A
program loading the same tile twice counts it once (registers, L1). Masked-out elements and arguments
never loaded count zero; stores count once. Torch memsets (torch.zeros) and the casts of the gradients to
the inputs' dtypes count too (a cast to the same dtype moves nothing). The "once" figures cap every
tensor at one read per kernel: what is left if L2 caught every re-read across programs.
Not counted: L2 reuse (but see "once"); cu_seqlens, chunk tables, scalars; per-sequence states (initial
and final states and their gradients, [N, H, K, V]: once per sequence, ~0 per token); short last chunks
(T a multiple of C); autotuning runs; anything outside the op.

Our table (OURS_*) is data, one literal per kernel, checked against the code on every run: the kernels
chunk_fwd and chunk_bwd launch (forward_intermediates' for the backward's rerun), the buffers each launch
passes, each grid's value-block count (evaluated with tiles(K, V)), the dtype of every scratch(...) buffer
and the gradients chunk_bwd casts. A mismatch stops the script: update the table. What a kernel loads of
each buffer (whole rows, some blocks, a chunk's last row) is read by hand from the kernel bodies; the
check does not see a changed access pattern inside a kernel.

    python bench/kda_traffic.py [--K 128 --V 128] [--fla-bv-h 64] [--fla-bv-o 128] [--out PATH]
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import json
import math
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "kimi" / "ops" / "kda" / "triton"
FILES = ("common.py", "chunk_fwd.py", "chunk_bwd.py")
sys.path.insert(0, str(ROOT))
os.environ.pop("TRITON_INTERPRET", None)  # tiles() must give the compiled (GPU) tile sizes

# Storage kinds -> (dtype, bytes): "in" the inputs' dtype, "g" the gate's as the model feeds it.
DTYPES = {"in": ("bf16", 2), "g": ("fp32", 4), "f32": ("fp32", 4), "bf16": ("bf16", 2), "f16": ("fp16", 2)}
INPUT_KINDS = {"q": "in", "k": "in", "v": "in", "beta": "in", "do": "in", "g": "g"}
TORCH_KINDS = {"torch.float32": "f32", "torch.float": "f32", "torch.bfloat16": "bf16", "torch.float16": "f16"}
NOT_BUFFERS = {"cu_seqlens", "chunks", "first_chunk", "scale", "H"}  # small tables and scalars
C_FLA, BC_FLA, BK_FLA_INTRA = 64, 16, 32  # fla's chunk_size default, sub-chunk, chunk_kda_bwd_intra's BK

# Row: (tensor, kind, elements per token and head, reads, writes, programs that read it). Elements: K, V,
# C for [T, H, *] tensors, K*V/C for per-chunk states [NT, H, K, V], 0 for per-sequence states. Reads and
# writes: the fraction of those elements moved, maybe a formula. Kind "a>b": read as a, written as b.
# Symbols: BC sub-chunk, NC = C/BC; ours: P = value-block programs of the kernel's grid (parsed);
# fla: NVh = V/BV of its two state kernels, NVo = V/BV of its output kernel, NKi = K/32 (bwd_intra).
TRI = "(NC+1)/(2*NC)"  # the sub-chunk blocks on and below the diagonal of a [C, C] matrix


def wu(bwd):  # the backward's rerun also stores QG = scale exp(G) q, for the state gradient pass
    return [("q", "in", "K", bwd, 0, 1), ("k", "in", "K", 1, 0, 1), ("v", "in", "V", 1, 0, 1),
            ("beta", "in", "1", 1, 0, 1), ("Gc", "f32", "K", 1, 0, 1), ("Ainv", "in", "C", 1, 0, 1),
            ("W", "in", "K", 0, 1, 1), ("U", "f32", "V", 0, 1, 1), ("KG", "in", "K", 0, 1, 1),
            ("QG", "in", "K", 0, bwd, 1)]


# Entry: (stage, label, Triton kernel or None for torch ops, rows). A stage pairs kernels with fla's.
OURS_FWD = [
    ("cumsum", "chunk_cumsum (G)", "chunk_cumsum_kernel",
     [("x", "g", "K", 1, 0, 1), ("out", "f32", "K", 0, 1, 1)]),
    ("scores", "scores", "scores_kernel", [  # a chunk per program; stores full rows, zero blocks too
        ("q", "in", "K", 1, 0, "P"), ("k", "in", "K", 1, 0, "P"), ("Gc", "f32", "K", 1, 0, "P"),
        ("L", "f32", "C", 0, 1, 1), ("Aqk", "in", "C", 0, 1, 1)]),
    ("scores", "solve", "solve_kernel",
     [("L", "f32", "C", TRI, 0, 1), ("beta", "in", "1", 1, 0, 1), ("Ainv", "in", "C", 0, 1, 1)]),
    ("W/U", "wu", "wu_kernel", wu(0)),
    ("state", "state (sequential)", "state_kernel", [  # Gc: each chunk's last row only
        ("KG", "in", "K", 1, 0, "P"), ("W", "in", "K", 1, 0, "P"), ("Gc", "f32", "K", "1/C", 0, "P"),
        ("U", "f32", "V", 1, 0, 1), ("h0", "f32", "0", 1, 0, 1), ("Hs", "in", "K*V/C", 0, 1, 1),
        ("VN", "in", "V", 0, 1, 1), ("ht", "f32", "0", 0, 1, 1)]),
    ("output", "output", "output_kernel", [
        ("q", "in", "K", 1, 0, "P"), ("Gc", "f32", "K", 1, 0, "P"), ("Aqk", "in", "C", 1, 0, "P"),
        ("Hs", "in", "K*V/C", 1, 0, 1), ("VN", "in", "V", 1, 0, 1), ("o", "in", "V", 0, 1, 1)]),
]
OURS_BWD = [  # after the rerun of forward_intermediates' kernels, which the script adds from the code
    ("state bwd", "state_bwd (sequential)", "state_bwd_kernel", [
        ("QG", "in", "K", 1, 0, "P"), ("KG", "in", "K", 1, 0, "P"), ("W", "in", "K", 1, 0, "P"),
        ("Gc", "f32", "K", "1/C", 0, "P"), ("Aqk", "in", "C", 1, 0, "P"), ("do", "in", "V", 1, 0, 1),
        ("dht", "f32", "0", 1, 0, 1), ("DH", "in", "K*V/C", 0, 1, 1), ("DVN", "in", "V", 0, 1, 1),
        ("dh0", "f32", "0", 0, 1, 1)]),
    ("chunk grads", "chunk_bwd", "chunk_bwd_kernel", [  # q never loaded; do, VN, DVN reloaded per key block
        # in the same program: counted once
        ("q", "in", "K", 0, 0, 1), ("k", "in", "K", 1, 0, 1), ("v", "in", "V", 1, 0, 1),
        ("beta", "in", "1", 1, 0, 1), ("Gc", "f32", "K", 1, 0, 1), ("L", "f32", "C", 1, 0, 1),
        ("Ainv", "in", "C", 1, 0, 1), ("W", "in", "K", 1, 0, 1), ("U", "f32", "V", 1, 0, 1),
        ("Hs", "in", "K*V/C", 1, 0, 1), ("VN", "in", "V", 1, 0, 1), ("do", "in", "V", 1, 0, 1),
        ("DH", "in", "K*V/C", 1, 0, 1), ("DVN", "in", "V", 1, 0, 1), ("dqs", "f32", "K", 0, 1, 1),
        ("dks", "f32", "K", 0, 1, 1), ("dv", "in", "V", 0, 1, 1), ("dG", "f32", "K", 0, 1, 1),
        ("dbeta", "in", "1", 0, 1, 1), ("dAqk", "f32", "C", 0, 1, 1), ("dL", "f32", "C", 0, 1, 1)]),
    ("score grads", "scores_bwd", "scores_bwd_kernel", [  # rows and dA blocks reloaded per sub-chunk: once
        ("q", "in", "K", 1, 0, 1), ("k", "in", "K", 1, 0, 1), ("Gc", "f32", "K", 1, 0, 1),
        ("dAqk", "f32", "C", TRI, 0, 1), ("dL", "f32", "C", TRI, 0, 1), ("dqs", "f32", "K", 1, 0, 1),
        ("dks", "f32", "K", 1, 0, 1), ("dq", "in", "K", 0, 1, 1), ("dk", "in", "K", 0, 1, 1),
        ("dG", "f32", "K", 1, 1, 1)]),
    ("dg cumsum", "chunk_cumsum (dg, reverse)", "chunk_cumsum_kernel",
     [("x", "f32", "K", 1, 0, 1), ("out", "f32", "K", 0, 1, 1)]),
    ("casts", "dg .to(g's dtype)", None, [("dg", "f32>g", "K", 1, 1, 1)]),
]

FLA_WU = [("k", "in", "K", 1, 0, 1), ("v", "in", "V", 1, 0, 1), ("beta", "in", "1", 1, 0, 1),
          ("Akk", "in", "C", 1, 0, 1), ("g_cumsum", "f32", "K", 1, 0, 1), ("w", "in", "K", 0, 1, 1),
          ("u", "in", "V", 0, 1, 1), ("kg", "in", "K", 0, 1, 1)]
FLA_H = [("kg", "in", "K", 1, 0, "NVh"), ("w", "in", "K", 1, 0, "NVh"), ("u", "in", "V", 1, 0, 1),
         ("g_cumsum", "f32", "K", "1/C", 0, "NVh"), ("h", "in", "K*V/C", 0, 1, 1),
         ("v_new", "in", "V", 0, 1, 1)]  # g_cumsum: each chunk's last row only
FLA_FWD = [
    ("cumsum", "chunk_local_cumsum (g)", "chunk_local_cumsum_vector_kernel",
     [("g", "g", "K", 1, 0, 1), ("g_cumsum", "f32", "K", 0, 1, 1)]),
    ("scores", "intra_token_parallel", "chunk_kda_fwd_kernel_intra_token_parallel", [
        # a program per token: its row and its sub-chunk's rows s <= t, (BC+1)/2 of them on average
        ("q", "in", "K", 1, 0, 1), ("k", "in", "K", "(BC+1)/2", 0, 1), ("beta", "in", "1", 1, 0, 1),
        ("g_cumsum", "f32", "K", "(BC+1)/2", 0, 1), ("Aqk", "in", "C", 0, "(BC+1)/(2*C)", 1),
        ("Akkd", "f32", "BC", 0, "(BC+1)/(2*BC)", 1)]),
    ("scores", "torch.zeros(Akk)", None, [("Akk", "in", "C", 0, 1, 1)]),
    ("scores", "inter_solve_fused", "chunk_kda_fwd_kernel_inter_solve_fused", [
        # q, beta of sub-chunks 1..NC-1; Akkd's diagonal blocks; stores 6 Aqk, 10 Akk blocks of 16
        ("q", "in", "K", "(NC-1)/NC", 0, 1), ("k", "in", "K", 1, 0, 1), ("g_cumsum", "f32", "K", 1, 0, 1),
        ("beta", "in", "1", "(NC-1)/NC", 0, 1), ("Akkd", "f32", "BC", 1, 0, 1),
        ("Aqk", "in", "C", 0, "(NC-1)/(2*NC)", 1), ("Akk", "in", "C", 0, TRI, 1)]),
    ("W/U", "recompute_w_u_fwd", "recompute_w_u_fwd_kda_kernel", FLA_WU),
    ("state", "fwd_h (sequential)", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", FLA_H),
    ("output", "torch.zeros(o)", None, [("o", "in", "V", 0, 1, 1)]),
    ("output", "fwd_o (chunk_gla_fwd_o_gk)", "chunk_gla_fwd_kernel_o", [
        ("q", "in", "K", 1, 0, "NVo"), ("g_cumsum", "f32", "K", 1, 0, "NVo"), ("Aqk", "in", "C", 1, 0, "NVo"),
        ("h", "in", "K*V/C", 1, 0, 1), ("v_new", "in", "V", 1, 0, 1), ("o", "in", "V", 0, 1, 1)]),
]
FLA_BWD = [
    ("W/U", "recompute_w_u_fwd (+qg)", "recompute_w_u_fwd_kda_kernel",
     FLA_WU + [("q", "in", "K", 1, 0, 1), ("qg", "in", "K", 0, 1, 1)]),
    ("state", "fwd_h (rerun)", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64", FLA_H),
    ("state bwd", "bwd_dAv", "chunk_kda_bwd_kernel_dAv", [  # q, k passed, never loaded
        ("Aqk", "in", "C", 1, 0, 1), ("v_new", "in", "V", 1, 0, 1), ("do", "in", "V", 1, 0, 1),
        ("dv", "in", "V", 0, 1, 1), ("dAqk", "f32", "C", 0, 1, 1)]),
    ("state bwd", "bwd_dhu (sequential)", "chunk_gated_delta_rule_bwd_kernel_dhu_blockdim64", [
        ("qg", "in", "K", 1, 0, "NVh"), ("kg", "in", "K", 1, 0, "NVh"), ("w", "in", "K", 1, 0, "NVh"),
        ("g_cumsum", "f32", "K", "1/C", 0, "NVh"), ("do", "in", "V", 1, 0, 1), ("dv", "in", "V", 1, 0, 1),
        ("dh", "in", "K*V/C", 0, 1, 1), ("dv2", "in", "V", 0, 1, 1)]),
    ("chunk grads", "bwd_wy_dqkg_fused", "chunk_kda_bwd_kernel_wy_dqkg_fused", [  # a chunk per program
        ("q", "in", "K", 1, 0, 1), ("k", "in", "K", 1, 0, 1), ("v", "in", "V", 1, 0, 1),
        ("v_new", "in", "V", 1, 0, 1), ("g_cumsum", "f32", "K", 1, 0, 1), ("beta", "in", "1", 1, 0, 1),
        ("Akk", "in", "C", 1, 0, 1), ("h", "in", "K*V/C", 1, 0, 1), ("do", "in", "V", 1, 0, 1),
        ("dh", "in", "K*V/C", 1, 0, 1), ("dv2", "in", "V", 1, 0, 1), ("dq", "f32", "K", 0, 1, 1),
        ("dk", "f32", "K", 0, 1, 1), ("dv", "in", "V", 0, 1, 1), ("dg", "f32", "K", 0, 1, 1),
        ("db", "f32", "1", 0, 1, 1), ("dAkk", "f32", "C", 0, 1, 1)]),
    ("score grads", "bwd_intra", "chunk_kda_bwd_kernel_intra", [
        # a program per (sub-chunk, 32 key channels) loads its rows, every sub-chunk's k and g, the later
        # sub-chunks' q and beta, and NC [BC, BC] blocks of each dA (C per own row); beta once per slice
        ("q", "in", "K", "(NC+1)/2", 0, 1), ("k", "in", "K", "NC", 0, 1), ("dq", "f32", "K", 1, 0, 1),
        ("g_cumsum", "f32", "K", "NC", 0, 1), ("beta", "in", "1", "(NC+1)/2", 0, "NKi"),
        ("dAqk", "f32", "C", 1, 0, "NKi"), ("dAkk", "f32", "C", 1, 0, "NKi"), ("dk", "f32", "K", 1, 0, 1),
        ("dg", "f32", "K", 1, 0, 1), ("dq2", "f32", "K", 0, 1, 1), ("dk2", "f32", "K", 0, 1, 1),
        ("dg2", "f32", "K", 0, 1, 1), ("db2", "f32", "NKi", 0, 1, 1)]),
    ("score grads", "db2.sum(0).add_(db)", None,
     [("db2", "f32", "NKi", 1, 0, 1), ("db2.sum", "f32", "1", 1, 1, 1), ("db", "f32", "1", 1, 1, 1)]),
    ("dg cumsum", "chunk_local_cumsum (dg, reverse)", "chunk_local_cumsum_vector_kernel",
     [("dg2", "f32", "K", 1, 0, 1), ("dg", "f32", "K", 0, 1, 1)]),
    ("casts", "dq, dk, dg, db .to(input dtypes)", None, [("dq", "f32>in", "K", 1, 1, 1),
     ("dk", "f32>in", "K", 1, 1, 1), ("dg", "f32>g", "K", 1, 1, 1), ("db", "f32>in", "1", 1, 1, 1)]),
]
# Kept from forward to backward beyond the inputs (memory held; their traffic is in the kernels above).
SAVED = {"fla": [("g_cumsum", "f32", "K"), ("Aqk", "in", "C"), ("Akk", "in", "C")], "ours": []}
FLA_NOTES = [  # what the counts above assume
    "fwd_h, bwd_dhu autotune BV in [32, 64]; 64 assumed: a public sweep of this kernel (another GPU) found "
    "64 fastest once N*H >= ~96, as in training batches; 32 doubles their kg, w, qg, g reads (--fla-bv-h 32)",
    "chunk_gla_fwd_kernel_o autotunes BV in [64, 128]; 128 assumed: q, g_cumsum, Aqk loaded once per chunk, "
    "twice with 64 (--fla-bv-o 64)",
    "bwd_dAv: BV = min(V, 128) on Hopper (shared memory >= 232448 B); bwd_intra: BK = 32 (fixed)",
    "recompute_w_u (BK = BV = 64) and wy_dqkg_fused (autotuned BK, BV) loop over blocks in one program per "
    "chunk: their tiles change no count; wy_dqkg_fused's reloads of v_new, do, dv per K block count once",
    "intra_token_parallel's program per token re-reads up to BC rows of k and g_cumsum, (BC+1)/2 = 8.5 "
    "times each with no cross-program reuse: L2 absorbs most of it (the 'once' figures)",
    "Aqk and Akkd entries above the diagonal are never written but are loaded with their rows",
    "bf16 (k.new_empty, empty_like of bf16): h, dh, w, u, kg, qg, v_new, dv; fp32: g_cumsum, dA*, dq, dk, "
    "dg, db"]


def fail(msg):
    raise SystemExit(f"kda_traffic: the table of our kernels is stale: {msg}")


def parse_code(K, V):
    """Kernels launched per host function, buffers and value-block programs per launch, scratch dtypes."""
    from kimi.ops.kda.triton import common
    funcs = {n.name: n for f in FILES for n in ast.parse((SRC / f).read_text()).body
             if isinstance(n, ast.FunctionDef)}
    jit = {n: [(a.arg, ast.unparse(a.annotation or ast.Constant(0)) == "tl.constexpr") for a in f.args.args]
           for n, f in funcs.items() if "triton.jit" in map(ast.unparse, f.decorator_list)}
    sig = funcs["scratch"].args
    dflt = dict(zip((a.arg for a in sig.kwonlyargs), sig.kw_defaults))["dtype"]
    launches, calls, kinds, returns = {}, {}, {}, {}
    for fname, f in ((n, f) for n, f in funcs.items() if n not in jit):
        # BVS = state_block(N, H, V, device) needs tensors: take the value block used when there are enough
        # sequences and heads to fill the GPU (with fewer, the state passes take 32 and reread more)
        ns = dict(vars(common), K=K, V=V, BVS=common.tiles(K, V).BVS)
        for st in (s for s in f.body if isinstance(s, ast.Assign)):  # e.g. BK, BKD, BV, BVS = tiles(K, V)
            try:
                exec(compile(ast.Module([st], []), fname, "exec"), ns)
            except Exception:
                pass  # depends on tensors
        alias = {s.targets[0].id: s.value for s in f.body if isinstance(s, ast.Assign)
                 and isinstance(s.targets[0], ast.Name)}  # dt = q.dtype
        calls[fname] = {c.func.id for c in ast.walk(f)
                        if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
        for node in ast.walk(f):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Name):
                returns[fname] = node.value.id
            if isinstance(node, ast.Assign):
                record_kinds(node, alias, dflt, kinds)
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and ast.unparse(node.func.value) in jit):
                continue
            kname, grid = node.func.value.id, node.func.slice
            try:  # programs per (chunk or sequence, head): the grid's value-block axis
                P = math.prod(eval(ast.unparse(e), ns) for e in grid.elts
                              if ast.unparse(e) not in ("NT", "N", "H"))
            except Exception as e:
                fail(f"cannot evaluate the grid of {kname}, {ast.unparse(grid)}: {e}")
            bufs = set().union(*(buffer_names(a, kname) for (p, const), a in zip(jit[kname], node.args)
                                 if not const and p not in NOT_BUFFERS))
            launches[kname] = (P, bufs, fname)
    for node in (n for f in funcs.values() for n in ast.walk(f)):  # Gc = chunk_cumsum(...): its scratch
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                isinstance(node.targets[0], ast.Name) and returns.get(ast.unparse(node.value.func)) in kinds:
            kinds[node.targets[0].id] = kinds[returns[ast.unparse(node.value.func)]]

    def launched_by(fname, seen=()):
        return {k for k, (_, _, f) in launches.items() if f == fname}.union(
            *(launched_by(c, seen + (fname,)) for c in calls.get(fname, ()) if c in funcs and c not in seen))
    bwd_calls = [c for c in ast.walk(funcs["chunk_bwd"]) if isinstance(c, ast.Call)]
    rerun = [c for c in bwd_calls if ast.unparse(c.func) == "forward_intermediates"]
    return dict(launches=launches, kinds=kinds, fwd=launched_by("chunk_fwd"), bwd=launched_by("chunk_bwd"),
                rerun=launched_by("forward_intermediates") if rerun else set(),
                rerun_qg=any(ast.unparse(kw) == "backward=True" for c in rerun for kw in c.keywords),
                casts={ast.unparse(c.func.value) for c in bwd_calls
                       if isinstance(c.func, ast.Attribute) and c.func.attr == "to"},
                tiles=common.tiles(K, V)._asdict(), C=common.CHUNK, BC=common.SUB)


def buffer_names(a, kname):
    if isinstance(a, ast.Name):
        return {a.id}
    if isinstance(a, ast.Subscript) and isinstance(a.slice, ast.Constant):  # mid["Gc"]
        return {a.slice.value}
    if isinstance(a, ast.IfExp):
        return buffer_names(a.body, kname) | buffer_names(a.orelse, kname)
    fail(f"{kname} is passed {ast.unparse(a)}: name the buffer")


def record_kinds(node, alias, dflt, kinds):
    """X = scratch(..), X, Y = scratch(..), scratch(..), X, Y = (scratch(..) for ..), X = scratch(..) if .."""
    targets = node.targets[0].elts if isinstance(node.targets[0], ast.Tuple) else [node.targets[0]]
    vals = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value] * len(targets)
    for t, v in zip(targets, vals):
        v = v.elt if isinstance(v, ast.GeneratorExp) else v.body if isinstance(v, ast.IfExp) else v
        if not (isinstance(v, ast.Call) and ast.unparse(v.func) == "scratch" and isinstance(t, ast.Name)):
            continue
        d = next((kw.value for kw in v.keywords if kw.arg == "dtype"), dflt)
        s = ast.unparse(alias.get(ast.unparse(d), d))
        kind = TORCH_KINDS.get(s) or INPUT_KINDS.get(s.removesuffix(".dtype"))
        if kind is None or kinds.get(t.id, kind) != kind:
            fail(f"{t.id} = scratch(..., dtype={s}): unknown or conflicting storage kind")
        kinds[t.id] = kind


def check_ours(code, fwd, bwd):
    for direction, entries in (("fwd", fwd), ("bwd", bwd)):
        if {k for _, _, k, _ in entries if k} != code[direction]:
            fail(f"{direction} launches {sorted(code[direction])}")
    if {r[0] for _, _, k, rows in bwd if k is None for r in rows} != code["casts"]:
        fail(f"chunk_bwd casts {sorted(code['casts'])} with .to()")
    for _, label, kname, rows in fwd + bwd:
        if kname and {r[0] for r in rows} != code["launches"][kname][1]:
            fail(f"{kname} is launched with {sorted(code['launches'][kname][1])}, not what '{label}' lists")
        for name, kind, *_ in rows:
            if ">" not in kind and code["kinds"].get(name, kind) != kind:
                fail(f"{name} is stored as '{code['kinds'][name]}', '{label}' says '{kind}': edit its kind")


def ev(x, ns):
    return float(eval(x, {"__builtins__": {}}, ns)) if isinstance(x, str) else float(x)


def tally(entries, ns, P=None):
    out = []
    for stage, label, kname, rows in entries:
        nsk = dict(ns, P=P.get(kname, 1)) if P is not None else ns
        tensors = []
        for name, kind, elems, reads, writes, rep in rows:
            rk, wk = kind.split(">") if ">" in kind else (kind, kind)
            n = ev(elems, nsk) * (rk == wk or DTYPES[rk][0] != DTYPES[wk][0])
            r, w, p, (rb, wb) = ev(reads, nsk), ev(writes, nsk), ev(rep, nsk), (DTYPES[rk][1], DTYPES[wk][1])
            tensors.append(dict(tensor=name, dtype=DTYPES[rk if r else wk][0], elements=n, reads=r, writes=w,
                                programs=p, read_bytes=n * r * p * rb, write_bytes=n * w * wb,
                                read_once_bytes=n * min(r, 1) * rb))
        s = {k: sum(t[k] for t in tensors) for k in ("read_bytes", "write_bytes", "read_once_bytes")}
        out.append(dict(stage=stage, kernel=label, triton_kernel=kname, programs=nsk.get("P"), **s,
                        total_bytes=s["read_bytes"] + s["write_bytes"],
                        once_bytes=s["read_once_bytes"] + s["write_bytes"], tensors=tensors))
    return out


def markdown(res, tot, stages, summary, saved, K, V, fla_version):
    keys = ("read_bytes", "write_bytes", "total_bytes", "once_bytes")
    out = [f"# KDA chunk kernels: bytes per token and head (K = {K}, V = {V}, bf16 inputs, fp32 gate)"]
    for i, d in ((i, d) for i in ("fla", "ours") for d in ("fwd", "bwd")):
        out += [f"\n**{'fla-core ' + fla_version if i == 'fla' else 'ours'}, {d}**\n",
                "| stage | kernel | reads | writes | total | total, once |", "|---|---|---:|---:|---:|---:|"]
        out += [f"| {r['stage']} | {r['kernel']} | " + " | ".join(f"{r[k]:.0f}" for k in keys) + " |"
                for r in res[i][d]]
        out.append("| | **total** | " + " | ".join(f"{x:.0f}" for x in tot[i, d]) + " |")
    out += ["\n**By stage** (bytes)\n", "| | stage | fla | ours | ours/fla |", "|---|---|---:|---:|---:|"]
    out += [f"| {d} | {st} | {v['fla']:.0f} | {v['ours']:.0f} | "
            + (f"{v['ours'] / v['fla']:.2f} |" if v["fla"] else "- |")
            for d in stages for st, v in stages[d].items()]
    out += ["\n**Totals** (bytes; once: each tensor read at most once per kernel)\n",
            "| | fla | ours | ours/fla | fla, once | ours, once | ours/fla, once |", "|---|" + "---:|" * 6]
    out += [f"| {n} | {s['fla']:.0f} | {s['ours']:.0f} | {s['ratio']:.2f} | {s['fla_once']:.0f} | "
            f"{s['ours_once']:.0f} | {s['ratio_once']:.2f} |" for n, s in summary.items()]
    out.append(f"\nSaved for backward besides the inputs (bytes): fla {saved['fla']:.0f}, "
               f"ours {saved['ours']:.0f}")
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--fla-bv-h", type=int, default=64, help="BV assumed for fla's two state kernels")
    ap.add_argument("--fla-bv-o", type=int, default=128, help="BV assumed for fla's output kernel")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "kda_traffic.json")
    args = ap.parse_args()
    K, V = args.K, args.V
    code = parse_code(K, V)
    rerun = [(s, f"{label} (rerun)", k, wu(int(code["rerun_qg"])) if k == "wu_kernel" else rows)
             for s, label, k, rows in OURS_FWD if k in code["rerun"]]
    check_ours(code, OURS_FWD, rerun + OURS_BWD)
    P = {k: v[0] for k, v in code["launches"].items()}
    ns_ours = dict(K=K, V=V, C=code["C"], BC=code["BC"], NC=code["C"] // code["BC"])
    ns_fla = dict(K=K, V=V, C=C_FLA, BC=BC_FLA, NC=C_FLA // BC_FLA, NVh=math.ceil(V / args.fla_bv_h),
                  NVo=math.ceil(V / args.fla_bv_o), NKi=math.ceil(K / BK_FLA_INTRA))
    res = {"fla": {"fwd": tally(FLA_FWD, ns_fla), "bwd": tally(FLA_BWD, ns_fla)},
           "ours": {"fwd": tally(OURS_FWD, ns_ours, P), "bwd": tally(rerun + OURS_BWD, ns_ours, P)}}
    keys = ("read_bytes", "write_bytes", "total_bytes", "once_bytes")
    tot = {(i, d): [sum(r[k] for r in res[i][d]) for k in keys] for i in res for d in res[i]}
    stages = {d: {} for d in ("fwd", "bwd")}
    for d, i in ((d, i) for d in stages for i in ("ours", "fla")):
        for r in res[i][d]:
            stages[d].setdefault(r["stage"], {"fla": 0.0, "ours": 0.0})[i] += r["total_bytes"]
    summary = {}
    for name, dirs in (("forward", ["fwd"]), ("backward", ["bwd"]), ("forward+backward", ["fwd", "bwd"])):
        s = {i + sfx: sum(tot[i, d][c] for d in dirs)
             for i in ("fla", "ours") for sfx, c in (("", 2), ("_once", 3))}
        summary[name] = dict(s, ratio=s["ours"] / s["fla"], ratio_once=s["ours_once"] / s["fla_once"])
    saved = {i: sum(ev(e, ns_fla) * DTYPES[kd][1] for _, kd, e in SAVED[i]) for i in SAVED}
    fla_version = importlib.metadata.version("fla-core")
    print(markdown(res, tot, stages, summary, saved, K, V, fla_version))
    assumptions = dict(
        K=K, V=V, C=C_FLA, dtypes={k: DTYPES[k][0] for k in ("in", "g", "f32")},
        fla=dict(version=fla_version, bv_state_kernels=args.fla_bv_h, bv_output_kernel=args.fla_bv_o,
                 source="fla-core as installed (the wheel records no commit); chunk_kda's default path, "
                 "Triton kernels (no tilelang backend installed)", notes=FLA_NOTES),
        ours=dict(C=code["C"], tiles=code["tiles"], programs_per_chunk_or_sequence_and_head=P,
                  dtype_kinds=code["kinds"], rerun_in_backward=sorted(code["rerun"])),
        not_counted=["L2 reuse across programs (see the once figures)", "cu_seqlens, chunk tables, scalars",
                     "per-sequence initial/final states and their gradients (~0 per token)",
                     "short last chunks (T a multiple of C)", "autotuning runs"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(assumptions=assumptions, totals=summary, stages=stages,
                                        saved_for_backward_bytes=saved, kernels=res), indent=1) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
