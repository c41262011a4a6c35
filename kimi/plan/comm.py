"""Every collective a training step runs, per mesh dimension, with the bytes one rank puts in: the planner's
communication model, from the model's shapes and the layout alone (no process group, no tensors).

Counted as bench/comm_count.py's CommCounter counts them (docs/planning.md checks the two against each
other): a call per c10d collective, its bytes those of its first tensor argument. Which buffer that is
depends on the caller, so a time model must read `bytes` per dimension: FSDP2's and ZeRO's all-gathers
count the whole gathered output and their reduce-scatters the rank's shard (the output); MuonClip's
all-to-alls and expert parallelism's counts exchange what the rank receives; DTensor's and expert
parallelism's functional collectives (tp, sequence parallelism, the routed rows) pass the input first, so
a sequence-parallel all-gather counts the rank's shard and its reduce-scatter the whole tensor. Per
optimizer step (trainer.grad_accum_steps micro-batches, or the pipeline's):

  FSDP2 (dp_shard x cp > 1)  per unit (each token mixer and MLP, the routed experts under ep, the root):
      an all-gather in the forward, again in the backward (not the root: reshard_after_forward), a
      reduce-scatter of its gradient, and an all-reduce of that shard over dp_replicate (HSDP's, also on a
      dp_replicate of 1: the mesh is 2-D)
  tp  per sublayer split by heads: the row-parallel projection's output all-reduced in the forward (again
      in a full recompute), each column-parallel projection's input gradient in the backward, each
      sum_grads parameter's gradient; the vocabulary-parallel embedding's output, the LM head's input
      gradient and the loss-parallel cross-entropy's three reductions. Under sequence parallelism the
      sublayer input's all-gather and the output's reduce-scatter instead (an estimate: see the docs)
  pp  per micro-batch the stream's sources sent forward and their gradients back (1F1B and GPipe), and
      the loss summed over the stages
  ep  per MoE layer and micro-batch: the counts' all-to-all and the rows' two, the rows' two again in the
      backward (and the forward's three in a full recompute); the rows' bytes are the balanced expectation
  cp  per KDA layer the halo and shard summary gathered, per MLA layer the shard's latent gathered
      (bench/context.py's exchange: two gathers and one all-reduce of the gradient per layer)
  the step  the loss's mean over all ranks, the gradient norm's reductions, MuonClip's two all-to-alls
      (its owner plan, kimi.optim.owners.assign, computed from the ranks' block layouts), QK-Clip's max
      logits and the MoE loads' sums over the stage.

A collective over all ranks is listed under the outermost dimension larger than 1.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Tuple

from kimi.config import Config, pipeline_microbatches
from kimi.parallel.engine_rules import DEEPSPEED
from kimi.plan.owner_plan import (EXACT_GROUP, muon_numel, muon_plans, rank_params, stage_group, tp_local,
                                  zero_padded)
from kimi.plan.shapes import model_shapes, muonclip, pipeline, sources

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "recv", "broadcast")
DIMS = ("tp", "pp", "ep", "cp", "dp_shard", "dp_replicate")


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send | recv | broadcast
    dim: str  # the mesh dimension it runs over: tp | pp | ep | cp | dp_shard | dp_replicate
    calls: int  # per optimizer step, on one rank
    bytes: int  # per optimizer step, what one rank puts in (its first tensor argument's bytes)


class _Tally:
    def __init__(self):
        self.calls: Dict[Tuple[str, str], int] = defaultdict(int)
        self.bytes: Dict[Tuple[str, str], int] = defaultdict(int)

    def add(self, kind: str, dim: str, calls: int, nbytes: int) -> None:
        if calls:
            self.calls[(kind, dim)] += calls
            self.bytes[(kind, dim)] += int(nbytes)

    def rows(self) -> List[Collective]:
        return [Collective(k, d, self.calls[(k, d)], self.bytes[(k, d)]) for k, d in self.calls]


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _world_dim(p, stage: bool = False) -> str:
    """The dimension a collective over every rank (with `stage`: every rank of a pipeline stage, MuonClip's
    and QK-Clip's group) is listed under: the outermost of size > 1."""
    dims = (("pp", 1 if stage else p.pp), ("dp_replicate", p.dp_replicate), ("dp_shard", p.dp_shard),
            ("cp", p.cp), ("tp", p.tp))
    return next((dim for dim, n in dims if n > 1), "dp_shard")


# ---- the model's parameters on a rank -----------------------------------------------------------------
# ---- FSDP2 ------------------------------------------------------------------------------------------------
def _fsdp(cfg: Config, params, micro: int, tally: _Tally) -> None:
    from kimi.precision.registry import precision_for

    p = cfg.parallel
    if p.dp_replicate * p.dp_shard * p.cp == 1 or p.engine == DEEPSPEED:
        return
    gather_bytes = precision_for(cfg.trainer.precision).compute_bytes()
    units: Dict[str, List[int]] = defaultdict(lambda: [0, 0])  # unit -> [padded numel, world]
    for _, shape, dim, ep, unit in params:
        world = p.dp_shard // p.ep if ep else p.dp_shard * p.cp
        s = tp_local(shape, dim, p.tp, ep, p.ep)
        units[unit][0] += _ceil(s[0], world) * world * math.prod(s[1:])
        units[unit][1] = world
    # a pipeline schedule syncs gradients at a stage's last micro-batch only (not measured here: no layout
    # of the check combines pp with FSDP); accumulation outside a pipeline reduces every micro-batch
    reduces = 1 if p.pp > 1 else micro
    for unit, (numel, world) in units.items():
        if world > 1:  # a unit not sharded (the routed experts when ep = dp_shard) gathers nothing
            again = unit != "root" and p.reshard_after_forward
            calls = micro * (1 + again)
            tally.add("all_gather", "dp_shard", calls, calls * numel * gather_bytes)
            tally.add("reduce_scatter", "dp_shard", reduces, reduces * numel // world * 4)
        tally.add("all_reduce", "dp_replicate", reduces, reduces * numel // world * 4)


# ---- tensor parallelism -----------------------------------------------------------------------------------
def _tp(cfg: Config, blocks, first: bool, last: bool, tokens: int, micro: int, tally: _Tally) -> None:
    from kimi.precision.registry import precision_for

    p, m = cfg.parallel, cfg.model
    if p.tp == 1:
        return
    act = precision_for(cfg.trainer.precision).compute_bytes()
    model, _, _ = model_shapes(cfg)
    sp = p.sequence_parallel
    # a full recompute repeats what its backward needs (the sublayer input's gather under sequence
    # parallelism), not the output's reduction: torch's checkpoint stops once the saved tensors are back
    again = 2 if p.activation_checkpointing == "full" else 1
    shard = tokens // p.tp

    def add(kind, calls, elements, size=act):
        tally.add(kind, "tp", micro * calls, micro * calls * elements * size)

    for i in blocks:
        block = model.blocks[str(i)]
        for sub in (block.mixer, block.mlp):
            plan = sub.tp_plan()
            if sp:  # its input gathered from the ranks' tokens
                add("all_gather", again, shard * m.d_model)
            if plan.replicate:
                if sp:  # its output's gradient gathered back from the ranks' tokens
                    add("all_gather", 1, shard * m.d_model)
                continue
            for name in plan.rowwise:
                out = sub.get_submodule(name).out_features
                if sp:  # reduce-scattered forward, its gradient gathered backward
                    add("reduce_scatter", 1, tokens * out)
                    add("all_gather", 1, shard * out)
                else:
                    add("all_reduce", 1, tokens * out)
            for name in plan.colwise:  # each one's input gradient, summed over the ranks
                add("all_reduce", 1, tokens * sub.get_submodule(name).in_features)
            for name in plan.sum_grads:
                add("all_reduce", 1, sub.get_parameter(name).numel(), 4)
        if sp:  # the norms and queries applied to the rank's tokens sum their gradients
            for name in ("mixer_norm.weight", "mlp_norm.weight", "mixer_query", "mlp_query",
                         "mixer_key_weight", "mlp_key_weight"):
                param = _param(block, name)
                if param is not None:
                    add("all_reduce", 1, param.numel(), 4)
    if first:  # the vocabulary-parallel embedding's output: reduced (and its gradient gathered under sp)
        if sp:
            add("reduce_scatter", 1, tokens * m.d_model)
            add("all_gather", 1, shard * m.d_model)
        else:
            add("all_reduce", 1, tokens * m.d_model)
    if last:
        if sp:  # the LM head's input gathered, its gradient reduce-scattered; the final norm and query
            add("all_gather", 1, shard * m.d_model)
            add("reduce_scatter", 1, tokens * m.d_model)
            for name in ("norm.weight", "final_query", "final_key_weight"):
                param = _param(model, name)
                if param is not None:
                    add("all_reduce", 1, param.numel(), 4)
        else:
            add("all_reduce", 1, tokens * m.d_model)  # the head's input gradient
        add("all_reduce", 3, tokens, 4)  # the loss-parallel cross-entropy's max, sum and target logit


def _param(module, name: str):
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


# ---- pipeline ---------------------------------------------------------------------------------------------
def _pp(cfg: Config, rank: int, blocks, rows: int, tally: _Tally) -> None:
    from kimi.precision.registry import precision_for

    p, m, t = cfg.parallel, cfg.model, cfg.trainer
    if p.pp == 1:
        return
    M = pipeline_microbatches(cfg)
    act = precision_for(t.precision).compute_bytes()
    per_source = rows * (t.seq_len // p.cp) * m.d_model * act
    outgoing = sources(m, 2 * (max(blocks) + 1)) if rank < p.pp - 1 else 0
    incoming = sources(m, 2 * min(blocks)) if rank > 0 else 0
    tally.add("send", "pp", M * (outgoing + incoming), M * (outgoing + incoming) * per_source)
    tally.add("recv", "pp", M * (outgoing + incoming), M * (outgoing + incoming) * per_source)
    tally.add("all_reduce", "pp", 1, 4)  # the loss, summed over the stages


# ---- expert and context parallelism -----------------------------------------------------------------------
def _ep(cfg: Config, blocks, tokens: int, micro: int, tally: _Tally) -> None:
    from kimi.model.registry import mlp_kinds
    from kimi.precision.registry import precision_for

    p, m = cfg.parallel, cfg.model
    if p.ep == 1:
        return
    act = precision_for(cfg.trainer.precision).compute_bytes()
    layers = sum(1 for i in blocks if mlp_kinds(m)[i] == "moe")
    width = m.moe_latent_dim or m.d_model
    # every exchange's input is this rank's (token, choice) rows or what it received of the others':
    # tokens x top_k rows either way when routing is balanced (exact for the first, an expectation else)
    rows = tokens * m.moe_top_k
    recompute = p.activation_checkpointing == "full"
    calls = layers * micro * (3 + 2 + 3 * recompute)
    nbytes = layers * micro * ((1 + recompute) * 8 * m.moe_num_experts
                               + (4 + 2 * recompute) * rows * width * act)
    tally.add("all_to_all", "ep", calls, nbytes)


def _cp(cfg: Config, blocks, rows: int, micro: int, tally: _Tally) -> None:
    from kimi.config import mixer_pattern
    from kimi.precision.registry import precision_for

    p, m, t = cfg.parallel, cfg.model, cfg.trainer
    if p.cp == 1:
        return
    pattern = mixer_pattern(m)
    act = precision_for(t.precision).compute_bytes()
    gathers = 2 if p.activation_checkpointing == "full" else 1  # the recompute gathers again
    for i in blocks:
        if pattern[i] == "K":  # the three convs' halos, then the shard summary (fp32): two messages
            width = m.kda_num_heads * m.kda_head_dim
            messages = [rows * 3 * (m.conv_size - 1) * width * act,
                        rows * m.kda_num_heads * m.kda_head_dim ** 2 * 2 * 4]
        else:  # the shard's latent and shared key
            messages = [rows * t.seq_len // p.cp * (m.kv_lora_rank + m.qk_rope_head_dim) * act]
        for message in messages:
            tally.add("all_gather", "cp", micro * gathers, micro * gathers * message)
            # the gradient of every rank's message, all-reduced (gloo has no reduce-scatter)
            tally.add("all_reduce", "cp", micro, micro * p.cp * message)


# ---- the optimizer step -----------------------------------------------------------------------------------
def _muonclip(cfg: Config, params, tally: _Tally) -> None:
    """MuonClip's two all-to-alls (gradients to the owners; updates back, with AdamW's replicas), bytes the
    most any rank of the stage receives."""
    world = stage_group(cfg.parallel)
    if world == 1:
        return
    if world > EXACT_GROUP:  # balanced: an owner gathers the rest of 1/world of the matrices, every rank
        whole, local = muon_numel(cfg, params)  # gets back the blocks it holds of the others'
        share = _ceil(whole, world)
        tally.add("all_to_all", _world_dim(cfg.parallel, stage=True), 2,
                  4 * (share - share * local // whole + local))
        return
    muon, plans = muon_plans(cfg, params)
    to_owner, back, runs = [0] * world, [0] * world, [False, False]
    for rank in range(world):
        for plan, is_muon in zip(plans[rank], muon):
            piece = plan.local_piece()
            if is_muon:
                runs[0] |= any(s != plan.owner for s in plan.senders)
                runs[1] |= any(h != plan.owner for pc in plan.pieces for h in pc.holders)
                if plan.owner == rank and not (len(plan.pieces) == 1 and plan.senders[0] == rank):
                    to_owner[rank] += sum(pc.numel for k, pc in enumerate(plan.pieces)
                                          if plan.senders[k] != rank)
                elif plan.owner != rank and piece is not None:
                    back[rank] += piece.numel
            else:
                runs[1] |= any(len(pc.holders) > 1 for pc in plan.pieces)
                if piece is not None and plan.keepers[plan.local] != rank:
                    back[rank] += piece.numel
    totals = [4 * (to_owner[r] * runs[0] + back[r] * runs[1]) for r in range(world)]
    tally.add("all_to_all", _world_dim(cfg.parallel, stage=True), sum(runs), max(totals))


def _zero(cfg: Config, params, tally: _Tally) -> None:
    """DeepSpeed ZeRO-1/2 (parallel.engine=deepspeed): the flat gradients all-reduced in reduce buckets, the
    updated partitions all-gathered in all-gather buckets, its gradient norm and our finiteness check.
    ZeRO-3 as measured on `tiny` (docs/planning.md): each parameter all-gathered once a step, the
    gradients reduce-scattered in reduce buckets (the shard's bytes), the norm in fp64."""
    ds = cfg.parallel.deepspeed
    total = sum(math.prod(shape) for _, shape, *_ in params)
    if ds.zero_stage == 3:
        tally.add("all_gather", "dp_shard", len(params), 4 * total)
        shard = sum(_ceil(math.prod(shape), cfg.parallel.dp_shard) for _, shape, *_ in params)
        tally.add("reduce_scatter", "dp_shard", _ceil(total, ds.reduce_bucket_size), 4 * shard)
        tally.add("all_reduce", "dp_shard", 2, 12)
        return
    tally.add("all_reduce", "dp_shard", _ceil(total, ds.reduce_bucket_size), 4 * total)
    padded = zero_padded(cfg, total)
    tally.add("all_gather", "dp_shard", _ceil(padded, ds.allgather_bucket_size), 4 * padded)
    tally.add("all_reduce", "dp_shard", 2, 8)  # the gradient norm, and whether every rank's is finite


def _step(cfg: Config, params, blocks, last: bool, tally: _Tally) -> None:

    p, o = cfg.parallel, cfg.optim
    world = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    if world == 1:
        return
    dim = _world_dim(p)
    tally.add("all_reduce", dim, 1, 4)  # the loss's mean over every rank
    model, _, _ = model_shapes(cfg)
    if p.engine == DEEPSPEED:
        _zero(cfg, params, tally)
    elif p.tp > 1 or p.pp > 1 or p.ep > 1:  # kimi's clip: one reduction per (mesh, sharded dims) group
        meshes = set()
        fsdp = p.dp_replicate * p.dp_shard * p.cp > 1
        for _, shape, dim_tp, ep, _ in params:
            split = []
            if fsdp:
                split.append("dp_shard")
            if ep:
                split.append("ep")
            if dim_tp is not None and p.tp > 1:
                split.append("tp")
            if split:
                meshes.add((ep, tuple(split)))
        for _, split in sorted(meshes):
            for d in split:
                tally.add("all_reduce", d, 1, 4)
        if p.pp > 1:
            tally.add("all_reduce", "pp", 1, 4)
    else:  # torch's clip over FSDP's DTensors: the per-tensor norms stacked, reduced once
        tally.add("all_reduce", "dp_shard", 1, 4 * len(params))
    stage = world // p.pp
    dim = _world_dim(p, stage=True)
    if muonclip(cfg):
        _muonclip(cfg, params, tally)
    if o.qk_clip_tau > 0 and stage > 1:
        specs = model.qk_clip_specs()
        mine = [s for s in specs if int(s.layer.split(".")[1]) in set(blocks)] if specs else []
        if mine:
            tally.add("all_reduce", dim, 1, 4 * sum(s.num_heads for s in mine))
    if cfg.model.moe_num_experts and stage > 1:
        moe = [model.blocks[str(i)].mlp for i in blocks if hasattr(model.blocks[str(i)].mlp, "load")]
        if moe:
            tally.add("all_reduce", dim, 1, sum(x.load.numel() * x.load.element_size() for x in moe))
            hists = [x.qb_hist for x in moe if getattr(x, "qb_hist", None) is not None]
            if hists:
                tally.add("all_reduce", dim, 1, sum(h.numel() * h.element_size() for h in hists))
    if p.pp > 1 and cfg.model.moe_num_experts:
        tally.add("all_reduce", "pp", 1, 4 * (2 + bool(cfg.model.moe_aux_loss_coef)))


def per_rank(cfg: Config) -> List[List[Collective]]:
    """The collectives of each pipeline rank (any of its dp, cp, tp ranks)."""
    model_shapes(cfg)  # resolves model.vocab_size
    p, t = cfg.parallel, cfg.trainer
    M = pipeline_microbatches(cfg)
    micro = M if p.pp > 1 else t.grad_accum_steps
    rows = t.micro_batch_size // M
    tokens = rows * (t.seq_len // p.cp)
    out = []
    for rank, (_, blocks, first, last) in enumerate(pipeline(cfg)):
        tally = _Tally()
        params = rank_params(cfg, blocks, first, last)
        _fsdp(cfg, params, micro, tally)
        _tp(cfg, blocks, first, last, tokens, micro, tally)
        _pp(cfg, rank, blocks, rows, tally)
        _ep(cfg, blocks, tokens, micro, tally)
        _cp(cfg, blocks, rows, micro, tally)
        _step(cfg, params, blocks, last, tally)
        out.append(tally.rows())
    return out


def collectives_per_step(cfg: Config) -> List[Collective]:
    """Every collective of one optimizer step on the busiest pipeline rank (the most bytes), per kind and
    mesh dimension."""
    ranks = per_rank(cfg)
    return max(ranks, key=lambda rows: sum(c.bytes for c in rows))
