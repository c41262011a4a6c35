"""A compiled step's regions as torch.compile cuts them, for the planner's traces (kimi.plan.activations).

`parallel.compile=true` compiles each sublayer and the AttnRes depth mix between them
(kimi.parallel.activation_checkpointing.apply_compile), with selective checkpointing inside each
sublayer's region. AOTAutograd traces each region's forward and
backward as one joint graph, and inductor's min-cut partitioner decides what the forward saves for the
backward: it recomputes cheap elementwise results in the backward where the eager step saves them, and
the casts to the compute dtype inside the graph. An eager trace over-counts such a step (up to 2x on this
CPU: docs/planning.md).

Here every region goes through the same AOTAutograd, the same decompositions and the same partitioner as
inductor's, and its two graphs run node by node under torch.fx's Interpreter on the trace's meta or fake
tensors, so the planner's dispatch mode sees what the partitioner saves and when the Interpreter frees
each value. Inductor's fusion inside a graph is followed by one rule (_fused): a pointwise value read by
one pointwise op is never written; one read by several is counted, which inductor may instead recompute
in each reader, so a region's transient is an upper bound (what it keeps is the partitioner's).

Tracing a region is the slow part (about a second for a sublayer), so the graphs are shared by every
region of the same structure (module type, scalar attributes, parameter shapes) and input signature: a
93-block model has a handful of sublayer kinds. A region AOTAutograd cannot trace whole (a graph break:
data-dependent control flow) runs eagerly, as its eager trace counts it.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable, Dict, Tuple

import torch
from torch.utils._pytree import tree_flatten

_GRAPHS: Dict[Tuple, Callable] = {}  # (region, input signature, autocast) -> AOTAutograd's function
_EAGER: set = set()  # regions that could not be traced whole


def _fused(node: torch.fx.Node) -> bool:
    """Whether inductor fuses `node` into its reader's kernel rather than write it: a pointwise op (or a
    view) read by one such op only (a graph output is read by the output node, never such an op)."""
    def folds(n):
        target = getattr(n, "target", None)
        tags = getattr(target, "tags", ())
        return n.op == "call_function" and (torch.Tag.pointwise in tags or torch.Tag.view_copy in tags
                                            or getattr(target, "is_view", False))

    return folds(node) and len(node.users) == 1 and all(folds(user) for user in node.users)


_FUSED = [False]  # inside a node inductor fuses away


def fused_away() -> bool:
    """Whether the op running now makes a value inductor's kernels never write (the planner's tracker,
    kimi.plan.activations._Live, does not count it)."""
    return _FUSED[0]


class _Interpreter(torch.fx.Interpreter):
    """Runs a graph node by node, values freed after their last use; a node inductor fuses runs with
    fused_away() true, as its value is never written."""

    def run_node(self, n):
        if not _fused(n):
            return super().run_node(n)
        before, _FUSED[0] = _FUSED[0], True
        try:
            return super().run_node(n)
        finally:
            _FUSED[0] = before


def _interpreted(gm: torch.fx.GraphModule, example_inputs) -> Callable:
    """A 'compiler' that runs the graph node by node (each op dispatched, values freed after last use)."""

    def run(args):
        return _Interpreter(gm).boxed_run(args)

    run._boxed_call = True
    return run


def _signature(args) -> Tuple:
    leaves, spec = tree_flatten(args)
    return str(spec), tuple((tuple(x.shape), x.dtype, x.requires_grad, x.device.type)
                            if isinstance(x, torch.Tensor) else x for x in leaves)


def _autocast() -> Tuple:
    return torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_grad_enabled()


def _scalar(v) -> bool:
    return isinstance(v, (int, float, str, bool, type(None))) or (
        dataclasses.is_dataclass(v) and not isinstance(v, type))


def _structure(module: torch.nn.Module) -> Tuple:
    """What makes two modules run the same graph: each submodule's type and plain attributes, and the
    parameters' and buffers' shapes."""
    parts = [(name, type(sub).__qualname__, tuple(sorted(
        (k, repr(v)) for k, v in vars(sub).items() if not k.startswith("_") and _scalar(v))))
        for name, sub in module.named_modules()]
    parts += [(n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in module.named_parameters()]
    parts += [(n, tuple(t.shape), t.dtype) for n, t in module.named_buffers()]
    return tuple(parts)


def _aot(fn: Callable, region) -> Callable:
    """fn (taking tensors and plain values) through AOTAutograd as inductor's compile would split it, one
    graph per input signature, shared by every `region` of the same key."""
    from functorch.compile import aot_function, min_cut_rematerialization_partition
    from torch._inductor.decomposition import select_decomp_table

    def run(*args):
        key = (region, _signature(args), _autocast())
        if key in _EAGER:
            return fn(*args)
        if key in _GRAPHS:
            return _GRAPHS[key](*args)
        graphs = aot_function(
            fn, fw_compiler=_interpreted, bw_compiler=_interpreted, decompositions=select_decomp_table(),
            partition_fn=functools.partial(min_cut_rematerialization_partition, compiler="inductor"))
        try:  # the first call traces (kimi.plan.activations runs it outside every count and checkpoint)
            out = graphs(*args)
        except Exception as e:  # noqa: BLE001 - where torch.compile breaks the graph: run it as eager does
            warnings.warn(f"plan: a compiled region traced eagerly, as AOTAutograd stopped at "
                          f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", stacklevel=2)
            _EAGER.add(key)
            return fn(*args)
        _GRAPHS[key] = graphs
        return out

    return run


def _selective(fn: Callable) -> Callable:
    """fn checkpointed under the selective policy as a compiled region runs it (apply_compile's
    `selective`): dynamo's checkpoint operator, traced by AOTAutograd, is torch.utils.checkpoint with these
    arguments (torch._higher_order_ops.wrap.tag_activation_checkpoint_impl), whose dispatch mode tags each
    op of the joint graph with the policy, and the partitioner saves what it tags MUST_SAVE."""
    import torch.fx.traceback as fx_traceback
    from torch.utils.checkpoint import checkpoint

    from kimi.parallel.activation_checkpointing import selective_contexts

    def contexts():
        forward, recompute = selective_contexts()
        forward.ac_graph_id = 1  # the region's one checkpoint
        return forward, recompute

    def run(*args):
        with fx_traceback.preserve_node_meta():
            return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False, context_fn=contexts,
                              early_stop=False)

    return run


def compile_regions(model: torch.nn.Module, selective: bool = False) -> None:
    """Give `model`'s sublayers and depth mix the traced compiled regions (as apply_compile gives them
    torch.compile's); selective: each sublayer's region checkpoints itself (apply_compile's `selective`)."""
    from kimi.model.attnres import backend_mix, mix_through
    from kimi.parallel.activation_checkpointing import sublayers

    for module in sublayers(model):
        def functional(state, args, kwargs, _module=module):
            with torch.nn.utils.stateless._reparametrize_module(_module, state):
                return _module._call_impl(*args, **kwargs)

        region = ("sublayer", _structure(module), selective)
        graphs = _aot(_selective(functional) if selective else functional, region)
        module._compiled_call_impl = functools.partial(_call, module, graphs)
    mix = mix_through(lambda fn: _aot(fn, (fn.__name__,)))
    model.depth_mix = backend_mix(model.cfg.attnres.backend, mix)


def _call(module: torch.nn.Module, graphs: Callable, *args, **kwargs):
    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return graphs(state, args, kwargs)
