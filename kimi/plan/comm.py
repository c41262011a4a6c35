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
from kimi.plan.owner_plan import (EXACT_GROUP, GROUP_SHAPES, muon_numel, muon_traffic, rank_params,
                                  stage_group, tp_local, unit_groups, zero_padded)
from kimi.plan.shapes import model_shapes, muonclip, pipeline, section_key, sources, stage_ranges

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


# ---- FSDP2 ------------------------------------------------------------------------------------------------
_UNITS: Dict[tuple, Dict[str, List[int]]] = {}
_LASTING: set = set()  # ids of the cached unit tables
_GROUP_NUMEL: Dict[tuple, List[int]] = {}  # (group number, tp, ep_n, dp_shard, cp) -> [padded numel, world]


def _units(cfg: Config, params, tp: int, ep_n: int, dp_shard: int, cp: int) -> Dict[str, List[int]]:
    """FSDP unit -> [padded elements, world] of a rank's parameters (a unit's world: its last parameter's),
    cached for rank_params' (cached, so lasting) tuples."""
    key = (id(params), tp, ep_n, dp_shard, cp)
    if key in _UNITS:
        return _UNITS[key]
    units: Dict[str, List[int]] = {}
    for unit, group in unit_groups(cfg, params):
        gkey = (group, tp, ep_n, dp_shard, cp)
        if gkey not in _GROUP_NUMEL:
            numel, world = 0, 0
            for shape, dim, ep, _ in GROUP_SHAPES[group]:
                world = dp_shard // ep_n if ep else dp_shard * cp
                s = tp_local(shape, dim, tp, ep, ep_n)
                numel += _ceil(s[0], world) * world * math.prod(s[1:])
            _GROUP_NUMEL[gkey] = [numel, world]
        units[unit] = _GROUP_NUMEL[gkey]  # read only (_fsdp_sums)
    if isinstance(params, tuple):
        _UNITS[key] = units
        _LASTING.add(id(units))
    return units


def _fsdp(cfg: Config, params, micro: int, tally: _Tally) -> None:
    from kimi.precision.registry import precision_for

    p = cfg.parallel
    if p.dp_replicate * p.dp_shard * p.cp == 1 or p.engine == DEEPSPEED:
        return
    gather_bytes = precision_for(cfg.trainer.precision).compute_bytes()
    units = _units(cfg, params, p.tp, p.ep, p.dp_shard, p.cp)
    # A pipeline schedule syncs gradients at a stage's last micro-batch only, and keeps the units its
    # backwards gathered until that one (reshard_after_backward off before it): a stage gathers every unit
    # once, then each non-root unit again once per micro-batch (tiny over pp 2 x dp_shard 2, bench/
    # plan_check.py: 13 gathers where once per forward and backward would be 18). Accumulation outside a
    # pipeline gathers and reduces every micro-batch.
    reduces = 1 if p.pp > 1 else micro
    for kind, dim, calls, elements in _fsdp_sums(units, p.reshard_after_forward):
        if kind == "all_gather":  # the gathered units in the compute dtype: the forward's
            n = 1 if p.pp > 1 else micro
            tally.add(kind, dim, n * calls, n * elements * gather_bytes)
        elif kind == "regather":  # the non-root units again (reshard_after_forward)
            tally.add("all_gather", dim, micro * calls, micro * elements * gather_bytes)
        else:  # per gradient reduction, the fp32 shards
            tally.add(kind, dim, reduces * calls, reduces * elements * 4)


_FSDP_SUMS: Dict[tuple, list] = {}


def _fsdp_sums(units: Dict[str, List[int]], reshard: bool) -> list:
    """FSDP's collectives per forward or per reduction, summed over the units per kind in the order they
    first occur: (kind, dim, calls, elements) with every unit (the routed experts when ep = dp_shard are
    not sharded and gather nothing) an all-gather in the forward ("all_gather"), again in the backward
    ("regather": not the root, and only with reshard_after_forward), a reduce-scatter of its gradient to the
    shard, and an all-reduce of that shard over dp_replicate (HSDP's, also on a dp_replicate of 1: the mesh
    is 2-D). Cached per units table."""
    key = (id(units), reshard)
    if key in _FSDP_SUMS:
        return _FSDP_SUMS[key]
    sums: Dict[str, List] = {}
    for unit, (numel, world) in units.items():
        if world > 1:
            row = sums.setdefault("all_gather", ["dp_shard", 0, 0])
            row[1] += 1
            row[2] += numel
            if unit != "root" and reshard:
                row = sums.setdefault("regather", ["dp_shard", 0, 0])
                row[1] += 1
                row[2] += numel
            row = sums.setdefault("reduce_scatter", ["dp_shard", 0, 0])
            row[1] += 1
            row[2] += numel // world  # numel is padded to a multiple of world
        row = sums.setdefault("all_reduce", ["dp_replicate", 0, 0])
        row[1] += 1
        row[2] += numel // world
    found = [(kind, dim, calls, elements) for kind, (dim, calls, elements) in sums.items()]
    if id(units) in _LASTING:  # a cached table: its id stays its own
        _FSDP_SUMS[key] = found
    return found


