"""Activation checkpointing and torch.compile for the sublayers (each token mixer and each MLP).

Both act on sublayers rather than blocks because a block passes the AttnRes stream object, which it mutates:
recomputing a block in the backward would replay it on a stream that later blocks have already extended.
A sublayer, with its depth mix and pre-norm (Block.sublayer), is a function of the stream's sources and
the sublayer's query that returns one tensor: checkpointing keeps only those inputs, which the stream holds
anyway, and recomputes the mix, the norm and the module. The final mix and norm are checkpointed alike.
Checkpointing goes through the block's explicit sublayer runner (``Block.set_runner``) and compiling through
torch's ``Module.compile``: no forward is replaced and no module wrapped, so parameter names do not change
(optimizer routing, QK-Clip specs and checkpoints see the same names with and without these). The
recomputation calls the module itself, compiled if it is, so it replays exactly what the forward ran.

  full       recompute every sublayer's activations in the backward (only its input is kept)
  selective  keep the outputs of matmuls, attention (SDPA's and our Triton kernel's) and the Triton KDA
             chunk forward, recompute the cheap rest (norms, activations, gates, elementwise products):
             most of the memory saving for a fraction of the recompute

Selective checkpointing under torch.compile: a compiled region runs as one autograd function, so a policy
applied from outside sees none of its matmuls and recomputes the whole region, as full does (measured on
this CPU: the same peak, and every forward matmul run again in the backward). So there the checkpoint goes
inside each sublayer's compiled region, where dynamo tags every op with the policy and the partitioner
keeps what it saves; the sublayer's runner then checkpoints its depth mix and pre-norm only, whose output
(the module's input) the region keeps.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Iterator

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kimi.ops.dynamo_settings import dynamo_settings
from kimi.parallel.config import AC_MODES as MODES

from .cuda_graphs import compile_mode

_SAVED_OPS = {getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(torch.ops.aten, name)}
# Sequence parallelism's gathers run inside the checkpointed call: keep their results rather than
# communicate again in the backward.
_SAVED_OPS |= {getattr(torch.ops._c10d_functional, name).default for name in (
    "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "wait_tensor")}


# Our Triton custom ops of the same class, by name: they are registered only once triton is imported, and
# importing it here would fix its mode (compiled or interpreted) before a test could choose.
_SAVED_CUSTOM = ("kimi::flash_attention", "kimi::kda_chunk_fwd")


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    saved = op in _SAVED_OPS or (op.namespace == "kimi" and op.name() in _SAVED_CUSTOM)
    return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE


SUBLAYERS = ("mixer", "mlp")


def sublayers(model: nn.Module) -> Iterator[nn.Module]:
    for block in model.blocks.children():
        for name in SUBLAYERS:
            yield getattr(block, name)


def selective_contexts():
    """Selective checkpointing's pair of dispatch modes (torch.utils.checkpoint's context_fn)."""
    return create_selective_checkpoint_contexts(_keep_matmuls)


def _checkpointed(selective: bool) -> Callable:
    extra = {"context_fn": selective_contexts} if selective else {}

    def run(function: Callable, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation and decoding: nothing to recompute
            return function(*args, **kwargs)
        return checkpoint(function, *args, use_reentrant=False, **extra, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str, compiled: bool = False) -> None:
    """compiled: apply_compile follows (parallel.compile); selective checkpointing then goes into the
    sublayers' compiled regions (apply_compile's `selective`), and the runners here checkpoint the depth
    mixes and pre-norms in full (see the module's docstring)."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: choose one of {'|'.join(MODES)}")
    if mode == "none":
        return
    inside = mode == "selective" and compiled
    run = _checkpointed(selective=mode == "selective" and not inside)
    for block in model.blocks.children():
        for name in SUBLAYERS:
            block.set_runner(name, run, module_apart=inside)
    if model.lm_head is not None:  # the final depth mix and norm: the mix's fp32 stacks are not kept either
        model.set_runner("final", run)


def apply_compile(model: nn.Module, cuda_graphs: str = "none", selective: bool = False) -> None:
    """torch.compile each sublayer (Module.compile: names and state dicts are unchanged) and the Attention
    Residuals' depth mix, which runs between them (model.attnres.backend torch, and auto on CPU: a fused
    kernel is one op already); with parallel.cuda_graphs=regions, each of them replays as a CUDA graph.
    selective: each sublayer's region checkpoints itself under the selective policy (apply it with
    apply_activation_checkpointing(model, "selective", compiled=True))."""
    from kimi.model.attnres import depth_mix

    mode = compile_mode(cuda_graphs)
    for module in sublayers(model):
        if selective:  # what Module.compile does, the module's call checkpointed inside the region
            module._compiled_call_impl = _compiled_selective(module._call_impl, mode)
        else:
            module.compile(mode=mode)
    model.depth_mix = depth_mix(model.cfg.attnres.backend, compiled=True, mode=mode)


class _InPlaceChecked(logging.Filter):
    """Drops dynamo's warning that a context_fn under torch.compile must not meet in-place ops (once per
    process): ours meets only in-place ops into buffers the region itself allocates (the experts' index_add_
    and scatter_add_ into fresh zeros), which a recompute makes anew, and the selective regions' gradients
    equal eager's with and without experts (tests/parallel/test_parallel.py, selective under compile)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint under torch.compile" not in record.getMessage()


_IN_PLACE_CHECKED = _InPlaceChecked()
DYNAMO_WRAP_LOG = "torch._higher_order_ops.wrap"  # the logger that warns


def _compiled_selective(call: Callable, mode: str | None) -> Callable:
    """call(*args, **kwargs) checkpointed under the selective policy inside one compiled region."""
    logging.getLogger(DYNAMO_WRAP_LOG).addFilter(_IN_PLACE_CHECKED)  # filters are a set: added once
    compiled = torch.compile(functools.partial(_checkpointed(selective=True), call), mode=mode)

    def run(*args, **kwargs):
        # The forward records the max logits QK-Clip reads (kimi.model.maxlogits), a side effect that dynamo
        # refuses inside a checkpoint unless told the backward's recompute need not repeat it: it need not,
        # as a recompute records the same values again, which the max ignores. Refused, the region would
        # run eagerly (graph break), keeping the eager policy's tensors.
        with dynamo_settings(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
            return compiled(*args, **kwargs)

    return run
