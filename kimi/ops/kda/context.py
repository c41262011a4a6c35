"""KDA over a sequence split into consecutive shards (context parallelism): each shard runs once from a zero
state, the shards' small summaries are joined, and each shard adds its incoming state's share to its
outputs.

One token maps the state affinely, S_t = A_t S_{t-1} + b_t k_t v_t^T with A_t = (I - b_t k_t k_t^T)
Diag(exp(g_t)) (:func:`kimi.ops.kda.recurrent.kda_step`), so a whole shard does too:

    S_end = P S_in + S_zero,   P = A_T ... A_1 (the shard's transition, [K, K] per head),

where S_zero is the shard's final state from a zero state. P is the final state of the same recurrence
run with v = 0 from the identity, so the KDA kernels compute it; :func:`naive_transition` is the reference
beside it (the product of the A_t). Joining is a prefix fold over shards (:func:`incoming_states`), whose
inputs per shard are two [B, H, K, *] tensors whatever the shard's length: what context-parallel ranks
exchange. Each output is affine in S_in too, o_t = o_zero_t + (scale q_t^T P_t) S_in, and the same run
gives the row vectors scale q_t^T P_t as the outputs of its identity columns (:func:`shard_pass`), so the
shard needs no second run from S_in (:func:`add_incoming`).

Packed documents (``cu_seqlens`` of the shard, with ``continues``: whether the shard's first token
continues the previous shard's document): the incoming state reaches only the shard's first document, and
leaves the shard only when that document is also its last, so P is zero otherwise.
"""

from __future__ import annotations

import torch

from . import chunk_kda