# ---- tensor parallelism -----------------------------------------------------------------------------------
def _tp(cfg: Config, blocks, first: bool, last: bool, tokens: int, micro: int, tally: _Tally) -> None:
    from kimi.precision.registry import precision_for

    p = cfg.parallel
    if p.tp == 1:
        return
    act = precision_for(cfg.trainer.precision).compute_bytes()
    model_shapes(cfg)  # resolves model.vocab_size
    # a full recompute repeats what its backward needs (the sublayer input's gather under sequence
    # parallelism), not the output's reduction: torch's checkpoint stops once the saved tensors are back
    again = 2 if p.activation_checkpointing == "full" else 1
    shard = tokens // p.tp
    for kind, (calls, tok, sh, const, tok4, const4) in _tp_sums(cfg, blocks, first, last, p.sequence_parallel,
                                                                 again).items():
        tally.add(kind, "tp", micro * calls,
                  micro * (act * (tok * tokens + sh * shard + const) + 4 * (tok4 * tokens + const4)))


_TP_SUMS: Dict[tuple, Dict[str, List[int]]] = {}


def _tp_sums(cfg: Config, blocks, first: bool, last: bool, sp: bool, again: int) -> Dict[str, List[int]]:
    """Tensor parallelism's collectives of a pipeline rank per micro-batch, summed per kind in the order
    they first occur: [calls, then the bytes' coefficients: of tokens x the compute dtype's size, of the
    rank's shard of them x that size, of that size alone, of tokens x 4, of 4]. Cached per model shape and
    blocks: each layout then costs a few multiplications, not a pass over the blocks."""
    key = (section_key(cfg.model), tuple(blocks), first, last, sp, again)
    if key in _TP_SUMS:
        return _TP_SUMS[key]
    d = cfg.model.d_model
    table = _tp_table(cfg)
    sums: Dict[str, List[int]] = {}

    def add(kind, calls, tok=0, sh=0, const=0, fp32=False):
        row = sums.setdefault(kind, [0, 0, 0, 0, 0, 0])
        row[0] += calls
        if fp32:
            row[4] += calls * tok
            row[5] += calls * const
        else:
            row[1] += calls * tok
            row[2] += calls * sh
            row[3] += calls * const

    for i in blocks:
        subs, norms = table[str(i)]
        for replicate, outs, ins, grads in subs:
            if sp:  # its input gathered from the ranks' tokens
                add("all_gather", again, sh=d)
            if replicate:
                if sp:  # its output's gradient gathered back from the ranks' tokens
                    add("all_gather", 1, sh=d)
                continue
            for out in outs:  # the row-parallel projections' outputs
                if sp:  # reduce-scattered forward, its gradient gathered backward
                    add("reduce_scatter", 1, tok=out)
                    add("all_gather", 1, sh=out)
                else:
                    add("all_reduce", 1, tok=out)
            for features in ins:  # each column-parallel projection's input gradient, summed over the ranks
                add("all_reduce", 1, tok=features)
            for numel in grads:
                add("all_reduce", 1, const=numel, fp32=True)
        if sp:  # the norms and queries applied to the rank's tokens sum their gradients
            for numel in norms:
                add("all_reduce", 1, const=numel, fp32=True)
    if first:  # the vocabulary-parallel embedding's output: reduced (and its gradient gathered under sp)
        if sp:
            add("reduce_scatter", 1, tok=d)
            add("all_gather", 1, sh=d)
        else:
            add("all_reduce", 1, tok=d)
    if last:
        if sp:  # the LM head's input gathered, its gradient reduce-scattered; the final norm and query
            add("all_gather", 1, sh=d)
            add("reduce_scatter", 1, tok=d)
            for numel in table["end"]:
                add("all_reduce", 1, const=numel, fp32=True)
        else:
            add("all_reduce", 1, tok=d)  # the head's input gradient
        add("all_reduce", 3, tok=1, fp32=True)  # the loss-parallel cross-entropy's max, sum and target logit
    _TP_SUMS[key] = sums
    return sums


