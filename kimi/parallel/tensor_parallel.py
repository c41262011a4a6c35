"""Tensor parallelism: DTensor plans that split every layer by heads (Megatron's column/row scheme).

Each layer runs its unchanged single-device code on local tensors: a column-parallel projection hands the
layer this rank's heads, the layer reads the head count from the shape, and a row-parallel output projection
sums the ranks' contributions (one all-reduce per sublayer in the forward, one in the backward).

Every token mixer and MLP declares its plan by parameter name (``tp_plan()``, kimi/model/sublayer.py: which
linears are column- or row-parallel, which parameters are split by heads or sum their gradient over the
ranks, or that it stays whole); this module applies any such plan. The model's ends are planned here:

  embedding   vocab-parallel (rows of the table), output replicated
  LM head     column-parallel over the vocabulary; logits stay sharded for a loss-parallel cross-entropy
              (also inside a pipeline schedule, which the trainer runs under loss_parallel())
Norms and AttnRes queries act per token on replicated activations and stay plain (replicated) tensors.

Parameters that a layer uses directly rather than through an nn.Linear (A_log, dt_bias, conv kernels) are
stored as Shard(0) DTensors, so the optimizer and checkpoints see their full shape, and the layer reads
their local shards through an explicit view (kimi.model.views: ``param(name)``; ``to_local`` keeps the
gradient path to the DTensor). Replicated weights applied to local heads or tokens read through a view
whose backward sums the gradient over the ranks.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, parallelize_module)

from kimi.model.sublayer import TPPlan


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


def _by_heads(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """Store each named parameter as a Shard(0) DTensor (the optimizer and checkpoints see its full shape)
    and have its layer compute with this rank's block (to_local keeps the gradient path to the DTensor)."""
    for name in names:
        owner, attr = _owner(module, name)
        param = getattr(owner, attr)
        owner.register_parameter(attr, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]),
                                                    requires_grad=param.requires_grad))
        owner.set_param_view(attr, lambda p: p.to_local())


def _sum_grads(module: nn.Module, names: list[str], mesh: DeviceMesh) -> None:
    """Each named parameter (replicated, applied by every rank to its own heads or tokens only) sums its
    gradient over the tensor-parallel ranks; names the module does not hold are skipped (the first block
    has no mixer query, a pipeline stage may lack the final norm and query)."""
    for name in names:
        try:
            owner, attr = _owner(module, name)
        except AttributeError:  # the owning module is absent (None) in this part
            continue
        if getattr(owner, attr, None) is not None:
            owner.set_param_view(attr, lambda p: _SumGradOverRanks.apply(p, mesh))


def _apply_plan(sublayer: nn.Module, plan: TPPlan, mesh: DeviceMesh, row: RowwiseParallel) -> None:
    """A sublayer's declared plan. A replicated sublayer computes alike on every rank; under sequence
    parallelism each rank keeps its share of the output's tokens (a slice of a replicated tensor, where a
    row-parallel layer reduce-scatters)."""
    if plan.replicate:
        out = row.output_layouts[0]
        if out != Replicate():
            parallelize_module(sublayer, mesh, PrepareModuleOutput(
                output_layouts=(Replicate(),), desired_output_layouts=(out,), use_local_output=True))
        return
    styles = {**{name: ColwiseParallel() for name in plan.colwise}, **{name: row for name in plan.rowwise}}
    parallelize_module(sublayer, mesh, styles)
    _by_heads(sublayer, list(plan.by_heads), mesh)
    _sum_grads(sublayer, list(plan.sum_grads), mesh)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence_parallel: bool = False,
                          loss_parallel: bool = False) -> nn.Module:
    """loss_parallel: the LM head returns logits sharded over the vocabulary (a DTensor), for a cross-entropy
    computed under torch's loss_parallel() without gathering them.

    sequence_parallel: between sublayers every activation (the AttnRes stream, norms, depth mixing, all per
    token) holds only this rank's share of the sequence; a sublayer all-gathers the sequence on entry and
    its row-parallel output reduce-scatters it back (the bytes of the one all-reduce it replaces, and
    activation memory divided by tp). The norms' weights and AttnRes queries, applied to a share of the
    tokens, sum their gradients over tp.

    Each sublayer applies the plan it declares (``tp_plan()``)."""
    seq = Shard(1)
    ends = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq if sequence_parallel
                                     else Replicate()),
            "lm_head": ColwiseParallel(input_layouts=seq if sequence_parallel else Replicate(),
                                       output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                       use_local_output=not loss_parallel)}
    # a pipeline stage may hold neither
    parallelize_module(model, mesh, {k: v for k, v in ends.items() if getattr(model, k, None) is not None})
    if model.lm_head is not None:
        model.lm_head.vocab_parallel = True
    if model.cfg.tie_embeddings and model.embed is not None and model.lm_head is not None:
        # each plan made its own sharded copy; both shard the vocabulary rows alike, so tie them again
        model.lm_head.weight = model.embed.weight
    row = RowwiseParallel(output_layouts=seq if sequence_parallel else Replicate())
    for block in model.blocks.values():
        for sublayer in (block.mixer, block.mlp):
            if sequence_parallel:  # the sublayer sees the whole sequence (its layers read T from their input)
                parallelize_module(sublayer, mesh, PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True))
            _apply_plan(sublayer, sublayer.tp_plan(), mesh, row)
        if sequence_parallel:
            _sum_grads(block, ["mixer_norm.weight", "mlp_norm.weight", "mixer_query", "mlp_query",
                               "mixer_key_weight",
                               "mlp_key_weight"], mesh)
    if sequence_parallel:  # the final norm and query, applied to this rank's tokens
        _sum_grads(model, ["norm.weight", "final_query", "final_key_weight"], mesh)
    return model


