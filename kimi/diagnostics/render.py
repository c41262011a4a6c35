"""Diagnostics for people: heatmap PNGs in <run_dir>/diagnostics/ (one per kind and diagnostics step, all
kept: a few tens of KB each), the tables wandb shows, and one console line per diagnostics step."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from .record import Matrix, attnres_matrix, head_matrix, moe_matrix, per_block

Table = Tuple[List[str], List[list]]  # (columns, rows)


def draw_heatmap(ax, fig, matrix: Matrix, title: str, xlabel: str, ylabel: str, fmt: str = "{:.2f}",
                 cmap: str = "viridis", vmin: Optional[float] = None, vmax: Optional[float] = None) -> None:
    """`matrix` as a heatmap on `ax` (of `fig`), NaN cells blank, the values written in while legible; the
    run dir's PNGs and kimi.dashboard's AttnRes panel."""
    import numpy as np

    rows, cols, values = matrix
    data = np.ma.masked_invalid(np.array(values, dtype=float))
    image = ax.imshow(data, cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto")
    ax.set_xticks(range(len(cols)), cols, rotation=60, ha="right", fontsize=8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    if len(rows) * len(cols) <= 400:  # numbers only while they stay legible
        for r, line in enumerate(values):
            for c, v in enumerate(line):
                if math.isfinite(v):  # dark text on the colormap's bright end
                    ax.text(c, r, fmt.format(v), ha="center", va="center", fontsize=7,
                            color="k" if image.norm(v) > 0.6 else "w")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(image, ax=ax)


def _heatmap(path: Path, matrix: Matrix, title: str, xlabel: str, ylabel: str, fmt: str, cmap: str,
             vmin: Optional[float] = None, vmax: Optional[float] = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols, _ = matrix
    fig, ax = plt.subplots(figsize=(min(max(5.5, 2.5 + 0.55 * len(cols)), 24),
                                    min(2.2 + 0.4 * len(rows), 24)),
                           dpi=100)
    draw_heatmap(ax, fig, matrix, title, xlabel, ylabel, fmt, cmap, vmin, vmax)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def write_pngs(out_dir: Path, step: int, record: Dict[str, float],
               qk_clip_tau: Optional[float]) -> Dict[str, Path]:
    """attnres_step_<N>.png (AttnRes) and qk_heads_step_<N>.png (MLA), where the model has them; returns
    them by their wandb key."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images = {}
    weights = attnres_matrix(record)
    if weights[0]:
        images["diagnostics/attnres"] = _heatmap(
            out_dir / f"attnres_step_{step:08d}.png", weights,
            f"AttnRes: mean weight of each source, step {step}\n(first validation batch)", "source",
            "sublayer",
            "{:.2f}", "viridis", 0.0, 1.0)
    heads = head_matrix(record)
    if heads[0]:
        source = (f"QK-Clip's last step (tau {qk_clip_tau:g})" if qk_clip_tau
                  else "no QK-Clip: first validation batch")
        images["diagnostics/qk_heads"] = _heatmap(
            out_dir / f"qk_heads_step_{step:08d}.png", heads,
            f"MLA max scaled logit per head, step {step}\n{source}", "head", "layer", "{:.3g}", "magma")
    return images


def tables(record: Dict[str, float]) -> Dict[str, Table]:
    """The AttnRes weights, the per-head max logits and the experts' loads as tables (absent cells None)."""
    out = {}
    for key, first, (rows, cols, values) in (("diagnostics/attnres_table", "sublayer",
                                              attnres_matrix(record)),
                                            ("diagnostics/qk_heads_table", "layer", head_matrix(record)),
                                            ("diagnostics/moe_load_table", "block", moe_matrix(record))):
        if rows:
            out[key] = ([first, *cols], [[r, *(v if math.isfinite(v) else None for v in line)]
                                         for r, line in zip(rows, values)])
    return out


def console_line(step: int, record: Dict[str, float]) -> str:
    """The step's diagnostics in one line: the worst MLA head, the KDA decay range, the most loaded expert
    layer, each family's update RMS, and the source the final AttnRes aggregation weighs most."""
    parts = []
    layers, heads, logits = head_matrix(record)
    if layers:
        v, layer, head = max((v, layer, head) for layer, line in zip(layers, logits)
                             for head, v in zip(heads, line))
        clipped = record.get("qk_clipped_frac")
        parts.append(f"max logit {v:.3g} ({layer} {head}"
                     + (f"; {100 * clipped:.0f}% clipped)" if clipped is not None else ")"))
    means, lows = per_block(record, "kda/decay_mean"), per_block(record, "kda/decay_min")
    if means:
        parts.append(f"KDA decay mean {min(means.values()):.3f}-{max(means.values()):.3f}, min "
                     f"{min(lows.values()):.3g}")
    imbalance = per_block(record, "moe/load_max_over_mean")
    if imbalance:
        block = max(imbalance, key=imbalance.get)
        parts.append(f"MoE max/mean {imbalance[block]:.2f} (block {block})")
    rms = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("optim/update_rms/")}
    if rms:
        parts.append("update RMS " + " ".join(f"{f} {v:.1e}" for f, v in rms.items()))
    final = {k.rsplit("/", 1)[1]: v for k, v in record.items() if k.startswith("attnres/final/")}
    if final:
        source = max(final, key=final.get)
        parts.append(f"AttnRes final: {source} {final[source]:.2f}")
    return f"[kimi] step {step} diagnostics: " + (" | ".join(parts) or "nothing to report")
