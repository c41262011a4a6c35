"""Our optimizers inside DeepSpeed's ZeRO (parallel.engine=deepspeed), each matrix orthogonalised once.

DeepSpeed gives a client optimizer, on each rank, one flat fp32 tensor per param group: the rank's
partition of its master weights, with the partition's gradient as ``.grad``. Under ZeRO-1/2 that partition
is an equal share of all parameters concatenated (so a matrix may be cut mid-row, between two ranks);
under ZeRO-3 it is each parameter's own share, concatenated. Either way each parameter is, on a rank, one
contiguous range of its flattened elements, or nothing: a :class:`~kimi.optim.owners.Fragment`.

:class:`ZeroClient` is the optimizer handed to DeepSpeed. It has one param group (so DeepSpeed builds one
partition and calls ``step`` once per step, after accumulation, under every stage), and after
``deepspeed.initialize`` it is bound to DeepSpeed's optimizer: it finds every parameter's fragment and its
position in the partition, and builds the inner optimizer over views of those fragments:

- MuonClip (:class:`kimi.optim.MuonClip` with ``fragments``): each matrix's pieces go to one owner rank,
  which orthogonalises it once and returns every piece's update (kimi/optim/owners.py), and QK-Clip then
  scales the q/k rows of the fp32 masters;
- AdamW (torch's, with our weight-decay groups), state beside each fragment, then QK-Clip the same way.

DeepSpeed copies the updated masters into the model's weights after ``step``, so the clipped rows reach
them (and their bf16 copies) as every update does.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from kimi.optim import RoutedOptimizer, build_optimizer, build_qk_clip
from kimi.optim.config import OptimConfig
from kimi.optim.owners import Fragment

# (fragment, offset of its elements in this rank's flat partition) per parameter name
Layout = Dict[str, Tuple[Fragment, int]]


def zero_layout(zero_optimizer, names: Dict[int, str]) -> Tuple[torch.Tensor, Layout]:
    """This rank's flat fp32 partition in DeepSpeed's ZeRO optimizer (stage 1/2: DeepSpeedZeroOptimizer;
    stage 3: DeepSpeedZeroOptimizer_Stage3) whose client optimizer has a single param group, and where each
    parameter (named by ``names``, keyed by id) lies in it."""
    layout: Layout = {}
    if hasattr(zero_optimizer, "fp32_partitioned_groups_flat"):  # ZeRO-3
        if len(zero_optimizer.fp16_groups) != 1:
            raise RuntimeError(f"ZeRO-3 split the parameters into {len(zero_optimizer.fp16_groups)} "
                               "sub-groups; the client optimizer needs one (sub_group_size >= the number of "
                               "parameters)")
        rank = dist.get_rank(zero_optimizer.dp_process_group)
        offset = 0
        for p in zero_optimizer.fp16_groups[0]:
            part = p.partition_numel()
            start = rank * part
            numel = max(0, min(part, p.ds_numel - start))
            layout[names[id(p)]] = (Fragment(tuple(p.ds_shape), start, numel), offset)
            offset += part
        return zero_optimizer.fp32_partitioned_groups_flat[0], layout
    if len(zero_optimizer.bit16_groups) != 1:
        raise RuntimeError("the client optimizer must have one param group")
    for p in zero_optimizer.bit16_groups[0]:
        mapping = p._hp_mapping  # set by DeepSpeed for parameters with elements in this rank's partition
        if mapping is None:
            layout[names[id(p)]] = (Fragment(tuple(p.shape), 0, 0), 0)
        else:
            lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
            layout[names[id(p)]] = (Fragment(tuple(p.shape), lp.start, lp.numel), hp.start)
    return zero_optimizer.single_partition_of_fp32_groups[0], layout


# builds the inner optimizer over (name, fragment view) pairs; returns it and a hook run after its step
InnerFactory = Callable[[List[Tuple[str, torch.Tensor]], Dict[str, Fragment], Optional[dist.ProcessGroup]],
                        Tuple[torch.optim.Optimizer, Optional[Callable[[], object]]]]


class ZeroClient(torch.optim.Optimizer):
    """The optimizer DeepSpeed wraps: one param group over the model's trainable parameters; after
    ``bind``, each ``step`` runs the inner optimizer over this rank's fragments of the fp32 masters."""

    def __init__(self, model: torch.nn.Module, lr: float, make_inner: InnerFactory):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        super().__init__([{"params": [p for _, p in named]}], {"lr": lr})
        self._names = {id(p): n for n, p in named}
        self._make_inner = make_inner
        self.inner: Optional[torch.optim.Optimizer] = None
        self.qk_clip: Optional[Callable[[], object]] = None  # run after the inner optimizer's step
        self._layout: Layout = {}
        self._flat: Optional[torch.Tensor] = None
        self._views: List[Tuple[torch.Tensor, int]] = []
        self._group = None  # DeepSpeed's data-parallel group, from bind

    def bind(self, zero_optimizer) -> None:
        """Locate the fragments in DeepSpeed's partition and build the inner optimizer (collective)."""
        flat, self._layout = zero_layout(zero_optimizer, self._names)
        named = [(n, self._view(flat, frag, offset)) for n, (frag, offset) in self._layout.items()]
        self._flat, self._views = flat, [(v, self._layout[n][1]) for n, v in named]
        self.masters = dict(named)
        fragments = {n: frag for n, (frag, _) in self._layout.items()}
        group = self._group = zero_optimizer.dp_process_group
        self.inner, self.qk_clip = self._make_inner(named, fragments, group)
        self.gather = FragmentGather(self._layout, group)

    def _finite_everywhere(self, grad: torch.Tensor) -> bool:
        """Whether every rank's partition of the gradients is finite: one flag, min-reduced, so all ranks
        skip the update alike (the torch engine skips it on the global norm)."""
        ok = torch.isfinite(grad).all().to(torch.float32)
        if self._group is not None and dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=self._group)
        return bool(ok)

    def routing_table(self) -> Optional[str]:
        """The inner optimizer's routing (kimi.optim.RoutedOptimizer); None for one that routes nothing."""
        return self.inner.routing_table() if isinstance(self.inner, RoutedOptimizer) else None

    def _partition(self) -> torch.Tensor:
        params = self.param_groups[0]["params"]  # DeepSpeed's flat partition while it steps
        if len(params) != 1:
            raise RuntimeError("ZeroClient steps only inside DeepSpeed, which gives it its flat partition")
        return params[0]

    @staticmethod
    def _view(flat: torch.Tensor, frag: Fragment, offset: int) -> torch.Tensor:
        with torch.no_grad():
            return flat.narrow(0, offset, frag.numel)

    @torch.no_grad()
    def step(self, closure=None):
        if self.inner is None:
            raise RuntimeError("ZeroClient.bind(deepspeed optimizer) must run before the first step")
        flat = self._partition()
        if flat is not self._flat:  # the fragments view the partition found at bind
            raise RuntimeError("DeepSpeed stepped ZeroClient with another partition than the one it was "
                               "bound to")
        grad = flat.grad
        if grad is not None and not self._finite_everywhere(grad):
            return  # no update: the trainer stops on DeepSpeed's gradient norm, which is not finite either
        for view, offset in self._views:
            view.grad = None if grad is None else grad.narrow(0, offset, view.numel())
        for group in self.inner.param_groups:
            group["lr"] = self.param_groups[0]["lr"]
        self.inner.step()
        if self.qk_clip is not None:
            self.qk_clip()
        for view, _ in self._views:
            view.grad = None

    # ---- checkpoints: whole tensors by name, as the torch engine writes them ------------------------------
    @torch.no_grad()
    def _init_state(self) -> None:
        """Give the inner optimizer its state before a first step (as a zero-gradient step at lr 0), so a
        checkpoint's optimizer tensors have a place to load into. That step leaves zero moments but counts
        itself: the counters go back to 0, or the first real step would take Adam's bias corrections of a
        second one (an update sqrt(1 + b2) / (1 + b1) of the torch engine's)."""
        if self.inner.state:
            return
        lrs = [g["lr"] for g in self.inner.param_groups]
        for view, _ in self._views:
            view.grad = torch.zeros_like(view)
        for g in self.inner.param_groups:
            g["lr"] = 0.0
        self.inner.step()
        for g, lr in zip(self.inner.param_groups, lrs):
            g["lr"] = lr
        for view, _ in self._views:
            view.grad = None
        for st in self.inner.state.values():
            if "step" in st:
                st["step"] = torch.zeros_like(st["step"]) if torch.is_tensor(st["step"]) else 0

    def _names_in_state_dict(self) -> List[str]:
        """The names of the inner optimizer's parameters in the order its state_dict numbers them."""
        by_view = {id(v): n for n, v in self.masters.items()}
        return [by_view[id(p)] for g in self.inner.param_groups for p in g["params"]]

    def full_masters(self) -> Dict[str, torch.Tensor]:
        """{name: whole fp32 master weight}; the optimizer state untouched. Collective."""
        return self.gather.full(self.masters)

    @torch.no_grad()
    def full_state(self) -> Tuple[Dict[str, torch.Tensor], dict]:
        """({name: whole fp32 master weight}, the optimizer state in torch's format keyed by parameter name,
        each state tensor whole). Collective."""
        self._init_state()
        sd = self.inner.state_dict()
        names = self._names_in_state_dict()
        state = {names[i]: dict(st) for i, st in sd["state"].items()}
        for key in sorted({k for st in state.values() for k in st if k != "step"}):
            whole = self.gather.full({n: st[key] for n, st in state.items() if key in st})
            for n, tensor in whole.items():
                state[n][key] = tensor
        # the schedule's entries (lr, initial_lr) are the client's, which DeepSpeed and the scheduler step:
        # the groups then carry the keys the torch engine's do, and a checkpoint loads into either engine
        schedule = {k: v for k, v in self.param_groups[0].items() if k in ("lr", "initial_lr")}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, **schedule,
                   "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
        return self.full_masters(), {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_full_state(self, masters: Dict[str, torch.Tensor], optim: Optional[dict]) -> None:
        """Set the fp32 masters (and, with ``optim``, the optimizer state) from whole tensors by name; this
        run's hyper-parameters stay. Collective."""
        for name, view in self.masters.items():
            view.copy_(self.gather.fragment(name, masters[name]))
        if optim is None:
            return
        self._init_state()
        sd = self.inner.state_dict()
        names = self._names_in_state_dict()
        for i, st in sd["state"].items():
            saved = optim["state"][names[i]]
            for key in st:
                st[key] = saved[key] if key == "step" else self.gather.fragment(names[i], saved[key]).clone()
        self.inner.load_state_dict(sd)


def inner_factory(cfg: OptimConfig, model: torch.nn.Module) -> InnerFactory:
    """The optimizer ``optim.name`` asks for over the fragments, and QK-Clip after it (None when off).
    Call it before ``deepspeed.initialize``."""
    # read now: ZeRO-3 leaves the model's weights empty, and the specs count heads from their shapes
    specs = model.qk_clip_specs() if hasattr(model, "qk_clip_specs") else []

    def make(named, fragments, group):
        return (build_optimizer(model, cfg, group, named, fragments),
                build_qk_clip(model, cfg, group, named=named, fragments=fragments, specs=specs))

    return make


class FragmentGather:
    """Whole tensors from every rank's fragments, and fragments back: checkpoints hold each parameter (and
    its optimizer state) whole under its name, as the torch engine's do, so a run moves between engines.
    Every rank ends with the whole tensors (memory of one fp32 model while a checkpoint is written)."""

    def __init__(self, layout: Layout, group: Optional[dist.ProcessGroup]):
        self.layout, self.group = layout, group
        mine = [(name, frag.start, frag.numel) for name, (frag, _) in layout.items()]
        self.everyone = [mine]
        if group is not None and dist.get_world_size(group) > 1:
            self.everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(self.everyone, mine, group=group)

    @torch.no_grad()
    def full(self, blocks: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """{name: whole tensor} from {name: this rank's fragment}, one all_gather for all of them (the
        names, in the layout's order, are the same on every rank; one dtype)."""
        names = [n for n in self.layout if n in blocks]
        local = torch.cat([blocks[n].reshape(-1) for n in names]) if names else torch.empty(0)
        sizes = [sum(numel for n, _, numel in theirs if n in blocks) for theirs in self.everyone]
        padded = torch.zeros(max(sizes), dtype=local.dtype, device=local.device)
        padded[: local.numel()] = local
        gathered = [padded]
        if len(self.everyone) > 1:
            gathered = [torch.empty_like(padded) for _ in self.everyone]
            dist.all_gather(gathered, padded, group=self.group)
        out = {n: torch.empty(self.layout[n][0].shape, dtype=local.dtype, device=local.device) for n in names}
        for theirs, flat in zip(self.everyone, gathered):
            offset = 0
            for n, start, numel in theirs:
                if n in blocks:
                    out[n].view(-1)[start : start + numel] = flat[offset : offset + numel]
                    offset += numel
        return out

    def fragment(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's fragment of a whole tensor (a view)."""
        frag = self.layout[name][0]
        return full.reshape(-1)[frag.start : frag.start + frag.numel]