def _param(module, name: str):
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


_TP_TABLES: Dict[str, dict] = {}
_NORMS = ("mixer_norm.weight", "mlp_norm.weight", "mixer_query", "mlp_query", "mixer_key_weight",
          "mlp_key_weight")


def _tp_table(cfg: Config) -> dict:
    """What tensor parallelism splits, per block (its mixer's and MLP's (replicated, row-parallel output
    features, column-parallel input features, elements of the parameters whose gradients are summed), and
    the elements of its norms and queries), and the final norm's and query's elements ("end"): read from
    the meta model once per model shape rather than once per layout."""
    key = section_key(cfg.model)
    if key not in _TP_TABLES:
        model, _, _ = model_shapes(cfg)
        table = {}
        for i, block in model.blocks.items():
            subs = []
            for sub in (block.mixer, block.mlp):
                plan = sub.tp_plan()
                if plan.replicate:
                    subs.append((True, [], [], []))
                    continue
                subs.append((False, [sub.get_submodule(n).out_features for n in plan.rowwise],
                             [sub.get_submodule(n).in_features for n in plan.colwise],
                             [sub.get_parameter(n).numel() for n in plan.sum_grads]))
            table[i] = (subs, [x.numel() for x in (_param(block, n) for n in _NORMS) if x is not None])
        final = (_param(model, n) for n in ("norm.weight", "final_query", "final_key_weight"))
        table["end"] = [x.numel() for x in final if x is not None]
        _TP_TABLES[key] = table
    return _TP_TABLES[key]


