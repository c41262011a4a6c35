"""Activation checkpointing and torch.compile for the sublayers (each token mixer and each MLP).

Both act on sublayers rather than blocks because a block passes the AttnRes stream object, which it mutates:
recomputing a block in the backward would replay it on a stream that later blocks have already extended.
A sublayer takes and returns tensors. Checkpointing is applied through the sublayer's forward hooks and
compile through nn.Module.compile, so neither replaces a forward nor renames a parameter (optimizer routing,
QK-Clip specs and checkpoints see the same names with and without these).

  full       recompute every sublayer's activations in the backward (only its input is kept)
  selective  keep the outputs of matmuls and attention, recompute the cheap rest (norms, activations,
             gates, elementwise products): most of the memory saving for a fraction of the recompute
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Iterator

import torch
from torch import nn
from torch.utils.checkpoint import (_DEFAULT_DETERMINISM_MODE, CheckpointPolicy, _checkpoint_without_reentrant_generator,
                                    create_selective_checkpoint_contexts)

from kimi.config import AC_MODES as MODES

_SAVED_OPS = {getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu") if hasattr(torch.ops.aten, name)}


def _keep_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def sublayers(model: nn.Module) -> Iterator[nn.Module]:
    for block in model.blocks.children():
        yield block.mixer
        yield block.mlp


def _checkpoint_with_hooks(module: nn.Module, selective: bool) -> None:
    """Checkpoint `module`'s forward from a forward pre-hook to a forward hook (non-reentrant), recomputing
    with ``module.forward``. The pre-hook runs after the module's other pre-hooks (FSDP's unshard and
    sequence parallelism's gather), so what it saves are their results and the recomputation repeats none
    of them; evaluation and decoding (no grad) are not checkpointed."""
    def contexts():
        if selective:
            return create_selective_checkpoint_contexts(_keep_matmuls)
        return nullcontext(), nullcontext()

    running: list = []

    def enter(mod, args, kwargs):
        if torch.is_grad_enabled():
            region = _checkpoint_without_reentrant_generator(mod.forward, True, contexts, _DEFAULT_DETERMINISM_MODE,
                                                             False, True, *args, **kwargs)
            next(region)
            running.append(region)

    def leave(mod, args, output):
        if running:
            next(running.pop(), None)  # the generator's second half: it ends the region

    module.register_forward_pre_hook(enter, with_kwargs=True)
    module.register_forward_hook(leave, prepend=True, always_call=True)


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"activation checkpointing {mode!r}: choose one of {'|'.join(MODES)}")
    if mode == "none":
        return
    for module in sublayers(model):
        _checkpoint_with_hooks(module, selective=mode == "selective")


def apply_compile(model: nn.Module) -> None:
    """torch.compile each sublayer (in place: names and state dicts are unchanged)."""
    for module in sublayers(model):
        module.compile()
