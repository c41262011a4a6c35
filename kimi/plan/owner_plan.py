"""Where each parameter's blocks lie on the ranks of a pipeline stage, and MuonClip's owner plan over them
(kimi.optim.owners.assign): what kimi/plan/comm.py counts MuonClip's all-to-alls from and kimi/plan/memory.py
sizes the busiest owner's working memory by."""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

from kimi.config import Config
from kimi.parallel.engine_rules import DEEPSPEED
from kimi.plan.shapes import facts, model_shapes


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def rank_params(cfg: Config, blocks: Sequence[int], first: bool, last: bool):
    """[(name, full shape, tp split dim, ep split, unit)] of the parameters a pipeline rank holds (a tied
    head once), in the order of the model's named_parameters (the optimizer's)."""
    table, ep_on, seen, out = facts(cfg), cfg.parallel.ep > 1, set(), []
    order = {name: i for i, (name, _) in enumerate(model_shapes(cfg)[2])}
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


def _blocks_of(cfg: Config, params) -> List[list]:
    """Every rank's block layout of each parameter (kimi.optim.owners' layout tuples), in the order of the
    stage group: (dp_replicate, dp_shard, cp, tp), tp innermost."""
    p = cfg.parallel
    if p.engine == DEEPSPEED:
        return _flat_blocks(cfg, params)
    fsdp = p.dp_replicate * p.dp_shard * p.cp > 1
    everyone = []
    for rep in range(p.dp_replicate):
        for s in range(p.dp_shard):
            for c in range(p.cp):
                for t in range(p.tp):
                    mine = []
                    for name, shape, dim, ep, _ in params:
                        lo, size = [0] * len(shape), list(shape)

                        def cut(d, index, parts):
                            chunk = _ceil(size[d], parts)
                            start = min(index * chunk, size[d])
                            lo[d] += start
                            size[d] = min(chunk, size[d] - start)

                        if ep:
                            cut(0, s % p.ep, p.ep)
                        if dim is not None and p.tp > 1:
                            cut(dim, t, p.tp)
                        if fsdp and shape:
                            if ep:
                                cut(0, s // p.ep, p.dp_shard // p.ep)
                            else:
                                cut(0, s * p.cp + c, p.dp_shard * p.cp)
                        mine.append((name, shape, "float32", tuple(lo), tuple(size), False))
                    everyone.append(mine)
    return everyone


def muon_plans(cfg: Config, params) -> Tuple[List[bool], List[list]]:
    """MuonClip's plans (kimi.optim.owners.assign) as each rank of a pipeline stage's group sees them, from
    the ranks' block layouts, in the optimizer's order; and which of them are Muon matrices."""
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
    return muon, [assign(everyone, muon, rank, kinds) for rank in range(len(everyone))]


EXACT_GROUP = 64  # stage groups up to this many ranks get MuonClip's exact plan; larger ones an estimate


def stage_group(p) -> int:
    return p.dp_replicate * p.dp_shard * p.cp * p.tp


def muon_numel(cfg: Config, params) -> Tuple[int, int]:
    """(elements of the stage's Muon matrices, of them on one rank after tp, ep and FSDP)."""
    p = cfg.parallel
    _, routes, _ = model_shapes(cfg)
    whole = local = 0
    for name, shape, dim, ep, _ in params:
        if routes[name] == "muon":
            whole += math.prod(shape)
            s = tp_local(shape, dim, p.tp, ep, p.ep)
            shards = p.dp_shard // p.ep if ep else p.dp_shard * p.cp
            local += _ceil(s[0], shards) * math.prod(s[1:])
    return whole, local


def owned(cfg: Config, blocks, first: bool, last: bool) -> List[int]:
    """Per rank of the stage's group: the elements of the Muon matrices it orthogonalises whole (beyond
    EXACT_GROUP ranks, the balanced share every rank gets)."""
    params = rank_params(cfg, blocks, first, last)
    group = stage_group(cfg.parallel)
    if group > EXACT_GROUP:
        return [_ceil(muon_numel(cfg, params)[0], group)]
    muon, plans = muon_plans(cfg, params)
    return [sum(math.prod(pl.shape) for pl, m in zip(mine, muon) if m and pl.owner == rank)
            for rank, mine in enumerate(plans)]
