"""What every KDA Triton kernel shares: the interpreter switch, dot precision, packed-sequence bookkeeping.

All kernels see one packed batch: q, k, g [1, T, H, K], v [1, T, H, V], beta [1, T, H], and cu_seqlens
[N + 1] (a plain [B, T] batch is B packed sequences of length T). A chunk never straddles two sequences:
each sequence is cut into its own chunks of C tokens, the last one short, and `chunk_table` lists them all.
"""

import functools
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ...dispatch import KernelUnsupported, is_fake
from ...triton_interpreter import INTERPRET
from ..chunk import BOUNDED_SUB_CHUNK, CHUNK_SIZE, TRITON_MAX_HEAD_DIM

CHUNK = CHUNK_SIZE  # tokens per chunk
SUB = 16  # tokens per sub-chunk: the anchoring step inside a chunk (CHUNK // SUB = 4 is hard-wired)
assert SUB == BOUNDED_SUB_CHUNK  # the PyTorch path's bounded form anchors at the same step


def check_device(*tensors: torch.Tensor) -> None:
    """Triton runs CUDA tensors compiled, CPU tensors only interpreted (fake ones not at all)."""
    for x in tensors:
        if x.device.type == "cpu" and not INTERPRET and not is_fake(x):
            raise RuntimeError(
                "KDA backend='triton' got CPU tensors, which Triton runs only under its interpreter: set "
                "TRITON_INTERPRET=1 before triton is first imported, or use backend='chunk' on CPU"
            )
        if x.dtype == torch.float64:
            raise TypeError("KDA backend='triton' computes in fp32 and takes fp32/bf16/fp16 inputs; "
                            "use backend='chunk' or 'naive' for fp64")


def dot_precision(dtype: torch.dtype) -> int:
    """The `PREC` constexpr of `mm`: how its operands are multiplied.

    Compiled: 1 bf16 and 2 fp16 operands on tensor cores; fp32 inputs 3, "tf32x3" (each operand split into
    a TF32 high part and a TF32 remainder, three tensor-core products: about fp32 accuracy, not TF32's
    1e-3). Exact IEEE fp32 products (0) have no tensor-core path: their FMA loops hold whole operand tiles per
    thread, and at K = 128 ptxas moves them to local memory (tens of KB of spills per kernel).
    Interpreted (the tests): the interpreter mishandles half-precision dots (docs/environment.md), so 4 and 5
    round the operands to bf16 / fp16 and multiply in fp32, which is what a tensor core computes (products
    of half-precision numbers are exact in fp32); fp32 inputs multiply in IEEE fp32 (0).
    """
    half = {torch.bfloat16: 1, torch.float16: 2}.get(dtype, 0)
    if INTERPRET:
        return half + 3 if half else 0
    return half or 3


def block(n: int, cap: int) -> int:
    """A power-of-two tile length >= n (>= 16, the smallest tl.dot side), at most cap."""
    return min(max(16, triton.next_power_of_2(n)), cap)


def scores_grid(spec: str) -> dict:
    """How the two scores kernels (chunk_fwd.scores_kernel, chunk_bwd.scores_bwd_kernel) are launched, from
    "serial:8" / "split:4" / "tokens:4" (layout:warps). serial: one program per (chunk, head) walks the
    chunk's sub-chunks (and, backward, its key-channel slices) in turn; split: one program per sub-chunk (and
    slice), 4x (16x backward) more programs of the same work; tokens: split, the forward's products over
    slices of key channels, and the general gate's diagonal blocks one key token at a time instead of from
    [t, s, d] tiles (fewer registers, so more programs resident per multiprocessor). An H200 spent 60 and
    91 ms of a `1b` step in these two under serial:8 (docs/gpu.md, third call); bench/kda.py --scores-grid
    times the layouts side by side."""
    form, _, warps = spec.partition(":")
    if form not in ("serial", "split", "tokens") or not warps.isdigit() or int(warps) not in (1, 2, 4, 8, 16):
        raise ValueError(f"KIMI_KDA_SCORES_GRID={spec!r} is invalid: write serial|split|tokens:<warps 1-16>, "
                         "e.g. split:4")
    return {"split": form != "serial", "tokens": form == "tokens", "warps": int(warps)}


