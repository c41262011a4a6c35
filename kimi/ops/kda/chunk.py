"""Chunkwise-parallel KDA in plain PyTorch (docs/algorithms.md section 1.3, chunkwise-parallel form).

The sequence is cut into chunks of C tokens. Everything inside a chunk (the pairwise decays, the
triangular solve of the delta rule, the intra-chunk attention) is computed for many chunks, heads and batch
rows at once; only the state handed from one chunk to the next is a Python loop. Autograd differentiates
it as written, so no custom backward is needed.

Numerics: the intra-chunk scores need the pairwise decays exp(G_t - G_s), s <= t, with G the in-chunk
cumulative log-decay. Writing them as exp(G_t) * exp(-G_s) overflows fp32 once -G passes ~88 in a chunk.
Instead each chunk is cut into sub-chunks and the pairs (t, s) are split in two kinds:

* s in an earlier sub-chunk than t: with a the last position of the sub-chunk before t's (s <= a < t),
  exp(G_t - G_s) = exp(G_t - G_a) * exp(G_a - G_s) exactly. G never increases (g <= 0), so both factors
  are <= 1: nothing overflows, and a factor only underflows where the true product is smaller still. The
  factors fold into the keys and queries, so these off-diagonal blocks are plain matmuls.
* s in t's own sub-chunk: the diagonal blocks, split again the same way (16 -> 4 tokens, SUB_CHUNKS).
  Within the last level no anchor lies between t and s, so the [S, S, K] tensor of G_t - G_s is formed,
  set to -inf where s > t and then exponentiated: every exponential is again <= 1.

exp(G_t) and exp(G_C - G_t) are <= 1 as well, so the result is exact for any gate strength (the tests go
down to -20 per token). Nothing is recomputed for the backward (no activation checkpointing): autograd
keeps about 40 values per token, head and key channel, linear in T (160 MiB at T = 4096, H = 4,
K = V = 64).
"""

import torch
import torch.nn.functional as F

from .naive import compute_dtype

# Nested sub-chunk lengths: a chunk is anchored every 16 tokens, each 16-token diagonal block every 4, and
# only the 4 x 4 diagonal blocks are formed exactly. Stopping at 16 made the [16, 16, K] tensors cost more
# than everything else together (on CPU, 2 threads); going below 4 does not pay.
# The widest key head the Triton kernels take (their key tiles; kimi/ops/kda/triton/common.py)
TRITON_MAX_HEAD_DIM = 256
CHUNK_SIZE = 64  # tokens per chunk: the one definition (Triton kernels, the layer, FLOP counts use it)
SUB_CHUNKS = (16, 4)


def chunk_flops_per_token(K: int, V: int, chunk_size: int = CHUNK_SIZE) -> float:
    """Forward FLOPs of chunkwise KDA per token and head (docs/algorithms.md section 1.3), a multiply-add
    being 2 and a triangular product counting its triangle (C the chunk size):

        6 K V      the state: V_new = U - W S, the read (Q exp(G)) S, the write (exp(G_C - G) K)^T V_new
        3 C K      L and A_qk (strict and causal triangles of key-key and query-key products), W = M exp(G) K
        2 C V      U = M V and A_qk V_new
        C^2 / 3    M, the inverse of the unit lower-triangular C x C system (forward substitution)

    The backward is counted as twice that (autograd's gradients of each product, no recomputation)."""
    C = chunk_size
    return 6 * K * V + 3 * C * K + 2 * C * V + C * C / 3
# Under Kimi K3's safe gate (every g >= L, L >= -5 = BOUNDED_MIN): within 16 tokens G falls by at most 80,
# and e^80 fits fp32 and bf16 (their largest is ~e^88.7), so a 16-token diagonal block is one anchored matmul
# (_bounded_scores) instead of a recursion down to exact 4 x 4 blocks.
BOUNDED_SUB_CHUNK = 16
BOUNDED_MIN = -80.0 / BOUNDED_SUB_CHUNK


def bounded(lower_bound: float | None) -> bool:
    """Whether gates known to be >= lower_bound let the diagonal sub-chunk blocks be anchored matmuls: G then
    falls by at most 80 inside a sub-chunk, and exp(80) is finite in fp32 (Kimi K3's -5 is exactly that)."""
    return lower_bound is not None and lower_bound >= BOUNDED_MIN


def _to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> [B, H, n_chunks, C, ...], zero-padding T up to a multiple of C.

    Zero padding is exact: a token with k = 0, g = 0 and beta = 0 leaves the state unchanged (no decay,
    nothing written), and the outputs at padded positions are dropped.
    """
    x = x.to(dtype).transpose(1, 2)
    pad = -x.shape[2] % chunk_size
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    return x.reshape(*x.shape[:2], -1, chunk_size, *x.shape[3:])


def _exact_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-key and query-key scores of blocks [.., S, K] from the masked [S, S, K] pairwise decays."""
    S = G.shape[-2]
    causal = torch.ones(S, S, dtype=torch.bool, device=G.device).tril().unsqueeze(-1)
    k_decayed = torch.where(causal, G.unsqueeze(-2) - G.unsqueeze(-3), -torch.inf).exp()
    k_decayed = k_decayed * k.unsqueeze(-3)  # [.., t, s, K]
    return (k_decayed @ torch.stack([k, q], dim=-1)).unbind(-1)


