"""Where each parameter's blocks lie on the ranks of a pipeline stage, and MuonClip's owner plan over them
(kimi.optim.owners.assign): what kimi/plan/comm.py counts MuonClip's all-to-alls from and kimi/plan/memory.py
sizes the busiest owner's working memory by."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from kimi.config import Config
from kimi.parallel.engine_rules import DEEPSPEED
from kimi.plan.shapes import facts, model_shapes, section_key


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


_RANK_PARAMS: Dict[tuple, tuple] = {}
_ORDER: Dict[str, Dict[str, int]] = {}


def rank_params(cfg: Config, blocks: Sequence[int], first: bool, last: bool) -> tuple:
    """((name, full shape, tp split dim, ep split, unit), ...) of the parameters a pipeline rank holds (a
    tied head once), in the order of the model's named_parameters (the optimizer's). Cached (the search
    asks for the same ranks' many times): read-only."""
    model_key = section_key(cfg.model, cfg.optim)
    key = (model_key, tuple(blocks), first, last, cfg.parallel.ep > 1)
    if key not in _RANK_PARAMS:
        _RANK_PARAMS[key] = tuple(_rank_params(cfg, model_key, blocks, first, last))
    return _RANK_PARAMS[key]


def _rank_params(cfg: Config, model_key: str, blocks: Sequence[int], first: bool, last: bool) -> list:
    table, ep_on, seen, out = facts(cfg), cfg.parallel.ep > 1, set(), []
    if model_key not in _ORDER:
        _ORDER[model_key] = {name: i for i, (name, _) in enumerate(model_shapes(cfg)[2])}
    order = _ORDER[model_key]
    held = [*(["embed"] if first else []), *blocks, *(["end"] if last else [])]
    for f in sorted((f for where in held for f in table.get(where, [])), key=lambda f: order[f.name]):
        if f.key in seen:
            continue
        seen.add(f.key)
        ep = ep_on and f.ep_split
        out.append((f.name, f.shape, f.tp_dim, ep, f.name.rsplit(".", 1)[0] if ep else f.unit))
    return out


def tp_local(shape: Tuple[int, ...], dim: Optional[int], tp: int, ep: bool, ep_n: int) -> List[int]:
    s = list(shape) or [1]
    if ep:
        s[0] = _ceil(s[0], ep_n)
    if dim is not None and tp > 1:
        s[dim] = _ceil(s[dim], tp)
    return s


def zero_padded(cfg: Config, numel: int) -> int:
    """DeepSpeed's flat buffer of `numel` elements, padded to a multiple of 2 x dp_shard (its alignment)."""
    align = 2 * cfg.parallel.dp_shard
    return _ceil(numel, align) * align


def _flat_blocks(cfg: Config, params) -> List[list]:
    """ZeRO's layout: at stages 1-2 the parameters concatenated in order and cut into dp_shard equal flat
    partitions, at stage 3 each parameter cut alone; a rank's piece of a parameter is the flat range its
    partition holds (kimi.optim.owners.Fragment)."""
    dp = cfg.parallel.dp_shard
    if cfg.parallel.deepspeed.zero_stage == 3:
        everyone = []
        for r in range(dp):
            mine = []
            for name, shape, *_ in params:
                n = math.prod(shape)
                start, end = min(r * _ceil(n, dp), n), min((r + 1) * _ceil(n, dp), n)
                mine.append((name, shape, "float32", (start if end > start else 0,), (end - start,), True))
            everyone.append(mine)
        return everyone
    total = sum(math.prod(shape) for _, shape, *_ in params)
    part = zero_padded(cfg, total) // dp
    everyone = []
    for r in range(dp):
        lo, hi, offset, mine = r * part, (r + 1) * part, 0, []
        for name, shape, *_ in params:
            n = math.prod(shape)
            start, end = max(lo, offset), min(hi, offset + n)
            piece = (start - offset, max(0, end - start)) if end > start else (0, 0)
            mine.append((name, shape, "float32", (piece[0],), (piece[1],), True))
            offset += n
        everyone.append(mine)
    return everyone


def _cut(lo: int, size: int, index: int, parts: int) -> Tuple[int, int]:
    """(start, size) along one dimension of the index-th of `parts` even pieces (ceil) of [lo, lo + size)."""
    chunk = _ceil(size, parts)
    start = min(index * chunk, size)
    return lo + start, min(chunk, size - start)


def _column(p, shape: Tuple[int, ...], dim: Optional[int], ep: bool, fsdp: bool, ranks) -> list:
    """Each rank's (offset, block shape) of a parameter of `shape`: cut along dim 0 by expert parallelism,
    then along its split dim by tensor parallelism, then along dim 0 by FSDP; ranks cut alike share one."""
    tp = dim is not None and p.tp > 1
    cut0 = bool(fsdp and shape)
    blocks: Dict[tuple, tuple] = {}
    column = []
    for s, c, t in ranks:
        # the indices the cuts take: expert, tensor-parallel, FSDP
        key = (s % p.ep if ep else 0, t if tp else 0, (s // p.ep if ep else s * p.cp + c) if cut0 else 0)
        block = blocks.get(key)
        if block is None:
            lo, size = [0] * len(shape), list(shape)
            if ep:
                lo[0], size[0] = _cut(lo[0], size[0], key[0], p.ep)
            if tp:
                lo[dim], size[dim] = _cut(lo[dim], size[dim], t, p.tp)
            if cut0:
                lo[0], size[0] = _cut(lo[0], size[0], key[2], p.dp_shard // p.ep if ep else p.dp_shard * p.cp)
            block = blocks[key] = (tuple(lo), tuple(size))
        column.append(block)
    return column


def _blocks_of(cfg: Config, params) -> List[list]:
    """Every rank's block layout of each parameter (kimi.optim.owners' layout tuples), in the order of the
    stage group: (dp_replicate, dp_shard, cp, tp), tp innermost (a large model's search asks for millions
    of them)."""
    p = cfg.parallel
    if p.engine == DEEPSPEED:
        return _flat_blocks(cfg, params)
    fsdp = p.dp_replicate * p.dp_shard * p.cp > 1
    ranks = [(s, c, t) for s in range(p.dp_shard) for c in range(p.cp) for t in range(p.tp)]
    once = [[] for _ in ranks]  # the (dp_shard, cp, tp) ranks' layouts: every replica holds the same blocks
    # every rank's (offset, block shape) per (shape, split dim, ep): each layer's parameters of one shape are
    # cut alike
    columns: Dict[tuple, list] = {}
    for name, shape, dim, ep, _ in params:
        column = columns.get((tuple(shape), dim, ep))
        if column is None:
            column = columns[tuple(shape), dim, ep] = _column(p, shape, dim, ep, fsdp, ranks)
        for mine, (lo, size) in zip(once, column):
            mine.append((name, shape, "float32", lo, size, False))
    return once * p.dp_replicate


def muon_plans(cfg: Config, params) -> Tuple[List[bool], list, List[List[Optional[int]]]]:
    """MuonClip's plans (kimi.optim.owners.assign) over a pipeline stage's group, from the ranks' block
    layouts, in the optimizer's order; which of them are Muon matrices; and per rank, the index of its piece
    of each plan (the plans' `local` as that rank sees them). assign's plans are the same on every rank but
    for `local`, so it runs once, not once per rank (its cost grows with the ranks)."""
    import torch

    from kimi.optim.owners import assign

    _, routes, _ = model_shapes(cfg)
    everyone = _blocks_of(cfg, params)
    # the optimizer's order: the Muon group, then AdamW's decayed (2-D and up) and undecayed tensors
    order = [i for i, x in enumerate(params) if routes[x[0]] == "muon"]
    order += [i for i, x in enumerate(params) if routes[x[0]] != "muon" and len(x[1]) >= 2]
    order += [i for i, x in enumerate(params) if routes[x[0]] != "muon" and len(x[1]) < 2]
    everyone = [[mine[i] for i in order] for mine in everyone]
    muon = [routes[params[i][0]] == "muon" for i in order]
    kinds = [(torch.float32, torch.device("meta"))] * len(order)
    plans = assign(everyone, muon, 0, kinds)
    world = len(everyone)
    local: List[List[Optional[int]]] = [[None] * len(plans) for _ in range(world)]
    for i, plan in enumerate(plans):
        for k in reversed(range(len(plan.pieces))):  # a rank's first piece holding it, as assign picks it
            for r in plan.pieces[k].holders:
                local[r][i] = k
    return muon, plans, local


@dataclass(frozen=True)
class MuonTraffic:
    """MuonClip's transfers over a pipeline stage's group, per rank: elements received as an owner (the
    gradient blocks it lacks), elements received back (its blocks of the others' updates, and of AdamW's
    replicated tensors from their keepers), elements of the matrices it orthogonalises whole; and whether
    each of the two all-to-alls runs at all."""

    to_owner: Tuple[int, ...]
    back: Tuple[int, ...]
    owned: Tuple[int, ...]
    runs: Tuple[bool, bool]
    sends: Tuple[int, ...] = ()  # elements sent to the owners (first all-to-all)
    sends_back: Tuple[int, ...] = ()  # elements an owner (or an AdamW keeper) sends to the holders

    def buffers(self, rank: int) -> int:
        """Elements of the larger of the two all-to-alls' flat send and receive buffers on `rank`
        (kimi.optim.owners.Router concatenates what it sends and receives into one tensor each)."""
        return max(self.sends[rank] + self.to_owner[rank], self.sends_back[rank] + self.back[rank])


_TRAFFIC: Dict[tuple, MuonTraffic] = {}
_PARAMS_KEY: Dict[int, tuple] = {}  # id of a rank_params tuple -> what its plan depends on of it


def muon_traffic(cfg: Config, blocks: Sequence[int], first: bool, last: bool) -> MuonTraffic:
    """MuonTraffic of a pipeline rank's stage group (up to EXACT_GROUP ranks), cached per what the plan
    depends on: the rank's parameters' shapes, split dims and optimizer families in order (not their names,
    so pipeline ranks holding alike blocks share it) and the degrees their blocks' layout depends on; the
    micro-batch, checkpointing and precision variants of a layout share it too."""
    p = cfg.parallel
    params = rank_params(cfg, blocks, first, last)
    if id(params) not in _PARAMS_KEY:  # rank_params' tuples are cached, so lasting: their ids stay theirs
        _, routes, _ = model_shapes(cfg)
        _PARAMS_KEY[id(params)] = tuple((tuple(shape), dim, ep, routes[name])
                                        for name, shape, dim, ep, _ in params)
    zero = p.deepspeed.zero_stage if p.engine == DEEPSPEED else None
    key = (_PARAMS_KEY[id(params)], p.dp_replicate, p.dp_shard, p.cp, p.tp, p.ep, p.engine, zero)
    if key in _TRAFFIC:
        return _TRAFFIC[key]
    muon, plans, local = muon_plans(cfg, params)
    world = len(local)
    to_owner, back, owns, runs = [0] * world, [0] * world, [0] * world, [False, False]
    sends, sends_back = [0] * world, [0] * world
    for i, (plan, is_muon) in enumerate(zip(plans, muon)):
        if is_muon:
            runs[0] |= any(s != plan.owner for s in plan.senders)
            runs[1] |= any(h != plan.owner for pc in plan.pieces for h in pc.holders)
            owns[plan.owner] += math.prod(plan.shape)
            if not (len(plan.pieces) == 1 and plan.senders[0] == plan.owner):
                to_owner[plan.owner] += sum(pc.numel for k, pc in enumerate(plan.pieces)
                                            if plan.senders[k] != plan.owner)
            sends_back[plan.owner] += sum(pc.numel for pc in plan.pieces for h in pc.holders
                                          if h != plan.owner)
            for r in range(world):
                k = local[r][i]
                if r != plan.owner and k is not None:
                    back[r] += plan.pieces[k].numel
                    if plan.senders[k] == r:
                        sends[r] += plan.pieces[k].numel
        else:
            runs[1] |= any(len(pc.holders) > 1 for pc in plan.pieces)
            for r in range(world):
                k = local[r][i]
                if k is not None and plan.keepers[k] != r:
                    back[r] += plan.pieces[k].numel
                if k is not None and plan.keepers[k] == r:
                    sends_back[r] += plan.pieces[k].numel * (len(plan.pieces[k].holders) - 1)
    _TRAFFIC[key] = MuonTraffic(tuple(to_owner), tuple(back), tuple(owns), (runs[0], runs[1]), tuple(sends),
                                tuple(sends_back))
    return _TRAFFIC[key]


EXACT_GROUP = 64  # stage groups up to this many ranks get MuonClip's exact plan; larger ones an estimate


def stage_group(p) -> int:
    return p.dp_replicate * p.dp_shard * p.cp * p.tp


_NUMEL: Dict[tuple, Tuple[int, int]] = {}


def muon_numel(cfg: Config, params) -> Tuple[int, int]:
    """(elements of the stage's Muon matrices, of them on one rank after tp, ep and FSDP); cached for
    rank_params' (cached, so lasting) tuples."""
    p = cfg.parallel
    key = (id(params), p.tp, p.ep, p.dp_shard, p.cp) if isinstance(params, tuple) else None
    if key is None or key not in _NUMEL:
        found = _muon_numel(cfg, params)
        if key is None:
            return found
        _NUMEL[key] = found
    return _NUMEL[key]


_GROUP_MUON: Dict[tuple, Tuple[int, int]] = {}  # (group number, tp, ep, dp_shard, cp) -> (whole, local)


def _muon_numel(cfg: Config, params) -> Tuple[int, int]:
    p = cfg.parallel
    whole = local = 0
    for _, group in unit_groups(cfg, params):
        key = (group, p.tp, p.ep, p.dp_shard, p.cp)
        if key not in _GROUP_MUON:
            w = n = 0
            for shape, dim, ep, muon in GROUP_SHAPES[group]:
                if muon:
                    w += math.prod(shape)
                    s = tp_local(shape, dim, p.tp, ep, p.ep)
                    shards = p.dp_shard // p.ep if ep else p.dp_shard * p.cp
                    n += _ceil(s[0], shards) * math.prod(s[1:])
            _GROUP_MUON[key] = (w, n)
        whole += _GROUP_MUON[key][0]
        local += _GROUP_MUON[key][1]
    return whole, local


_GROUPS: Dict[int, list] = {}  # id of a rank_params tuple -> [(unit, its group's number)]
_GROUP_IDS: Dict[tuple, int] = {}  # a group -> its number
GROUP_SHAPES: List[tuple] = []  # number -> the group: ((shape, tp dim, expert, Muon-routed), ...)


def unit_groups(cfg: Config, params) -> list:
    """[(FSDP unit, group number)] of a rank's parameters (rank_params' tuples), units in order of first
    occurrence. A group is what a unit's sizes depend on, its parameters' (shape, tp dim, expert, routed to
    Muon), numbered once: blocks of the same shapes (every KDA block of a model) share one, so what the
    planner derives from a unit's shapes per layout (FSDP's padded sizes, Muon's elements) is computed once
    per group and layout, not once per rank. Cached for rank_params' (cached, so lasting) tuples."""
    if id(params) in _GROUPS:
        return _GROUPS[id(params)]
    _, routes, _ = model_shapes(cfg)
    groups: Dict[str, list] = {}
    for name, shape, dim, ep, unit in params:
        groups.setdefault(unit, []).append((shape, dim, ep, routes[name] == "muon"))
    out = []
    for unit, group in groups.items():
        group = tuple(group)
        if group not in _GROUP_IDS:
            _GROUP_IDS[group] = len(GROUP_SHAPES)
            GROUP_SHAPES.append(group)
        out.append((unit, _GROUP_IDS[group]))
    if isinstance(params, tuple):
        _GROUPS[id(params)] = out
    return out


def owned(cfg: Config, blocks, first: bool, last: bool) -> List[Tuple[int, int]]:
    """Per rank of the stage's group: (elements of the Muon matrices it orthogonalises whole, elements of
    the larger of its two all-to-alls' flat buffers). Beyond EXACT_GROUP ranks, the balanced estimate every
    rank gets: a 1/W share owned, its buffers what comm.py's estimate moves (the share's rest gathered, the
    rank's own blocks sent)."""
    group = stage_group(cfg.parallel)
    if group > EXACT_GROUP:
        whole, local = muon_numel(cfg, rank_params(cfg, blocks, first, last))
        share = _ceil(whole, group)
        return [(share, share - share * local // max(1, whole) + local)]
    t = muon_traffic(cfg, blocks, first, last)
    return [(t.owned[r], t.buffers(r)) for r in range(group)]
