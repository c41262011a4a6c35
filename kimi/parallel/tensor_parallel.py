"""Tensor parallelism: DTensor plans that split every layer by heads (Megatron's column/row scheme).

Each layer runs its unchanged single-device code on local tensors: a column-parallel projection hands the
layer this rank's heads, the layer reads the head count from the shape, and a row-parallel output projection
sums the ranks' contributions (one all-reduce per sublayer in the forward, one in the backward).

  embedding   vocab-parallel (rows of the table), output replicated
  KDA         q/k/v, gate and beta up-projections column-parallel; short-conv channels, A_log and dt_bias
              per head; the low-rank down-projections replicated; the output norm's weight, shared by all
              heads, replicated with its gradient summed over the ranks' heads; o_proj row-parallel
  MLA         query projection and W_ukv column-parallel (by heads); W_dkv, its norm and q-LoRA's
              down-projection replicated; wo row-parallel; each rank records the max logits of its own
              heads (QK-Clip places them by tp rank)
  MLP         gate and up column-parallel, down row-parallel
  LM head     column-parallel over the vocabulary; logits stay sharded for a loss-parallel cross-entropy
              (also inside a pipeline schedule, which the trainer runs under loss_parallel())
Norms and AttnRes queries act per token on replicated activations and stay plain (replicated) tensors.

Parameters that a layer uses directly rather than through an nn.Linear (A_log, dt_bias, conv kernels) are
stored as Shard(0) DTensors, so the optimizer and checkpoints see their full shape, and are swapped for
their local shards while the layer runs (``to_local`` keeps the gradient path to the DTensor).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Dict, Iterator

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               parallelize_module)


class _SumGradOverRanks(torch.autograd.Function):
    """Identity forward; the backward sums the gradient over the tensor-parallel ranks. For a replicated
    weight that each rank applies to its own heads (or its share of the tokens) only, so each rank's
    gradient is a partial sum."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        ctx.mesh = mesh
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return funcol.all_reduce(grad.contiguous(), "sum", group=ctx.mesh), None


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, attr = name.rpartition(".")
    return (module.get_submodule(owner_name) if owner_name else module), attr


def _present(module: nn.Module, names) -> list[str]:
    """Those of the (dotted) parameter names `module` holds: the first block has no mixer query, and a
    pipeline stage may lack the final norm and query."""
    present = []
    for name in names:
        owner = module
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part, None)
        if owner is not None and owner._parameters.get(attr) is not None:
            present.append(name)
    return present


@contextlib.contextmanager
def _swapped(module: nn.Module, views: Dict[str, callable]) -> Iterator[None]:
    """Within the block, module.<name> (dotted) reads views[name](the parameter) instead."""
    saved: Dict[tuple, nn.Parameter] = {}
    try:
        for name, view in views.items():
            owner, attr = _owner(module, name)
            saved[(owner, attr)] = owner._parameters[attr]
            owner._parameters[attr] = view(saved[(owner, attr)])
        yield
    finally:
        for (owner, attr), param in saved.items():
            owner._parameters[attr] = param


