"""Data parallelism with FSDP2: each token mixer and each MLP is one ``fully_shard`` unit, then the root
(embedding, norms, AttnRes queries, LM head). Parameters become DTensors placed on the (dp_replicate,
dp_shard) mesh: sharded over dp_shard (ZeRO-3; ``reshard_after_forward=False`` keeps them gathered until
the backward, ZeRO-2-like), replicated over dp_replicate (HSDP). Gradients are averaged over all
data-parallel ranks, so a step on N ranks with N micro-batches equals one process on their concatenation.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from kimi.model.moe import RoutedExperts


def apply_data_parallel(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool = True,
                        bf16: bool = False, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """bf16: compute with bf16 copies of the fp32 weights, reduce gradients in fp32 (the weights and the
    optimizer state stay fp32). expert_mesh (expert parallelism, kimi.parallel.dims): the routed experts
    are their own unit over its (dp_replicate, edp) ranks."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kw = {"mp_policy": policy} if policy else {}
    # their gradients are averaged over (dp_replicate, edp) only: see expert_parallel
    if expert_mesh is not None:
        for experts in (m for m in model.modules() if isinstance(m, RoutedExperts)):
            fully_shard(experts, mesh=expert_mesh["dp_replicate", "edp"],
                        reshard_after_forward=reshard_after_forward, **kw)
    # Units are the sublayers, not the blocks: a block takes and returns the AttnRes stream object, and FSDP2
    # finds the tensors whose backward must re-gather a unit's weights only in a unit's tensor outputs. The
    # norms and queries a block applies around its sublayers are tiny and stay with the root.
    for block in model.blocks.children():
        for sublayer in (block.mixer, block.mlp):
            fully_shard(sublayer, mesh=mesh, reshard_after_forward=reshard_after_forward, **kw)
    # The root keeps its parameters gathered after the forward: the backward needs the LM head first.
    fully_shard(model, mesh=mesh, reshard_after_forward=False, **kw)
    return model
