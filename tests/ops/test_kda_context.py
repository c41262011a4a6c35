"""KDA split along the sequence (kimi/ops/kda/context.py), the building block of context parallelism: a
shard's transition P against the token-by-token product, the affine map it defines against running the
shard from a given state, the one run per shard that also gives each token's share of the incoming state,
and shard-by-shard KDA (2 and 4 shards, packed documents crossing shard edges)
equal to the whole sequence's in fp64: outputs, final state and every gradient."""

import sys

import pytest
import torch
from kda_cp_problem import B, H, K, T, V, attention_inputs, conv_inputs, inputs

from kimi.ops.kda import chunk_kda
from kimi.ops.kda.context import naive_transition, shard_pass, sharded_kda


@pytest.mark.unit
def test_short_conv_reads_the_previous_shards_tail():
    """A shard given the previous shard's last K-1 inputs (its first document continued) equals the whole
    packed sequence's conv; a shard whose first token starts a document gets none."""
    from kimi.ops.kda.context import local_cu_seqlens

    conv, x = conv_inputs()
    cu = torch.tensor([0, 5, 16, 27, T], dtype=torch.int32)
    whole, _ = conv(x, cu)
    for shards in (2, 4):
        n, tail, parts = T // shards, None, []
        for r in range(shards):
            local, continues = local_cu_seqlens(cu, r * n, n)
            y, tail = conv(x[:, r * n:(r + 1) * n], local, tail if continues else None)
            parts.append(y)
        torch.testing.assert_close(torch.cat(parts, dim=1), whole, rtol=1e-12, atol=1e-13)


@pytest.mark.unit
def test_transition_is_the_product_and_the_shard_map_is_affine():
    q, k, v, g, beta = inputs()
    _, _, P, S_zero = shard_pass(q, k, v, g, beta)
    torch.testing.assert_close(P, naive_transition(k, g, beta), rtol=1e-10, atol=1e-12)
    S_in = torch.randn(B, H, K, V, dtype=torch.float64)
    _, S_end = chunk_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=True)
    torch.testing.assert_close(S_end, P @ S_in + S_zero, rtol=1e-10, atol=1e-12)


@pytest.mark.unit
def test_a_shard_is_one_kda_run(monkeypatch):
    """Each shard runs the chunked KDA once, over the values [v, 0] from the state [0, I]: its outputs from
    a zero state, each token's reach scale q_t^T P_t, S_zero and P equal their own runs (every gradient
    too), and o_zero + reach S_in equals the shard run from S_in. Autograd keeps one run's intermediates:
    the rank neither runs the shard a second time from its incoming state nor keeps that run for the
    backward."""
    import kimi.ops.kda.context as context

    q, k, v, g, beta = args = [t.requires_grad_() for t in inputs()]
    calls = []
    monkeypatch.setattr(context, "chunk_kda",
                        lambda *a, **kw: calls.append(a[2].shape) or chunk_kda(*a, **kw))
    o, reach, P, S = shard_pass(*args)
    assert calls == [(B, T, H, V + K)]
    eye = torch.eye(K, dtype=torch.float64).expand(B, H, K, K)
    want_o, want_S = chunk_kda(q, k, v, g, beta, output_final_state=True)
    want_reach, want_P = chunk_kda(q, k, torch.zeros_like(k), g, beta, initial_state=eye,
                                   output_final_state=True)
    got, want = (o, reach, P, S), (want_o, want_reach, want_P, want_S)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    weights = [torch.randn_like(x) for x in want]
    grads = [torch.autograd.grad(sum((x * w).sum() for x, w in zip(xs, weights)), args) for xs in (got, want)]
    for name, a, b in zip(("q", "k", "v", "g", "beta"), *grads):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=lambda m: f"{name}: {m}")
    S_in = torch.randn(B, H, K, V, dtype=torch.float64)
    from_in, _ = chunk_kda(q, k, v, g, beta, initial_state=S_in)
    torch.testing.assert_close(context.add_incoming(o, reach, S_in, None, True), from_in, rtol=1e-10,
                               atol=1e-12)
    calls.clear()  # a shard no state reaches (the first) runs once over v alone
    o, reach, P, _ = shard_pass(*args, continues=False)
    assert calls == [(B, T, H, V)] and reach is None and not P.any()
    torch.testing.assert_close(o, want_o, rtol=1e-12, atol=1e-13)