# The layouts bench/kda.py --compile-check compiles and --scores-grid times by default. split:8 left the
# list when tokens:4 joined it: at K = 128 the split backward leaves 8 warps resident per multiprocessor with
# 8 warps a program (175 registers) as with 4 (255), so it could not beat split:4 on occupancy.
SCORES_GRIDS = ("serial:8", "split:4", "tokens:4")
# Read at each launch, so a benchmark can switch it between calls (update it in place: the kernel modules
# hold this dict); $KIMI_KDA_SCORES_GRID sets it per process.
SCORES_GRID = scores_grid(os.environ.get("KIMI_KDA_SCORES_GRID", "serial:8"))


class Tiles(NamedTuple):
    BK: int  # all K key channels in one tile
    BKD: int  # key channels per slice of the [t, s, d] decay tiles
    BV: int  # value channels per block of the per-chunk kernels
    BVS: int  # value channels per program of the two sequential state passes (see state_block)
    BKC: int  # key channels per block of the chunk backward's state terms


STATE_BLOCKS = (32, 64)  # the state passes' BVS candidates (all compiled by bench/kda.py --compile-check)

# A half-precision matmul operand whose rows in shared memory are narrower than 128 bytes (under 64 bf16/fp16
# elements) gets a 64-byte swizzle, and Triton's Hopper (wgmma) code reads such operands outside their shared
# memory. Seen on an H200 on 2026-11-30 (Triton 3.6.0): with bf16 and fp16 inputs, state_kernel at BVS = 32
# and chunk_bwd_kernel at BKC = 32 ended in "illegal memory access" (compute-sanitizer: out-of-range shared
# address at the dot), while fp32 inputs (tf32x3: 32 fp32 = 128-byte rows) ran clean. The same failure with
# 32-wide bf16 tiles is triton-lang/triton issue 11366 (Triton 3.7.1, H20); Triton 3.9.0 emits the same
# shared-memory code for these kernels. So no half-precision operand here is narrower than this; the
# compile check (bench/kda.py --compile-check) fails any kernel whose sm_90 code has one.
HALF_MIN_ROW = 64


def tiles(K: int, V: int) -> Tiles:
    """Tile sizes. Under the interpreter BKD, BV, BVS and BKC are 16, so the tests' small heads (K, V <= 40)
    still run several key slices and value blocks, the code paths a d = 128 head takes on a GPU."""
    if K > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"KDA backend='triton' supports key head dims up to {TRITON_MAX_HEAD_DIM}, got {K}")
    small = 16 if INTERPRET else None
    return Tiles(BK=block(K, TRITON_MAX_HEAD_DIM), BKD=small or 32, BV=block(V, small or 64),
                 BVS=block(V, small or STATE_BLOCKS[-1]), BKC=block(K, small or 32))


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def narrow_operands_fault(device: torch.device) -> bool:
    """Whether this device runs the kernels through Hopper's wgmma, where narrow half-precision operands
    fault (HALF_MIN_ROW). Ampere's tensor-core path (mma) has no such layouts."""
    return not INTERPRET and device.type == "cuda" and _capability(device)[0] == 9


@functools.cache
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def state_block(N: int, H: int, V: int, device: torch.device, dtype: torch.dtype) -> int:
    """BVS of the state passes: one program per (sequence, head, value block) runs the only sequential loop,
    so a few long sequences (N * H small) would leave multiprocessors idle with 64-wide blocks; then 32,
    twice the programs, each rereading the keys. Both spill-free at K = 128 (bench/results/kda_sm*_compile),
    except that half-precision inputs on Hopper always take 64 (a 32-wide block is a narrow operand)."""
    wide = block(V, 16 if INTERPRET else STATE_BLOCKS[-1])
    if INTERPRET or device.type != "cuda":
        return wide
    if N * H * triton.cdiv(V, wide) >= _multiprocessors(device):
        return wide
    return block(V, state_blocks(dtype, narrow_operands_fault(device))[0])


def state_blocks(dtype: torch.dtype, hopper: bool) -> tuple[int, ...]:
    """The BVS values state_block can pick for inputs of this dtype on a GPU (what the compile check
    builds)."""
    return STATE_BLOCKS[-1:] if hopper and dtype.itemsize < 4 else STATE_BLOCKS


