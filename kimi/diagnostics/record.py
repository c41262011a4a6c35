"""Diagnostics as metrics: the ranks' tallies (observe.py) combined into metrics.jsonl's keys, and parsers
that turn a record back into matrices (for the PNGs here and for dashboards). The keys (README: Diagnostics):

  attnres/<sublayer>/<source>          mean softmax weight over the first validation batch's tokens
  qk_max_logit/<layer>/h<h>            per-head max scaled logit (QK-Clip's last step; without QK-Clip the
                                       diagnostic forward's, with qk_max_logit/<layer> and qk_max_logit)
  kda/decay_mean|decay_min|decay_below_half|beta_mean/<block>
  moe/load/<block>/e<e>, moe/load_max_over_mean/<block>
  optim/grad_norm|update_rms/<family>  (from the engine's step: kimi/parallel/family_stats.py)

Sublayers are "<i>.mixer", "<i>.mlp" (i: block index) and "final"; sources are "embed", "<j>.mixer" /
"<j>.mlp" (full AttnRes), "block<n>" (block AttnRes: completed block n >= 1) and "partial" (the running sum
of the current block).
"""

from __future__ import annotations

import math
import re
from typing import Dict, List, Optional, Sequence, Tuple

from kimi.model.config import ModelConfig
from kimi.run.metrics import qk_clip_record

Matrix = Tuple[List[str], List[str], List[List[float]]]  # (row labels, column labels, rows of values)


def sublayers(cfg: ModelConfig) -> List[str]:
    """Every sublayer in depth order, the final aggregation last."""
    return [f"{i}.{k}" for i in range(cfg.num_layers) for k in ("mixer", "mlp")] + ["final"]


