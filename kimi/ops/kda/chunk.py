"""Chunkwise-parallel KDA in plain PyTorch (ALGORITHMS.md section 1, "Chunkwise-parallel form").

The sequence is cut into chunks of C tokens. Everything inside a chunk (the pairwise decays, the
triangular solve of the delta rule, the intra-chunk attention) is computed for many chunks, heads and batch
rows at once; only the state handed from one chunk to the next is a Python loop. Autograd differentiates
it as written, so no custom backward is needed.

Numerics: the pairwise decays exp(G_t - G_s) are formed as differences first and masked to -inf where
s > t before exponentiating, so every exponential taken is <= 1 and nothing overflows however strong the
gates are (the factored exp(G_t) * exp(-G_s) of the kernels overflows fp32 once -G passes ~88 in a chunk).
The price is a [C, C, K] tensor per chunk, which a GPU kernel cannot afford but a reference can.
"""

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .naive import compute_dtype


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


# Elements of the [.., C, C, K] pairwise-decay tensor built at once (4 MiB in fp32): bounds the memory
# of long sequences, which would otherwise hold O(T * C * K) for the backward pass.
_PAIRWISE_BUDGET = 1 << 20


def _pairwise_scores(q: torch.Tensor, k: torch.Tensor, G: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Key-key (strictly lower) and query-key (lower with diagonal) scores of every chunk, [.., C, C].

    The decay exp(G_t - G_s) is masked to -inf above the diagonal before exponentiating (see module doc).
    """
    C = G.shape[-2]
    causal = torch.ones(C, C, dtype=torch.bool, device=G.device).tril()
    diff = G.unsqueeze(-2) - G.unsqueeze(-3)  # [.., t, s, K]
    k_decayed = diff.masked_fill(~causal.unsqueeze(-1), float("-inf")).exp() * k.unsqueeze(-3)
    L = (k.unsqueeze(-2) * k_decayed).sum(-1).tril(-1)
    A_qk = (q.unsqueeze(-2) * k_decayed).sum(-1)
    return L, A_qk


def _intra_chunk_scores(
    q: torch.Tensor, k: torch.Tensor, G: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_pairwise_scores` over groups of chunks, each under activation checkpointing.

    Only the [C, C] results are kept for backward; the [C, C, K] tensors are rebuilt group by group when
    gradients are taken, so memory stays bounded by the budget instead of growing with T.
    """
    B, H, n, C, K = G.shape
    group = max(1, _PAIRWISE_BUDGET // (B * H * C * C * K))
    scores = _pairwise_scores
    if torch.is_grad_enabled():
        scores = functools.partial(checkpoint, _pairwise_scores, use_reentrant=False)
    parts = [scores(*(x[:, :, i : i + group] for x in (q, k, G))) for i in range(0, n, group)]
    return tuple(torch.cat(p, dim=2) for p in zip(*parts))


def chunk_kda_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kimi.ops.kda.naive.naive_recurrent_kda`, computed chunk by chunk."""
    dtype, out_dtype = compute_dtype(q), v.dtype
    B, T, H, K = q.shape
    V = v.shape[-1]
    initial = q.new_zeros(B, H, K, V, dtype=dtype) if initial_state is None else initial_state.to(dtype)
    if T == 0:  # an empty packed sequence: the state passes through
        return v.new_empty(B, 0, H, V), initial
    q = _to_chunks(q, chunk_size, dtype) * scale
    k, v, g, beta = (_to_chunks(x, chunk_size, dtype) for x in (k, v, g, beta))
    G = g.cumsum(-2)  # in-chunk cumulative log-decay, per channel

    L, A_qk = _intra_chunk_scores(q, k, G)

    # Delta rule within the chunk: solve (I + StrictLower(Diag(beta) L)) [W U] = Diag(beta) [exp(G) K, V].
    # unitriangular: the solver takes the unit diagonal as given and never reads the (zero) one passed.
    rhs = beta.unsqueeze(-1) * torch.cat([G.exp() * k, v], dim=-1)
    WU = torch.linalg.solve_triangular(beta.unsqueeze(-1) * L, rhs, upper=False, unitriangular=True)
    W, U = WU.split([K, V], dim=-1)

    G_last = G[..., -1:, :]  # total decay of each chunk, [B, H, n, 1, K]
    q_decayed = q * G.exp()  # reads the entering state through the decay accrued so far
    k_to_end = k * (G_last - G).exp()  # writes decayed to the end of the chunk
    chunk_decay = G_last.exp().transpose(-1, -2)  # [B, H, n, K, 1]

    state, outputs = initial, []
    for i in range(q.shape[2]):
        v_new = U[:, :, i] - W[:, :, i] @ state  # what the entering state does not already predict
        outputs.append(q_decayed[:, :, i] @ state + A_qk[:, :, i] @ v_new)
        state = chunk_decay[:, :, i] * state + k_to_end[:, :, i].transpose(-1, -2) @ v_new
    o = torch.stack(outputs, dim=2).reshape(B, H, -1, V)[:, :, :T].transpose(1, 2)
    return o.to(out_dtype), state