def key_block_precision(prec: int, BKC: int, hopper: bool) -> int:
    """PREC of chunk_bwd's two products whose operand is a [C, BKC] tile: on Hopper, with half-precision
    operands and BKC < HALF_MIN_ROW that tile is a narrow operand, so those two multiply as tf32x3 on fp32
    operands (rows of 4 * BKC = 128 bytes) instead; everything else in the kernel keeps `prec`."""
    return 3 if hopper and prec in (1, 2) and BKC < HALF_MIN_ROW else prec


def check_head_dims(dtype: torch.dtype, K: int, V: int, device: torch.device) -> None:
    """Half-precision kernels on Hopper need K, V >= HALF_MIN_ROW: smaller heads make narrow operands."""
    if dtype.itemsize < 4 and min(K, V) < HALF_MIN_ROW and narrow_operands_fault(device):
        raise KernelUnsupported(
            f"KDA backend='triton' with {dtype} inputs on a Hopper GPU needs head dims of at least "
            f"{HALF_MIN_ROW} (got K = {K}, V = {V}): narrower half-precision matmul operands hit a Triton "
            "code-generation bug there (kimi/ops/kda/triton/common.py, HALF_MIN_ROW); use fp32 inputs or "
            "the PyTorch path")


def scratch(*shape: int, like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """torch.empty for kernel outputs and intermediates. Under the interpreter (the tests) it comes filled
    with NaN, so an element a kernel forgets to write shows up in every result that reads it."""
    x = torch.empty(*shape, dtype=dtype, device=like.device)
    return x.fill_(float("nan")) if INTERPRET else x


def check_offsets(offsets: list[int], T: int) -> None:
    """Kernels index tokens through cu_seqlens unchecked: offsets outside [0, T] would read and write out
    of bounds. kimi.ops.kda checks them too, but not under torch.compile; the ops run eagerly, so here."""
    if offsets[0] != 0 or offsets[-1] != T or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}, got {offsets}")


