"""torchrun worker for tests/optim/test_muonclip_dist.py: MuonClip on the problem of tests/muonclip_problem.py
with its weights laid out in several ways; rank 0 writes the full weights and per-step counters of each case,
and, for the layouts the torch engine makes (plain replicas and DTensors), what the trainer's global-norm clip
over the ranks (kimi.parallel.tensor_parallel.clip_grad_norm_) returns and leaves in each step's gradients.

    torchrun --nproc_per_node N tests/dist_muonclip.py OUT_DIR CASE [CASE ...]
"""

from __future__ import annotations

import gc
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from kimi.optim.owners import Fragment  # noqa: E402
from kimi.parallel.tensor_parallel import clip_grad_norm_  # noqa: E402
from kimi.parallel.zero_client import FragmentGather  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from muonclip_problem import (SHAPES, extra_shapes, gradients, initial_weights,  # noqa: E402
                              make_optimizer, max_logits)

S0, S1, R = Shard(0), Shard(1), Replicate()
# case -> (mesh shape, placements of each weight by name, with "*" the default); None mesh: plain replicas
LAYOUTS = {
    "replicated": (None, {}),
    "fsdp": ((2,), {"*": (S0,)}),
    "fsdp_more": ((2,), {"*": (S0,)}),
    "tp": ((2,), {"*": (S0,), "tall": (S1,), "wide": (S1,), "sq2": (S1,), "experts": (S1,), "norm": (R,),
                  "bias": (R,)}),
    "fsdp4": ((4,), {"*": (S0,)}),
    # dp x tp: FSDP over TP column shards (FSDP2 places a colwise weight as _StridedShard over Shard(0)),
    # TP row shards under FSDP, an HSDP-like weight replicated over dp, and norms replicated over tp
    "dp2tp2": ((2, 2), {"*": (_StridedShard(0, split_factor=2), S0), "tall": (S0, S1), "wide": (S0, S1),
                        "sq2": (R, S0), "experts": (S0, S1), "norm": (S0, R), "bias": (R, R)}),
    # expert parallelism over a mesh (edp, ep): the experts split by expert over ep, then FSDP-sharded over
    # edp (FSDP2's _StridedShard over the ep shard), everything else FSDP-sharded over all four ranks
    "ep2fsdp2": ((2, 2), {"*": (S0, S0), "experts": (_StridedShard(0, split_factor=2), S0)}),
}
# DeepSpeed's ZeRO partitions (kimi/parallel/zero_client.py): flat fragments, not blocks. zero12: an equal
# share of all weights concatenated, so weights are cut mid-row between ranks; zero3: an equal share of each
# weight.
ZERO = ("zero12", "zero3")  # "_more" cases: the same with more matrices