def naive_transition(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """P = A_T ... A_1 with A_t = (I - beta_t k_t k_t^T) Diag(exp(g_t)), token by token: [B, H, K, K].
    k, g: [B, T, H, K]; beta: [B, T, H] (the reference :func:`shard_pass`'s P is tested against)."""
    B, T, H, K = k.shape
    P = torch.eye(K, dtype=k.dtype, device=k.device).expand(B, H, K, K)
    for t in range(T):
        kt, bt = k[:, t], beta[:, t][..., None, None]
        A = (torch.eye(K, dtype=k.dtype, device=k.device) - bt * kt[..., :, None] * kt[..., None, :])
        P = (A * g[:, t].exp()[..., None, :]) @ P
    return P


def row_sequences(cu_seqlens: torch.Tensor | None, rows: int, length: int) -> tuple[list[int], list[int]]:
    """Indices of the sequence that starts each row and of the one that ends it: the rows themselves
    without ``cu_seqlens``; with it, the packed sequences at each row's start and end (a packed row of
    ``rows`` rows of length / rows tokens, whose row starts are sequence boundaries)."""
    if cu_seqlens is None:
        return list(range(rows)), list(range(rows))
    offsets, n = cu_seqlens.tolist(), length // rows
    index = {c: i for i, c in enumerate(offsets)}
    missing = [r * n for r in range(rows) if r * n not in index]
    if missing:
        raise ValueError(f"cu_seqlens {offsets} must start a sequence at every row start; missing {missing}")
    first = [index[r * n] for r in range(rows)]
    return first, [f - 1 for f in first[1:]] + [len(offsets) - 2]


def _rows_continuing(continues, rows: int, device) -> torch.Tensor:
    """``continues`` (one bool, or one per row) as a [rows] bool tensor."""
    flags = torch.as_tensor(continues, dtype=torch.bool, device=device).reshape(-1)
    return flags.expand(rows) if flags.numel() == 1 else flags


def shard_pass(q, k, v, g, beta, scale: float | None = None, cu_seqlens: torch.Tensor | None = None,
               continues=True, backend: str | None = None, lower_bound: float | None = None,
               reached: bool | None = None):
    """One chunked KDA run over a shard, from a zero state, that gives a rank all it needs:
    (o_zero, reach, P, S_zero).

    - o_zero [B, T, H, V]: the shard's outputs from a zero incoming state.
    - reach [B, T, H, K]: each token's scale q_t^T P_t, with P_t = A_t ... A_1 the transition so far. A
      continued document's outputs are o_zero + reach S_in (:func:`add_incoming`). It is None where no row
      continues.
    - P [R, H, K, K] and S_zero [R, H, K, V]: the summary that ranks exchange, one per row.

    Rows are the batch rows without ``cu_seqlens``. With it, they are the R = len(continues) rows packed
    along T (R = 1 when ``continues`` is one bool). continues: per row, whether its first token continues
    the previous shard's document. P is zero where the incoming state does not cross the row, that is where
    the row's first document ends inside the shard. reached: whether any row continues, where the caller
    knows it (None: read from ``continues``, which waits for the device)."""
    B, T, H, K = k.shape
    V = v.shape[-1]
    rows = B if cu_seqlens is None else torch.as_tensor(continues).numel()
    flags = _rows_continuing(continues, rows, k.device)
    first, last = row_sequences(cu_seqlens, rows, B * T)
    if not (bool(flags.any()) if reached is None else reached):
        o, states = chunk_kda(q, k, v, g, beta, scale, output_final_state=True, cu_seqlens=cu_seqlens,
                              backend=backend, lower_bound=lower_bound)
        return o, None, k.new_zeros(rows, H, K, K, dtype=states.dtype), states[last]
    # The state's value columns evolve independently under the same transitions. So the values [v, 0],
    # run from the initial state [0, I], end at [S_zero, P], and their outputs are [o_zero, reach]. One run,
    # not one per quantity, keeps the key-side intermediates (gates, transitions, key products) once for
    # the backward, and no second run from the incoming state is needed: the outputs are affine in it.
    sequences = B if cu_seqlens is None else cu_seqlens.numel() - 1
    dtype = torch.promote_types(v.dtype, torch.float32)  # the states' (fp32, or fp64 for a reference)
    start = torch.zeros(sequences, H, K, V + K, dtype=dtype, device=k.device)
    start[..., V:] = torch.eye(K, dtype=dtype, device=k.device)
    o, states = chunk_kda(q, k, torch.cat([v, torch.zeros_like(k, dtype=v.dtype)], -1), g, beta, scale,
                          initial_state=start, output_final_state=True, cu_seqlens=cu_seqlens,
                          backend=backend, lower_bound=lower_bound)
    S, P = states[last].split([V, K], -1)
    # the incoming state crosses the shard only along a row that is one continued document
    through = flags & torch.tensor([a == b for a, b in zip(first, last)], device=k.device)
    o, reach = o.split([V, K], -1)
    return o, reach, P * through[:, None, None, None].to(P.dtype), S


def incoming_states(summaries: list[tuple[torch.Tensor, torch.Tensor]],
                    initial: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each shard's incoming state and, last, the final state: S_in(0) = initial (zero when None),
    S_in(r + 1) = P_r S_in(r) + S_zero_r."""
    S0 = summaries[0][1]
    states = [torch.zeros_like(S0) if initial is None else initial.to(S0.dtype)]
    for P, S in summaries:
        states.append(P @ states[-1] + S)
    return states


def sharded_kda(q, k, v, g, beta, shards: int, scale: float | None = None,
                cu_seqlens: torch.Tensor | None = None, initial_state: torch.Tensor | None = None,
                backend: str | None = None, lower_bound: float | None = None) -> tuple[torch.Tensor,
                                                                                       torch.Tensor]:
    """KDA of the whole sequence computed shard by shard as context-parallel ranks compute it (one
    process: the exchange is a list): (o, final state), equal to chunk_kda's. T must divide by shards."""
    T = q.shape[1]
    if T % shards:
        raise ValueError(f"T = {T} does not split into {shards} shards")
    n = T // shards
    parts = []
    for r in range(shards):
        part = tuple(x[:, r * n:(r + 1) * n] for x in (q, k, v, g, beta))
        local, continues = local_cu_seqlens(cu_seqlens, r * n, n)
        parts.append((part, local, continues))
    passes = [shard_pass(*part, scale, local, continues, backend, lower_bound)
              for part, local, continues in parts]
    states = incoming_states([(P, S) for _, _, P, S in passes], initial_state)
    outputs = [add_incoming(o, reach, s_in, local, continues)
               for (o, reach, _, _), (_, local, continues), s_in in zip(passes, parts, states)]
    return torch.cat(outputs, dim=1), states[-1]


def local_cu_seqlens(cu_seqlens: torch.Tensor | None, start: int, length: int):
    """A shard's own cu_seqlens (None without packing) and whether its first token continues a document."""
    if cu_seqlens is None:
        return None, True
    inside = [int(c) - start for c in cu_seqlens.tolist() if start < int(c) < start + length]
    continues = start not in cu_seqlens.tolist()
    return torch.tensor([0, *inside, length], dtype=cu_seqlens.dtype, device=cu_seqlens.device), continues


def add_incoming(o: torch.Tensor, reach: torch.Tensor | None, incoming: torch.Tensor, cu_seqlens,
                 continues) -> torch.Tensor:
    """A shard's outputs from its rows' incoming states [R, H, K, V]: o_zero + reach S_in on the tokens of
    each row's first document, where that document continues (rows, o and reach as :func:`shard_pass`
    gives them). Summed in the states' precision and rounded once to o's dtype."""
    if reach is None:
        return o
    B, T, H, K = reach.shape
    rows = incoming.shape[0]
    flags = _rows_continuing(continues, rows, o.device)
    n = B * T // rows
    reach = reach.reshape(rows, n, H, K)
    read = flags[:, None].expand(rows, n)
    if cu_seqlens is not None:  # packed rows: up to the end of each row's first document
        first, _ = row_sequences(cu_seqlens, rows, T)
        ends = cu_seqlens.long()[torch.tensor(first, device=o.device) + 1]
        starts = torch.arange(rows, device=o.device) * n
        read = read & (torch.arange(n, device=o.device)[None, :] < (ends - starts)[:, None])
    share = torch.einsum("rnhk,rhkv->rnhv", reach.to(incoming.dtype), incoming)
    share = share * read[:, :, None, None].to(share.dtype)
    return (o.to(incoming.dtype) + share.reshape(B, T, H, -1)).to(o.dtype)