@pytest.mark.unit
@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_equals_whole_with_gradients(shards):
    args = inputs()
    init = torch.randn(B, H, K, V, dtype=torch.float64, requires_grad=True)
    whole_o, whole_s = chunk_kda(*args, initial_state=init, output_final_state=True)
    o, s = sharded_kda(*args, shards, initial_state=init)
    torch.testing.assert_close(o, whole_o, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(s, whole_s, rtol=1e-10, atol=1e-11)
    w_o, w_s = torch.randn_like(o), torch.randn_like(s)
    want = torch.autograd.grad((whole_o * w_o).sum() + (whole_s * w_s).sum(), [*args, init])
    got = torch.autograd.grad((o * w_o).sum() + (s * w_s).sum(), [*args, init])
    for name, a, b in zip(("q", "k", "v", "g", "beta", "initial_state"), got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{name}: {m}")


@pytest.mark.unit
def test_safe_gate_bound_reaches_every_shard(monkeypatch):
    """Under Kimi K3's safe gate (every g >= -5) context parallelism's KDA passes the bound to its one
    chunk_kda call per shard, which then takes the bounded diagonal blocks, and it
    still equals the whole sequence's naive recurrence, packed documents crossing shard edges included."""
    from kimi.ops.kda import chunk as chunk_module

    calls = []
    bounded = chunk_module._bounded_scores
    monkeypatch.setattr(chunk_module, "_bounded_scores", lambda *a: calls.append(1) or bounded(*a))
    q, k, v, _, beta = inputs(b=1, seed=2, t=64)
    g = (-5 * torch.sigmoid(4 + torch.randn(q.shape, dtype=torch.float64,
                                            generator=torch.Generator().manual_seed(3)))).requires_grad_()
    cu = torch.tensor([0, 20, 37, 64], dtype=torch.int32)
    want_o, want_s = chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, backend="naive")
    o, s = sharded_kda(q, k, v, g, beta, 2, cu_seqlens=cu, lower_bound=-5.0)
    torch.testing.assert_close(o, want_o, rtol=1e-10, atol=1e-11)
    torch.testing.assert_close(s, want_s[-1:], rtol=1e-10, atol=1e-11)
    assert len(calls) >= 2  # in each shard's one run


@pytest.mark.unit
@pytest.mark.parametrize("starts", [[0, 5, 21], [0, 8, 16, 27], [0, 3, 4, 30]])
def test_packed_documents_across_shard_edges(starts):
    """Documents start inside shards, exactly at a shard edge (8, 16 with 4 shards of 8) or span shards."""
    args = inputs(b=1, seed=1)
    cu = torch.tensor([*starts, T], dtype=torch.int32)
    whole_o, whole_s = chunk_kda(*args, output_final_state=True, cu_seqlens=cu)
    w = torch.randn_like(whole_o)
    want = torch.autograd.grad((whole_o * w).sum(), args)
    for shards in (2, 4):
        o, s = sharded_kda(*args, shards, cu_seqlens=cu)
        torch.testing.assert_close(o, whole_o, rtol=1e-10, atol=1e-11)
        torch.testing.assert_close(s, whole_s[-1:], rtol=1e-10, atol=1e-11)
        got = torch.autograd.grad((o * w).sum(), args)
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


@pytest.mark.unit
def test_packed_attention_of_a_shards_queries_over_the_prefix():
    """A shard's queries (the last n of the prefix of keys up to its end) under packed documents: the
    same rows as attention over the whole packed sequence."""
    from kimi.ops.attention import attention

    q, k, v = (x.detach()[:1] for x in attention_inputs())
    cu = torch.tensor([0, 5, 16, 27, T], dtype=torch.int32)
    whole = attention(q, k, v, causal=True, cu_seqlens=cu)
    for end in (8, 16, 24, T):
        prefix = cu[cu <= end].tolist() + ([end] if end not in cu.tolist() else [])
        got = attention(q[:, end - 8:end], k[:, :end], v[:, :end], causal=True,
                        cu_seqlens=torch.tensor(prefix, dtype=torch.int32))
        torch.testing.assert_close(got, whole[:, end - 8:end], rtol=1e-12, atol=1e-13)


@pytest.mark.dist
@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_ranks_equal_one_device(tmp_path, world):
    """tests/dist_kda_cp.py: each of `world` gloo ranks holds one shard; the ranks' outputs, the final state
    and every input gradient (one all-gather of the shard summaries forward, one all-reduce backward) equal
    the whole sequence's on one device, also with packed documents; and a short conv whose halo comes from
    the previous rank."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "cp.pt"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
           str(Path(__file__).parents[1] / "dist_kda_cp.py"), str(out)]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = torch.load(out, weights_only=False)
    from dist_kda_cp import KDA_CASES

    for (case, t), starts in KDA_CASES.items():
        r = results[case, t]
        args = inputs(b=1 if starts else 2, seed=1, t=t)
        cu = None if starts is None else torch.tensor([*starts, t], dtype=torch.int32)
        o, states = chunk_kda(*args, output_final_state=True, cu_seqlens=cu)
        state = states[-1:] if starts else states
        loss = (o * r["w"]).sum() + ((state * r["w_s"]).sum() if starts is None else 0.0)
        grads = torch.autograd.grad(loss, args)
        torch.testing.assert_close(r["o"], o.detach(), rtol=1e-10, atol=1e-11)
        torch.testing.assert_close(r["state"], state.detach(), rtol=1e-10, atol=1e-11)
        for name, a, b in zip(("q", "k", "v", "g", "beta"), r["grads"], grads):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{case} T={t} {name}: {m}")
    conv, x = conv_inputs()  # the short conv's halo from the previous rank, and its gradient back
    r = results["conv"]
    y, _ = conv(x, torch.tensor([0, 5, 16, 27, T], dtype=torch.int32))
    (y * r["w"]).sum().backward()
    torch.testing.assert_close(r["y"], y.detach(), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(r["x_grad"], x.grad, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(r["w_grad"], conv.weight.grad, rtol=1e-10, atol=1e-12)
    from kimi.ops.attention import attention  # each rank's queries over the gathered prefix of keys

    q, k, v = attention_inputs()
    r = results["attention"]
    o, max_logits = attention(q, k, v, causal=True, return_max_logits=True)
    grads = torch.autograd.grad((o * r["w"]).sum(), (q, k, v))
    torch.testing.assert_close(r["o"], o.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(r["max_logits"], max_logits.detach(), rtol=1e-12, atol=0)
    for name, a, b in zip("qkv", r["grads"], grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"attention {name}: {m}")


def _rows_by_shards(starts: torch.Tensor, shards: int):
    """For each shard of rows with document starts ``starts`` [R, T]: its columns, its packed cu_seqlens
    (every row's first token a boundary) and which rows continue a document from the shard before."""
    from kimi.ops.documents import cu_seqlens_from_starts

    n = starts.shape[1] // shards
    for r in range(shards):
        cols = slice(r * n, (r + 1) * n)
        local = starts[:, cols].clone()
        continues = (~local[:, 0]) & (r > 0)
        local[:, 0] = True
        yield cols, cu_seqlens_from_starts(local), continues


@pytest.mark.unit
def test_packed_rows_continue_their_own_documents_across_shards():
    """Two rows packed along T (data.varlen under context parallelism): each shard's rows carry their own
    state and conv halo from the shard before, only where the row's first document continues; equal to the
    whole rows packed, outputs and gradients."""
    from kimi.ops.documents import cu_seqlens_from_starts
    from kimi.ops.kda.context import add_incoming, incoming_states

    starts = torch.zeros(2, T, dtype=torch.bool)
    for row, s in ((0, [0, 5, 21]), (1, [0, 8, 16, 27])):  # row 1: starts at the edges of 4 shards of 8
        starts[row, s] = True
    args = inputs(b=2, seed=2)
    packed = [x.reshape(1, 2 * T, *x.shape[2:]) for x in args]
    whole, _ = chunk_kda(*packed, cu_seqlens=cu_seqlens_from_starts(starts))
    w = torch.randn_like(whole)
    want = torch.autograd.grad((whole * w).sum(), args)
    conv, _ = conv_inputs()
    xc = torch.randn(2, T, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    whole_conv, _ = conv(xc.reshape(1, 2 * T, 5), cu_seqlens_from_starts(starts))
    for shards in (2, 4):
        n, parts, passes, convs, tail = T // shards, [], [], [], None
        for cols, cu, continues in _rows_by_shards(starts, shards):
            part = tuple(x[:, cols].reshape(1, 2 * n, *x.shape[2:]) for x in args)
            parts.append((cu, continues))
            passes.append(shard_pass(*part, cu_seqlens=cu, continues=continues))
            y, tail = conv(xc[:, cols].reshape(1, 2 * n, 5), cu, tail, continues)
            convs.append(y.view(2, n, 5))
        states = incoming_states([(P, S) for _, _, P, S in passes])
        outs = [add_incoming(o, reach, s_in, cu, continues).view(2, n, H, V)
                for (o, reach, _, _), (cu, continues), s_in in zip(passes, parts, states)]
        o = torch.cat(outs, dim=1).reshape(1, 2 * T, H, V)
        torch.testing.assert_close(o, whole, rtol=1e-10, atol=1e-11)
        for a, b in zip(torch.autograd.grad((o * w).sum(), args), want):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(torch.cat(convs, dim=1).reshape(1, 2 * T, 5), whole_conv, rtol=1e-12,
                                   atol=1e-13)


@pytest.mark.slow
@pytest.mark.unit
def test_the_triton_path_runs_shards_too():
    """The same shard-by-shard KDA on the Triton kernels (interpreted here): one run per shard over the
    values [v, 0] from the state [0, I], then each shard's outputs from its incoming state, fp32, packed
    documents across shard edges, equal to the whole sequence on the fp64 PyTorch path (outputs and input
    gradients)."""
    if sys.platform != "linux":  # elsewhere there is no triton to import (pyproject.toml)
        pytest.skip("triton is a dependency on Linux only")
    args = inputs(b=1, seed=3)
    cu = torch.tensor([0, 5, 21, T], dtype=torch.int32)
    whole, _ = chunk_kda(*args, cu_seqlens=cu)
    w = torch.randn_like(whole)
    want = torch.autograd.grad((whole * w).sum(), args)
    single = [x.detach().float().requires_grad_() for x in args]
    o, _ = sharded_kda(*single, 2, cu_seqlens=cu, backend="triton")
    torch.testing.assert_close(o.double(), whole.detach(), rtol=1e-4, atol=1e-5)
    for a, b in zip(torch.autograd.grad((o * w.float()).sum(), single), want):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-4)