def _local_views(module: nn.Module, mesh: DeviceMesh, sharded: list[str], head_shared: list[str]) -> None:
    """Store the `sharded` parameters as Shard(0) DTensors and run module's forward on their local shards;
    sum the gradients of the `head_shared` (replicated, applied to local heads only) over the ranks."""
    for name in sharded:
        owner, attr = _owner(module, name)
        param = owner._parameters[attr]
        owner._parameters[attr] = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]),
                                               requires_grad=param.requires_grad)
    views = {name: lambda p: p.to_local() for name in sharded}
    views.update({name: lambda p: _SumGradOverRanks.apply(p, mesh) for name in head_shared})
    forward = module.forward

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with _swapped(module, views):
            return forward(*args, **kwargs)

    module.forward = run


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False,
                          loss_parallel: bool = False) -> nn.Module:
    """loss_parallel: the LM head returns logits sharded over the vocabulary (a DTensor), for a cross-entropy
    computed under torch's loss_parallel() without gathering them.

    sequence_parallel: between sublayers every activation (the AttnRes stream, norms, depth mixing, all per
    token) holds only this rank's share of the sequence; a sublayer all-gathers the sequence on entry and
    its row-parallel output reduce-scatters it back (the bytes of the one all-reduce it replaces, and
    activation memory divided by tp). The norms' weights and AttnRes queries, applied to a share of the
    tokens, sum their gradients over tp."""
    from kimi.model.kda import KDA
    from kimi.model.mla import MLA

    seq = Shard(1)
    ends = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence_parallel
                                     else Replicate()),
            "lm_head": ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                       output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel)}
    # a pipeline stage may hold neither
    parallelize_module(model, mesh, {k: v for k, v in ends.items() if getattr(model, k, None) is not None})
    if model.cfg.tie_embeddings and model.embed is not None and model.lm_head is not None:
        # each plan made its own sharded copy; both shard the vocabulary rows alike, so tie them again
        model.lm_head.weight = model.embed.weight
    col, row = ColwiseParallel(), RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
    for block in model.blocks.children():
        if sequence_parallel:  # each sublayer sees the whole sequence (its layers read T from their input)
            gather = PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),),
                                        use_local_output=True)
            for sublayer in (block.mixer, block.mlp):
                parallelize_module(sublayer, mesh, gather)
        parallelize_module(block.mlp, mesh, {"w_gate": col, "w_up": col, "w_down": row})
        mixer = block.mixer
        if isinstance(mixer, KDA):
            parallelize_module(mixer, mesh, {"q_proj": col, "k_proj": col, "v_proj": col, "f_proj_up": col,
                                             "b_proj": col, "g_proj_up": col, "o_proj": row})
            _local_views(mixer, mesh, ["A_log", "dt_bias", "q_conv.weight", "k_conv.weight", "v_conv.weight"],
                         head_shared=["o_norm.weight"])
        elif isinstance(mixer, MLA):
            q_proj = "wq_b" if mixer.q_lora else "wq"
            parallelize_module(mixer, mesh, {q_proj: col, "wkv_b": col, "wo": row})
        else:
            raise TypeError(f"no tensor-parallel plan for token mixer {type(mixer).__name__}")
        if sequence_parallel:
            _local_views(block, mesh, [], head_shared=_present(block, ("mixer_norm.weight", "mlp_norm.weight",
                                                                       "mixer_query", "mlp_query")))
    if sequence_parallel:
        sum_final_grads(model, mesh)
    return model


def sum_final_grads(module: nn.Module, mesh: DeviceMesh) -> None:
    """Under sequence parallelism: the final norm's weight and AttnRes query see this rank's tokens only, so
    their gradients are summed over tp. `module` is the model or the pipeline stage that runs them (the
    stage calls them itself, not through the model's forward)."""
    _local_views(module, mesh, [], head_shared=_present(module, ("norm.weight", "final_query")))


def clip_grad_norm_(parameters, max_norm: float, pp_group=None, uncounted=None) -> torch.Tensor:
    """Global gradient-norm clipping for a mix of plain tensors and DTensors on different meshes (which
    torch.nn.utils.clip_grad_norm_ cannot stack), summed over the pipeline stages in `pp_group`; returns
    the total norm before clipping. `uncounted`: a parameter whose gradient another stage already counts
    (the last stage's copy of tied embeddings); it is clipped but not counted."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    squares = [torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else "cpu")]
    for p, g in zip(params, grads):
        if p is uncounted:
            continue
        norm = torch.linalg.vector_norm(g, dtype=torch.float32)
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    total = torch.stack(squares).sum()
    if pp_group is not None:
        total = funcol.all_reduce(total, "sum", group=pp_group).wait()
    total = total.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.device))
    return total