# ---- pipeline ---------------------------------------------------------------------------------------------
def _pp(cfg: Config, rank: int, blocks, rows: int, tally: _Tally) -> None:
    from kimi.precision.registry import precision_for

    p, m, t = cfg.parallel, cfg.model, cfg.trainer
    if p.pp == 1:
        return
    M = pipeline_microbatches(cfg)
    act = precision_for(t.precision).compute_bytes()
    per_source = rows * (t.seq_len // p.cp) * m.d_model * act
    # every stage of the rank (an interleaved schedule's v of them) receives the stream's sources at its
    # first block and sends them on after its last one; their gradients go back the same ways
    ranges = stage_ranges(cfg)
    tensors = 0
    for stage in range(rank, len(ranges), p.pp):
        first, last = ranges[stage].start, ranges[stage].stop
        tensors += sources(m, 2 * last) if stage < len(ranges) - 1 else 0
        tensors += sources(m, 2 * first) if stage > 0 else 0
    tally.add("send", "pp", M * tensors, M * tensors * per_source)
    tally.add("recv", "pp", M * tensors, M * tensors * per_source)
    tally.add("all_reduce", "pp", 1, 4)  # the loss, summed over the stages


# ---- expert and context parallelism -----------------------------------------------------------------------
def _ep(cfg: Config, blocks, tokens: int, micro: int, tally: _Tally) -> None:
    from kimi.model.registry import mlp_kinds
    from kimi.precision.registry import precision_for

    p, m = cfg.parallel, cfg.model
    if p.ep == 1:
        return
    act = precision_for(cfg.trainer.precision).compute_bytes()
    kinds = mlp_kinds(m)
    layers = sum(1 for i in blocks if kinds[i] == "moe")
    width = m.moe.latent_dim or m.d_model
    # every exchange's input is this rank's (token, choice) rows or what it received of the others':
    # tokens x top_k rows either way when routing is balanced (exact for the first, an expectation else)
    rows = tokens * m.moe.top_k
    recompute = p.activation_checkpointing == "full"
    calls = layers * micro * (3 + 2 + 3 * recompute)
    nbytes = layers * micro * ((1 + recompute) * 8 * m.moe.num_experts
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
            width = m.kda.num_heads * m.kda.head_dim
            messages = [rows * 3 * (m.conv_size - 1) * width * act,
                        rows * m.kda.num_heads * m.kda.head_dim ** 2 * 2 * 4]
        else:  # the shard's latent and shared key
            messages = [rows * t.seq_len // p.cp * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * act]
        for message in messages:
            tally.add("all_gather", "cp", micro * gathers, micro * gathers * message)
            # the gradient of every rank's message, all-reduced (gloo has no reduce-scatter)
            tally.add("all_reduce", "cp", micro, micro * p.cp * message)


# ---- the optimizer step -----------------------------------------------------------------------------------
def _muonclip(cfg: Config, params, blocks, first: bool, last: bool, tally: _Tally) -> None:
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
    t = muon_traffic(cfg, blocks, first, last)
    totals = [4 * (t.to_owner[r] * t.runs[0] + t.back[r] * t.runs[1]) for r in range(world)]
    tally.add("all_to_all", _world_dim(cfg.parallel, stage=True), sum(t.runs), max(totals))


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


_MESHES: Dict[tuple, list] = {}


def _clip_meshes(params, fsdp: bool, tp: bool) -> list:
    """The gradient clip's (expert-split, sharded dims) groups of a rank's parameters, sorted; cached for
    rank_params' (cached, so lasting) tuples."""
    key = (id(params), fsdp, tp)
    if key in _MESHES:
        return _MESHES[key]
    meshes = set()
    for _, shape, dim_tp, ep, _ in params:
        split = []
        if fsdp:
            split.append("dp_shard")
        if ep:
            split.append("ep")
        if dim_tp is not None and tp:
            split.append("tp")
        if split:
            meshes.add((ep, tuple(split)))
    found = sorted(meshes)
    if isinstance(params, tuple):
        _MESHES[key] = found
    return found


_STEP_TABLES: Dict[str, tuple] = {}


def _step_table(cfg: Config) -> tuple:
    """Per block, once per model shape: QK-Clip's heads (its specs'), the MoE load counter's bytes and the
    Quantile Balancing histogram's bytes, as the step sums them over the stage."""
    key = section_key(cfg.model)
    if key not in _STEP_TABLES:
        model, _, _ = model_shapes(cfg)
        heads: Dict[int, List[int]] = defaultdict(list)
        for spec in model.qk_clip_specs() or []:
            heads[int(spec.layer.split(".")[1])].append(spec.num_heads)
        loads, hists = {}, {}
        for i, block in model.blocks.items():
            if hasattr(block.mlp, "load"):
                loads[int(i)] = block.mlp.load.numel() * block.mlp.load.element_size()
                h = getattr(block.mlp, "qb_hist", None)
                if h is not None:
                    hists[int(i)] = h.numel() * h.element_size()
        _STEP_TABLES[key] = (dict(heads), loads, hists)
    return _STEP_TABLES[key]


def _step(cfg: Config, params, blocks, first: bool, last: bool, tally: _Tally,
          owners: bool = True) -> None:

    p, o = cfg.parallel, cfg.optim
    world = p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp
    if world == 1:
        return
    dim = _world_dim(p)
    tally.add("all_reduce", dim, 1, 4)  # the loss's mean over every rank
    model, _, _ = model_shapes(cfg)
    if p.engine == DEEPSPEED:
        _zero(cfg, params, tally)
    else:  # kimi's clip (every layout of more than one rank): one reduction per (mesh, sharded dims) group
        meshes = _clip_meshes(params, p.dp_replicate * p.dp_shard * p.cp > 1, p.tp > 1)
        for _, split in meshes:
            for d in split:
                tally.add("all_reduce", d, 1, 4)
        if p.pp > 1:
            tally.add("all_reduce", "pp", 1, 4)
    stage = world // p.pp
    dim = _world_dim(p, stage=True)
    if owners and muonclip(cfg):
        _muonclip(cfg, params, blocks, first, last, tally)
    heads, loads, hists = _step_table(cfg)
    if o.qk_clip_tau > 0 and stage > 1:
        mine = [h for i in blocks for h in heads.get(i, ())]
        if mine:
            tally.add("all_reduce", dim, 1, 4 * sum(mine))
    if cfg.model.moe.num_experts and stage > 1:
        moe = [i for i in blocks if i in loads]
        if moe:
            tally.add("all_reduce", dim, 1, sum(loads[i] for i in moe))
            kept = [hists[i] for i in moe if i in hists]
            if kept:
                tally.add("all_reduce", dim, 1, sum(kept))
    if p.pp > 1 and cfg.model.moe.num_experts:
        tally.add("all_reduce", "pp", 1, 4 * (2 + bool(cfg.model.moe.aux_loss_coef)))


def per_rank(cfg: Config, muonclip: bool = True) -> List[List[Collective]]:
    """The collectives of each pipeline rank (any of its dp, cp, tp ranks); without MuonClip's all-to-alls
    when `muonclip` is false (their owner plan is the expensive part: the planner's search bounds a layout
    by the rest first)."""
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
        _step(cfg, params, blocks, first, last, tally, muonclip)
        out.append(tally.rows())
    return out


def collectives_per_step(cfg: Config) -> List[Collective]:
    """Every collective of one optimizer step on the busiest pipeline rank (the most bytes), per kind and
    mesh dimension."""
    ranks = per_rank(cfg)
    return max(ranks, key=lambda rows: sum(c.bytes for c in rows))