def _bounded_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same scores of blocks [.., S, K] whose G falls by at most 80 (S tokens of gates >= BOUNDED_MIN):
    anchored at each block's first position, exp(G_t - G_0) in (e^-80, 1] and exp(G_0 - G_s) in [1, e^80),
    both finite, so every pair is one matmul; the pairs s > t (finite too) are masked after it."""
    anchor = G[..., :1, :]
    keys = k * (anchor - G).exp()
    to_anchor = (G - anchor).exp()
    kk, qk = (torch.cat([k * to_anchor, q * to_anchor], dim=-2) @ keys.transpose(-1, -2)).split(G.shape[-2],
                                                                                                -2)
    return kk.tril(), qk.tril()


def _scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor, subs: tuple[int, ...], leaf=_exact_scores
) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-key and query-key scores sum_d x_{t,d} k_{s,d} exp(G_{t,d} - G_{s,d}), x = k or q, s <= t.

    Blocks [.., n, K] -> two [.., n, n], lower triangular with the diagonal. Pairs in different sub-blocks of
    length subs[0] are anchored matmuls (module doc); the diagonal sub-blocks recurse on subs[1:].
    """
    if not subs:
        return leaf(q, k, G)
    n, S = G.shape[-2], subs[0]
    J = n // S
    qs, ks, Gs = (x.unflatten(-2, (J, S)) for x in (q, k, G))  # [.., J, S, K]
    # Sub-block j >= 1 pairs with the positions s < j * S through the anchor a = j * S - 1.
    G_anchor = G[..., S - 1 : -1 : S, :].unsqueeze(-2)  # [.., J - 1, 1, K]
    to_anchor = (Gs[..., 1:, :, :] - G_anchor).exp()  # t side, [.., J - 1, S, K]
    rows = torch.cat([ks[..., 1:, :, :] * to_anchor, qs[..., 1:, :, :] * to_anchor], dim=-2)
    # The s side is laid out over the first n - S positions for every j and zeroed (exp(-inf)) from
    # sub-block j on, so one batched matmul serves every j.
    before = torch.arange(n - S, device=G.device) // S < torch.arange(1, J, device=G.device).unsqueeze(-1)
    from_anchor = torch.where(before.unsqueeze(-1), G_anchor - G[..., :-S, :].unsqueeze(-3), -torch.inf)
    keys = k[..., :-S, :].unsqueeze(-3) * from_anchor.exp()  # [.., J - 1, n - S, K]
    off = rows @ keys.transpose(-1, -2)  # [.., J - 1, 2S, n - S]
    # Row block 0 has no earlier sub-block, and no pair has s in the last one.
    off = F.pad(off, (0, S, 0, 0, 1, 0)).split(S, dim=-2)  # 2 x [.., J, S, n]
    diagonal = _scores(qs, ks, Gs, subs[1:], leaf)  # 2 x [.., J, S, S]
    # Add each diagonal block at column block j of row block j.
    on_diagonal = torch.eye(J, dtype=G.dtype, device=G.device).view(J, 1, J, 1)
    return tuple(
        (o.unflatten(-1, (J, S)) + d.unsqueeze(-2) * on_diagonal).flatten(-4, -3).flatten(-2)
        for o, d in zip(off, diagonal)
    )


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = CHUNK_SIZE,
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kimi.ops.kda.naive.naive_recurrent_kda`, computed chunk by chunk.
    lower_bound: every g is known to be >= it (Kimi K3's safe gate): at BOUNDED_MIN or above, the diagonal
    blocks take the bounded path (module constants)."""
    dtype, out_dtype = compute_dtype(q), v.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    initial = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    if T == 0:  # an empty packed sequence: the state passes through
        return v.new_empty(B, 0, H, V), initial
    q = _to_chunks(q, chunk_size, dtype) * scale
    k, v, g, beta = (_to_chunks(x, chunk_size, dtype) for x in (k, v, g, beta))
    G = g.cumsum(-2)  # in-chunk cumulative log-decay, per channel

    if bounded(lower_bound) and chunk_size % BOUNDED_SUB_CHUNK == 0:
        subs, leaf = ((BOUNDED_SUB_CHUNK,) if chunk_size > BOUNDED_SUB_CHUNK else ()), _bounded_scores
    else:
        subs, leaf = tuple(s for s in SUB_CHUNKS if s < chunk_size and chunk_size % s == 0), _exact_scores
    L, A_qk = _scores(q, k, G, subs, leaf)
    L = L.tril(-1)  # the delta rule couples each token to earlier ones only

    # Delta rule within the chunk: solve (I + StrictLower(Diag(beta) L)) [W U] = Diag(beta) [exp(G) K, V].
    # unitriangular: the solver takes the unit diagonal as given and never reads the (zero) one passed.
    decay = G.exp()  # decay accrued since the chunk start, <= 1
    rhs = beta.unsqueeze(-1) * torch.cat([decay * k, v], dim=-1)
    WU = torch.linalg.solve_triangular(beta.unsqueeze(-1) * L, rhs, upper=False, unitriangular=True)
    W, U = WU.split([K, V], dim=-1)

    G_last = G[..., -1:, :]  # total decay of each chunk, [B, H, n, 1, K]
    q_decayed = q * decay  # reads the entering state through the decay accrued so far
    k_to_end = k * (G_last - G).exp()  # writes decayed to the end of the chunk
    chunk_decay = G_last.exp().transpose(-1, -2)  # [B, H, n, K, 1]

    # Only the state hand-over is sequential; the reads of every chunk are batched after it. unbind, not
    # indexing: its backward stacks the per-chunk gradients once instead of scattering each into zeros.
    state, entering, v_new = initial, [], []
    for W_i, U_i, k_i, decay_i in zip(*(x.unbind(2) for x in (W, U, k_to_end, chunk_decay))):
        entering.append(state)
        v_new.append(U_i - W_i @ state)  # what the entering state does not already predict
        state = decay_i * state + k_i.transpose(-1, -2) @ v_new[-1]
    o = q_decayed @ torch.stack(entering, dim=2) + A_qk @ torch.stack(v_new, dim=2)
    o = o.reshape(B, H, -1, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), state