def attnres_sources(cfg: ModelConfig, sublayer: str) -> List[str]:
    """The labels of the sources `sublayer` mixes, in the stream's order (kimi/model/attnres.py)."""
    names = sublayers(cfg)
    s = names.index(sublayer)  # sublayers before it
    if cfg.residual == "attnres_full":
        return ["embed"] + names[:s]
    size = cfg.attnres.block_size
    return ["embed"] + [f"block{n}" for n in range(1, s // size + 1)] + (["partial"] if s % size else [])


def combine(tallies: Sequence, cfg: ModelConfig, qk_clip_tau: Optional[float] = None) -> Dict[str, float]:
    """The metrics of one diagnostic step from every rank's Tally: sums and counts added (ranks saw other
    tokens, or other heads of the same tokens, or other blocks), minima and maxima taken, MLA heads placed
    by the first head each rank computed. qk_clip_tau: QK-Clip's threshold when it is on."""
    record: Dict[str, float] = {}
    attnres: Dict[str, list] = {}
    for t in tallies:
        for sub, (weights, tokens) in t.attnres.items():
            acc = attnres.setdefault(sub, [[0.0] * len(weights), 0])
            acc[0] = [a + w for a, w in zip(acc[0], weights)]
            acc[1] += tokens
    for sub in (s for s in sublayers(cfg) if s in attnres):
        weights, tokens = attnres[sub]
        for label, w in zip(attnres_sources(cfg, sub), weights):
            record[f"attnres/{sub}/{label}"] = w / tokens
    record.update(_qk_heads(tallies, cfg, qk_clip_tau))
    kda: Dict[int, list] = {}
    for t in tallies:
        for block, (decay, n, low, below, beta, n_beta) in t.kda.items():
            acc = kda.setdefault(block, [0.0, 0.0, math.inf, 0.0, 0.0, 0.0])
            kda[block] = [acc[0] + decay, acc[1] + n, min(acc[2], low), acc[3] + below, acc[4] + beta,
                          acc[5] + n_beta]
    for block, (decay, n, low, below, beta, n_beta) in sorted(kda.items()):
        record.update({f"kda/decay_mean/{block}": decay / n, f"kda/decay_min/{block}": low,
                       f"kda/decay_below_half/{block}": below / n, f"kda/beta_mean/{block}": beta / n_beta})
    moe: Dict[int, List[float]] = {}
    for t in tallies:
        for block, counts in t.moe.items():
            moe[block] = [a + c for a, c in zip(moe.get(block, [0.0] * len(counts)), counts)]
    for block, counts in sorted(moe.items()):
        total = sum(counts)
        record.update({f"moe/load/{block}/e{e}": c / total for e, c in enumerate(counts)})
        record[f"moe/load_max_over_mean/{block}"] = max(counts) / (total / len(counts))
    return record


def _qk_heads(tallies: Sequence, cfg: ModelConfig, tau: Optional[float]) -> Dict[str, float]:
    """Per-head max logits: QK-Clip's (already over every rank that ran the layer: each stage reports its
    own layers) with its per-layer summary for every layer, or, without QK-Clip, the diagnostic forward's."""
    heads: Dict[str, List[float]] = {}
    clip = any(t.qk_clip for t in tallies)
    for t in tallies:
        reports = ([(layer, 0, v) for layer, v in t.qk_clip.items()] if clip else
                   [(layer, first, v) for layer, (first, v) in t.mla.items()])
        for layer, first, values in reports:
            acc = heads.setdefault(layer, [-math.inf] * cfg.mla.num_heads)
            for h, v in enumerate(values, start=first):
                acc[h] = max(acc[h], v)
    heads = {layer: heads[layer] for layer in sorted(heads, key=natural_key)}
    record = {f"qk_max_logit/{layer}/h{h}": v for layer, values in heads.items()
              for h, v in enumerate(values)}
    if clip:  # QK-Clip's stats computed as it computes them (fp32), here over every pipeline stage's layers
        import torch  # here: the parsers below (the dashboard's) need no torch

        stats = {}
        for layer, v in heads.items():
            s_max = torch.tensor(v, dtype=torch.float32)
            stats[layer] = {"max_logit": s_max.max().item(),
                            "clipped_frac": (s_max > tau).float().mean().item()}
        record.update(qk_clip_record(stats))
    elif heads:
        record.update({f"qk_max_logit/{layer}": max(v) for layer, v in heads.items()})
        record["qk_max_logit"] = max(max(v) for v in heads.values())
    return record


# ---- parsers: a record (one line of metrics.jsonl) back into matrices -----------------------------------
def natural_key(name: str) -> list:
    """Sort key that orders the numbers inside names as numbers (blocks.10 after blocks.9)."""
    return [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", name)]


def _grid(record: Dict[str, float], pattern: str, row_order, col_order) -> Matrix:
    cells = {}
    for key, value in record.items():
        m = re.fullmatch(pattern, key)
        if m:
            cells[m.group(1), m.group(2)] = value
    rows = sorted({r for r, _ in cells}, key=row_order)
    cols = sorted({c for _, c in cells}, key=col_order)
    return rows, cols, [[cells.get((r, c), math.nan) for c in cols] for r in rows]


def _sublayer_order(name: str) -> tuple:
    if name == "final":
        return (math.inf, 0)
    block, kind = name.split(".")
    return (int(block), kind == "mlp")


def _source_order(name: str) -> tuple:
    if name == "embed":
        return (0, 0, 0)
    if name.startswith("block"):
        return (2, int(name[5:]), 0)
    if name == "partial":
        return (3, 0, 0)
    return (1, *_sublayer_order(name))


def attnres_matrix(record: Dict[str, float]) -> Matrix:
    """(sublayers, sources, weights[sublayer][source]) in depth order; NaN where a sublayer does not read a
    source (a later one, or another block's partial sum). Empty lists for a standard residual."""
    return _grid(record, r"attnres/(.+)/(.+)", _sublayer_order, _source_order)


def head_matrix(record: Dict[str, float]) -> Matrix:
    """(MLA layers, heads "h0".., max scaled logit[layer][head]), layers in depth order."""
    return _grid(record, r"qk_max_logit/(.+)/(h\d+)", natural_key, natural_key)


def moe_matrix(record: Dict[str, float]) -> Matrix:
    """(MoE blocks, experts "e0".., fraction of the routed tokens[block][expert])."""
    return _grid(record, r"moe/load/(\d+)/(e\d+)", natural_key, natural_key)


def per_block(record: Dict[str, float], name: str) -> Dict[int, float]:
    """{block: value} of a per-block key such as "kda/decay_mean" or "moe/load_max_over_mean"."""
    pattern = re.escape(name) + r"/(\d+)"
    return {int(m.group(1)): v for k, v in record.items() if (m := re.fullmatch(pattern, k))}
