"""Residual streams: how a sublayer's input is formed from what came before it (docs/algorithms.md section 2).

Every sublayer (each token mixer and each MLP) is a layer. The model runs, for every sublayer l,

    h_l = stream.mix(query_l);  stream.push(f_l(h_l))        and finally  h = stream.mix(final_query)

with one of three streams:

* StandardStream: the pre-norm residual, h = v_0 + sum of all outputs (queries unused).
* FullAttnResStream: every output is a source; h_l = sum_i softmax_i(w_l . RMSNorm(v_i)) v_i, per token.
* BlockAttnResStream: sources are the completed block sums b_0 (= embedding), b_1, ..., plus the running
  partial sum of the current block once it holds at least one output.

`mix(query, sources)` mixes the given sources (a copy of `sources()` taken earlier) rather than the
stream's current ones: a pure function of its arguments, which activation checkpointing can recompute
after the stream has moved on. `mix(query, sources, norm)` is norm(mix): the sublayer's pre-norm, which a
fused mix (kimi.ops.attnres, model.attnres.backend) computes in the same kernel.

A stream object is exactly "the set of sources still needed" downstream: under pipeline parallelism the
completed blocks and the partial sum are what crosses a stage boundary (`sources()` lists them in order).
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch

from kimi.ops.attnres.reference import depth_attention, depth_weights, mix_then_norm  # noqa: F401
from kimi.ops.dynamo_settings import dynamo_settings


# A site mixes 1 to N + 1 sources under Block AttnRes (N blocks) and up to 2L + 1 under Full AttnRes: dynamo
# compiles one graph per count, more than its default limit of 8 per function.
MIX_RECOMPILE_LIMIT = 256


def compiled_depth_attention(mode: str | None = None) -> Callable:
    """depth_attention through torch.compile (what parallel.compile=true gives the streams): the stacks, key
    norms, scores, softmax and weighted sum become a few fused kernels instead of a dozen elementwise passes
    over every source (bench/step_audit.py's roofline: the largest memory-bound cost of an unfused step).
    mode: torch.compile's (reduce-overhead under parallel.cuda_graphs). One function per mode, however the
    mode is passed."""
    return _compiled_mix(mode)


@functools.cache
def _compiled_mix(mode: str | None) -> Callable:
    return mix_through(functools.partial(torch.compile, mode=mode))


def mix_through(compile_fn: Callable[[Callable], Callable]) -> Callable:
    """The depth mix (and its `normed` form) with depth_attention and mix_then_norm as compile_fn compiles
    them: torch.compile here, the planner's traced regions in kimi.plan.compiled."""
    # mix_then_norm: depth_attention, then RMSNorm's forward with the norm's weight and eps
    compiled = compile_fn(depth_attention)
    compiled_normed = compile_fn(mix_then_norm)

    def mix(query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float) -> torch.Tensor:
        if query is None:
            return depth_attention(query, sources, eps)
        with dynamo_settings(recompile_limit=MIX_RECOMPILE_LIMIT):
            return compiled(query, list(sources), eps)

    def normed(query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float, weight: torch.Tensor,
               norm_eps: float) -> torch.Tensor:
        # the pre-norm in the mix's compiled region: left eager it was ~10 elementwise kernels a sublayer,
        # forward and backward (an H200 profile of `1b`: 1,431 eager multiplies, 237 ms of a 1,016 ms step)
        with dynamo_settings(recompile_limit=MIX_RECOMPILE_LIMIT):
            return compiled_normed(query, list(sources), eps, weight, norm_eps)

    mix.normed = normed  # what mix_normed calls when a norm follows
    return mix


compiled_depth_attention.cache_clear = _compiled_mix.cache_clear  # forgets every mode's


def depth_mix(backend: str, compiled: bool, mode: str | None = None) -> Callable:
    """The AttnRes streams' mix function for model.attnres.backend (kimi.config.ATTNRES_BACKENDS); compiled:
    whether the sublayers are compiled (parallel.compile=true), mode: torch.compile's for them.

    torch     depth_attention, compiled with the sublayers under parallel.compile (as before the switch)
    compile   compiled_depth_attention() always
    triton    the fused Triton kernel (kimi.ops.attnres), the pre-norm folded in; needs CUDA tensors
    fla       fla-core's fused AttnRes
    auto      triton for CUDA tensors, elsewhere what torch gives
    """
    unfused = compiled_depth_attention(mode) if compiled or backend == "compile" else depth_attention
    return backend_mix(backend, unfused)


def backend_mix(backend: str, unfused: Callable) -> Callable:
    """model.attnres.backend's mix over `unfused`, the PyTorch mix (torch and compile: it alone; a fused
    backend falls back to it where its kernel does not run)."""
    if backend in ("torch", "compile"):
        return unfused
    from kimi.ops.attnres import FusedDepthMix  # imports triton's wrappers: only when asked for

    return FusedDepthMix(backend, fallback=unfused)


def mix_normed(mix: Callable, query: torch.Tensor | None, sources: Sequence[torch.Tensor], eps: float,
               norm: Callable | None) -> torch.Tensor:
    """norm(mix(query, sources, eps)); a mix with a fused form (`normed`, kimi.ops.attnres) gets the norm's
    weight and eps instead, so the pre-norm runs in its kernel. norm: a kimi.model.norm.RMSNorm, or None."""
    if norm is None:
        return mix(query, sources, eps)
    normed = getattr(mix, "normed", None)
    if normed is None:
        return norm(mix(query, sources, eps))
    return normed(query, sources, eps, norm.param("weight"), norm.eps)


class StandardStream:
    """Pre-norm residual: one running hidden state."""

    def __init__(self, embedding: torch.Tensor):
        self.hidden = embedding

    def sources(self) -> list[torch.Tensor]:
        return [self.hidden]

    def mix(self, query: torch.Tensor | None, sources: Sequence[torch.Tensor] | None = None,
            norm: Callable | None = None) -> torch.Tensor:
        hidden = self.hidden if sources is None else sources[0]
        return hidden if norm is None else norm(hidden)

    def push(self, output: torch.Tensor) -> None:
        self.hidden = self.hidden + output


class FullAttnResStream:
    """Full AttnRes: the embedding and every sublayer output so far are sources (O(L d) per token)."""

    def __init__(self, embedding: torch.Tensor, eps: float, mix: Callable = depth_attention):
        self.outputs = [embedding]
        self.eps, self.mix_fn = eps, mix

    def sources(self) -> list[torch.Tensor]:
        return list(self.outputs)

    def mix(self, query: torch.Tensor | None, sources: Sequence[torch.Tensor] | None = None,
            norm: Callable | None = None) -> torch.Tensor:
        return mix_normed(self.mix_fn, query, self.outputs if sources is None else sources, self.eps, norm)

    def push(self, output: torch.Tensor) -> None:
        self.outputs.append(output)


class BlockAttnResStream:
    """Block AttnRes with `block_size` sublayers per block (O(N d) per token for N blocks).

    Sublayer i (1-based) of block n sees [b_0, ..., b_{n-1}] and, when i >= 2, the partial sum
    b_n^{i-1} of the block's first i - 1 outputs. A block's sum joins `blocks` when its last sublayer
    has pushed; a trailing incomplete block still counts (as the partial) for the final aggregation.
    """

    def __init__(self, embedding: torch.Tensor, block_size: int, eps: float, mix: Callable = depth_attention):
        self.blocks = [embedding]
        self.partial: torch.Tensor | None = None
        self.filled = 0  # outputs summed into `partial`
        self.block_size = block_size
        self.eps, self.mix_fn = eps, mix

    def sources(self) -> list[torch.Tensor]:
        return self.blocks + ([] if self.partial is None else [self.partial])

    def mix(self, query: torch.Tensor | None, sources: Sequence[torch.Tensor] | None = None,
            norm: Callable | None = None) -> torch.Tensor:
        return mix_normed(self.mix_fn, query, self.sources() if sources is None else sources, self.eps, norm)

    def push(self, output: torch.Tensor) -> None:
        self.partial = output if self.partial is None else self.partial + output
        self.filled += 1
        if self.filled == self.block_size:
            self.blocks.append(self.partial)
            self.partial, self.filled = None, 0


def make_stream(residual: str, embedding: torch.Tensor, block_size: int, eps: float,
                mix: Callable = depth_attention):
    """The stream for a `ModelConfig.residual` mode, starting from the token embedding v_0; mix: the depth
    attention the AttnRes streams call (see depth_mix)."""
    if residual == "standard":
        return StandardStream(embedding)
    if residual == "attnres_full":
        return FullAttnResStream(embedding, eps, mix)
    if residual == "attnres_block":
        return BlockAttnResStream(embedding, block_size, eps, mix)
    raise ValueError(f"unknown residual mode {residual!r}")


def resume_stream(residual: str, sources: list[torch.Tensor], sublayers_done: int, block_size: int,
                  eps: float,
                  mix: Callable = depth_attention):
    """The stream after `sublayers_done` sublayers, rebuilt from its sources() alone: what a pipeline stage
    receives. The sources are exactly what later sublayers read (one hidden state; every output; completed
    block sums plus the running partial), and the rest of the state follows from the count."""
    if residual == "standard":
        return StandardStream(sources[0])
    if residual == "attnres_full":
        stream = FullAttnResStream(sources[0], eps, mix)
        stream.outputs = list(sources)
        return stream
    if residual == "attnres_block":
        stream = BlockAttnResStream(sources[0], block_size, eps, mix)
        stream.filled = sublayers_done % block_size
        stream.blocks = list(sources[:-1]) if stream.filled else list(sources)
        stream.partial = sources[-1] if stream.filled else None
        return stream
    raise ValueError(f"unknown residual mode {residual!r}")