def squared_norm(tensors, pp_group=None, device=None) -> torch.Tensor:
    """The squared L2 norm of `tensors` taken together, a mix of plain tensors (whole, or replicated over the
    stage's ranks) and DTensors on different meshes (which torch.nn.utils.clip_grad_norm_ cannot stack),
    summed over the pipeline stages in `pp_group`; the same fp32 value on every rank.

    Squared norms are summed locally per (mesh, sharded mesh dims) and reduced once per such group, not once
    per tensor: a sharded tensor's pieces are disjoint, so its square is the sum of the local ones over
    the dims that shard it (replicated dims hold copies and are not summed). Each group's local pieces are
    normed by one foreach call on plain tensors: DTensor's sharding propagation of a foreach op over a list
    costs milliseconds per tensor the first time it sees the list (seconds for a model's gradients)."""
    tensors = list(tensors)
    device = device if device is not None else tensors[0].device if tensors else "cpu"
    groups: dict = {(None, ()): []}  # (mesh, sharded dims) -> local pieces; plain tensors: no mesh
    partial = []
    for g in tensors:
        if not isinstance(g, DTensor):
            groups[None, ()].append(g)
        elif any(pl.is_partial() for pl in g.placements):  # not seen from our plans: let DTensor reduce it
            partial.append(torch.linalg.vector_norm(g, dtype=torch.float32).full_tensor() ** 2)
        else:
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            groups.setdefault((g.device_mesh, dims), []).append(g.to_local())
    total = torch.zeros((), dtype=torch.float32, device=device)
    for (mesh, dims), pieces in groups.items():
        square = _sum_of_squares(pieces, device)
        for dim in dims:
            square = funcol.all_reduce(square, "sum", group=(mesh, dim)).wait()
        total = total + square
    for square in partial:
        total = total + square
    if pp_group is not None:
        total = funcol.all_reduce(total, "sum", group=pp_group).wait()
    return total


def _sum_of_squares(tensors, device) -> torch.Tensor:
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.stack(norms).square().sum()


@torch.no_grad()
def clip_grad_norm_(parameters, max_norm: float, pp_group=None, uncounted=None) -> torch.Tensor:
    """Global gradient-norm clipping for a mix of plain tensors and DTensors on different meshes, summed over
    the pipeline stages in `pp_group` (see :func:`squared_norm`); returns the total norm before clipping.
    `uncounted`: a parameter whose gradient another stage already counts (the last stage's copy of tied
    embeddings); it is clipped but not counted. The gradients are scaled in place through their local pieces
    by one foreach call (the scale is a number: no sharding to propagate)."""
    params = [p for p in parameters if p.grad is not None]
    grads = [p.grad for p in params]
    device = grads[0].device if grads else "cpu"
    total = squared_norm([p.grad for p in params if p is not uncounted], pp_group, device).sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if local:
        torch._foreach_mul_(local, coef.to(device))
    return total