def zero_fragments(case: str, shapes: dict, rank: int, world: int) -> dict[str, Fragment]:
    numels = {n: math.prod(s) for n, s in shapes.items()}
    frags, offset = {}, 0
    part = -(-sum(numels.values()) // world)
    for n, numel in numels.items():
        if case.startswith("zero3"):
            each = -(-numel // world)
            start = rank * each
            frags[n] = Fragment(tuple(shapes[n]), start, max(0, min(each, numel - start)))
        else:
            lo, hi = max(offset, rank * part), min(offset + numel, (rank + 1) * part)
            frags[n] = Fragment(tuple(shapes[n]), max(lo - offset, 0), max(0, hi - lo))
        offset += numel
    return frags


def distribute(full: torch.Tensor, mesh, placements) -> torch.Tensor:
    """A DTensor holding this rank's block of ``full`` (any placements, uneven sizes included)."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    block = full[tuple(slice(o, o + s) for o, s in zip(offset, shape))].clone()
    return DTensor.from_local(block, mesh, placements, run_check=False, shape=full.shape,
                              stride=full.stride())


class Weights(torch.nn.Module):
    def __init__(self, case: str, shapes: dict):
        super().__init__()
        mesh_shape, layout = LAYOUTS.get(case, (None, {}))
        self.mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
        self.placements = {n: layout.get(n, layout.get("*")) for n in shapes}
        self.fragments = (zero_fragments(case, shapes, dist.get_rank(), dist.get_world_size())
                          if case.startswith(ZERO) else None)
        for n, w in initial_weights(shapes).items():
            self.register_parameter(n, torch.nn.Parameter(self.lay_out(n, w)))

    def lay_out(self, name: str, full: torch.Tensor) -> torch.Tensor:
        if self.fragments is not None:
            frag = self.fragments[name]
            return full.reshape(-1)[frag.start : frag.start + frag.numel].clone()
        if self.mesh is None:
            return full
        placements = self.placements[name]
        # 1-D placements use only dim 0
        placements = tuple(S0 if (p.is_shard() and full.ndim == 1) else p for p in placements)
        return distribute(full, self.mesh, placements)


def clipped(model: Weights, full: dict[str, torch.Tensor]) -> dict:
    """The trainer's clip on copies of this rank's gradient blocks, to half their norm: the norm it returns
    and every gradient afterwards, whole (the weights' own gradients stay as they are)."""
    copies = [SimpleNamespace(grad=model.lay_out(n, g)) for n, g in full.items()]
    want = torch.sqrt(sum(g.double().square().sum() for g in full.values())).item()
    norm = clip_grad_norm_(copies, want / 2).item()
    grads = {n: (c.grad.full_tensor() if isinstance(c.grad, DTensor) else c.grad).clone()
             for n, c in zip(full, copies)}
    return {"norm": norm, "grads": grads}


def run(case: str, out: Path, steps: range, name: str | None = None, load: str | None = None,
        save_after: int | None = None, logit_ranks: int | None = None) -> None:
    # logit_ranks: pretend the logits came from that many ranks (a resumed run must see the same ones)
    rank = dist.get_rank() % (logit_ranks or dist.get_world_size())
    shapes = {**SHAPES, **(extra_shapes(5) if case.endswith("_more") else {})}
    model = Weights(case, shapes)
    current = {"step": None}
    opt = make_optimizer(list(model.named_parameters()), lambda i: None if current["step"] is None
                         else max_logits(current["step"], rank)[i], fragments=model.fragments)
    if load:  # continue from a checkpoint written under another layout
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=str(out / load))
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    stats, clips = [], []
    for step in steps:
        full = gradients(step, shapes)
        for n, g in full.items():
            getattr(model, n).grad = model.lay_out(n, g)
        if model.fragments is None:
            clips.append(clipped(model, full))
        current["step"] = step
        opt.step()
        current["step"] = None
        stats.append(dict(opt.step_stats))
        if save_after is not None and step == save_after:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(out / "ckpt"))
    if model.fragments is not None:
        gather = FragmentGather({n: (f, 0) for n, f in model.fragments.items()}, dist.group.WORLD)
        weights = gather.full({n: p.detach() for n, p in model.named_parameters()})
    else:
        weights = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                   for n, p in model.named_parameters()}
    # optimizer state elements this rank keeps (step counters aside): under ZeRO-1 no two ranks keep the same
    state_numel = sum(v.numel() for st in opt.state.values() for k, v in st.items() if k != "step")
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"steps": stats, "state_numel": state_numel})
    if rank == 0:
        torch.save({"weights": weights, "stats": everyone, "clips": clips}, out / f"{name or case}.pt")


def main() -> None:
    out, cases = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    for case in cases:
        if case == "fsdp_save":  # 2 steps, checkpoint, 1 more step
            run("fsdp", out, range(3), name=case, save_after=1)
        elif case == "fsdp4_load":  # the dp=2 checkpoint continued on 4 ranks
            run("fsdp4", out, range(2, 3), name=case, load="ckpt", logit_ranks=2)
        else:
            run(case, out, range(3))
    dist.barrier()
    gc.collect()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