def chunk_table(cu_seqlens: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(chunks [NT, 2] int32: (sequence, chunk within it) per chunk; first_chunk [N + 1] int32: the
    global index of each sequence's first chunk; NT). One host sync, like every varlen launch needs."""
    offsets = cu_seqlens.tolist()
    check_offsets(offsets, T)
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    counts = [triton.cdiv(n, CHUNK) for n in lengths]
    rows = [(s, c) for s, count in enumerate(counts) for c in range(count)]
    device = cu_seqlens.device
    chunks = torch.tensor(rows, dtype=torch.int32).reshape(-1, 2).to(device)
    first = torch.tensor([0] + counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    return chunks, first, len(rows)


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """a @ b with fp32 accumulation; operands cast as `dot_precision` chose."""
    if PREC == 1:
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    elif PREC == 2:
        return tl.dot(a.to(tl.float16), b.to(tl.float16))
    elif PREC == 3:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    elif PREC == 4:
        return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32),
                      input_precision="ieee")
    elif PREC == 5:
        return tl.dot(a.to(tl.float16).to(tl.float32), b.to(tl.float16).to(tl.float32),
                      input_precision="ieee")
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")


@triton.jit
def chunk_bounds(cu_seqlens, chunks, i_c, C: tl.constexpr):
    """(first token of chunk i_c, its last valid token) as int64 positions in the packed batch."""
    seq = tl.load(chunks + 2 * i_c)
    c = tl.load(chunks + 2 * i_c + 1)
    bos = tl.load(cu_seqlens + seq).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    t0 = bos + c * C
    return t0, tl.minimum(t0 + C, eos) - 1


@triton.jit
def load_rows(x, rows, last, h, H, cols, D, mask_cols):
    """x[rows, h, cols] of a [T, H, D] tensor as fp32; rows past `last` read 0."""
    m = (rows <= last)[:, None] & mask_cols[None, :]
    return tl.load(x + (rows[:, None] * H + h) * D + cols[None, :], mask=m, other=0).to(tl.float32)


@triton.jit
def load_G(Gc, rows, last, h, H, cols, K, mask_cols):
    """Cumulative log-decay rows [.., K]. Rows past the end read the last valid row, as if the chunk were
    padded with tokens of g = 0: G stays non-increasing over the whole chunk, so every anchored
    exponential exp(G_later - G_earlier) in the kernels stays <= 1, padded rows included."""
    r = tl.minimum(rows, last)
    return tl.load(Gc + (r[:, None] * H + h) * K + cols[None, :], mask=mask_cols[None, :], other=0)


@triton.jit
def load_G_row(Gc, row, last, h, H, cols, K, mask_cols):
    r = tl.minimum(row, last)
    return tl.load(Gc + (r * H + h) * K + cols, mask=mask_cols, other=0)


@triton.jit
def key_token(k, Gc, G_rows, a, s, last, h, H, cols, K, mask_cols, BC: tl.constexpr):
    """Key token s of the sub-chunk starting at row a, for the diagonal blocks taken one token at a time:
    (k_s [D] as fp32, e [BC, D] = exp(G_t - G_s) for the sub-chunk's rows t >= s, 0 above the diagonal, its
    exponent set to -inf first). A key past the chunk's end (a + s > last) meets only rows t >= s > last,
    which are never stored, so it reads the last valid row instead."""
    row = a + s
    k_s = tl.load(k + (tl.minimum(row, last) * H + h) * K + cols, mask=mask_cols, other=0).to(tl.float32)
    G_s = load_G_row(Gc, row, last, h, H, cols, K, mask_cols)
    o = tl.arange(0, BC)
    return k_s, tl.exp(tl.where(o[:, None] >= s, G_rows - G_s[None, :], float("-inf")))


@triton.jit
def chunk_cumsum_kernel(x, out, cu_seqlens, chunks, H, K: tl.constexpr, BK: tl.constexpr, C: tl.constexpr,
                        REVERSE: tl.constexpr):
    """Cumulative sum of x [T, H, K] within each chunk (from the end when REVERSE), in fp32."""
    i_c, h = tl.program_id(0), tl.program_id(1)
    t0, last = chunk_bounds(cu_seqlens, chunks, i_c, C)
    rows = t0 + tl.arange(0, C)
    cols = tl.arange(0, BK)
    mask = (rows <= last)[:, None] & (cols < K)[None, :]
    ptr = (rows[:, None] * H + h) * K + cols[None, :]
    b = tl.load(x + ptr, mask=mask, other=0).to(tl.float32)
    s = tl.cumsum(b, axis=0)
    if REVERSE:
        s = tl.sum(b, axis=0)[None, :] - s + b
    tl.store(out + ptr, s, mask=mask)


def chunk_cumsum(x: torch.Tensor, cu_seqlens, chunks, NT: int, reverse: bool = False) -> torch.Tensor:
    """x [T, H, K] -> fp32 chunk-local (reverse) cumulative sums."""
    T, H, K = x.shape
    out = scratch(T, H, K, like=x)
    if NT:
        chunk_cumsum_kernel[(NT, H)](x, out, cu_seqlens, chunks, H, K, tiles(K, 16).BK, CHUNK, reverse)
    return out


@triton.jit
def state_program(start, cu_seqlens, first_chunk, H, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                  BV: tl.constexpr, HAS_START: tl.constexpr):
    """The set-up shared by the forward and backward state passes: this program's sequence (bos, eos), its
    first chunk, its [BK, BV] tile of the state (offsets and mask), and the tile's starting value: `start`
    ([N, H, K, V]: the initial state forward, the final state's gradient backward) or zeros."""
    n, h, i_v = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(cu_seqlens + n).to(tl.int64)
    eos = tl.load(cu_seqlens + n + 1).to(tl.int64)
    c0 = tl.load(first_chunk + n).to(tl.int64)
    ck = tl.arange(0, BK)
    cv = i_v * BV + tl.arange(0, BV)
    mk, mv = ck < K, cv < V
    state_off = ck[:, None] * V + cv[None, :]
    state_mask = mk[:, None] & mv[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_START:
        S = tl.load(start + (n * H + h).to(tl.int64) * K * V + state_off, mask=state_mask, other=0)
        S = S.to(tl.float32)
    return n, h, bos, eos, c0, ck, cv, mk, mv, state_off, state_mask, S
