"""One PNG of one or more runs, from their metrics.jsonl: the runs overlaid, one panel per quantity.

    python -m kimi.dashboard runs=[RUN_DIR,...] [out=PNG] [columns=3]

  runs            one run directory, or a list of them (required)
  out             the PNG to write (default <first run>/dashboard.png)
  columns         panels per row (default 3)

key=value arguments (kimi/cli/keyvalue.py); a bad argument is one line and exit code 2.

Panels (each drawn only when some run logged its keys; kimi.run.metrics.read_metrics reads the records):

- loss: train ``loss`` (lines) and validation ``val_loss`` (markers), a blend's per-source validation losses
  ``val_loss/<source>`` (square markers, a line style each); learning rate ``lr``; ``tokens_per_s``;
  ``mfu``; ``grad_norm`` with the per-family ``optim/grad_norm/{muon,adamw}``;
- ``optim/update_rms/{family}``: the RMS of each optimizer family's update;
- QK-Clip: ``qk_max_logit`` (the worst head of all MLA layers), per layer ``qk_max_logit/<layer>`` (thin
  lines: its heads, ``qk_max_logit/<layer>/h<h>``), and ``qk_clipped_frac`` (mean fraction of heads clipped);
- KDA, per layer i: ``kda/decay_mean/i``, ``kda/decay_min/i``, ``kda/beta_mean/i``;
- MoE, per layer i: ``moe/load_max_over_mean/i`` (1 is a perfectly even load);
- the Attention-Residual weights ``attnres/<sublayer>/<source>`` of the first run at its last step that logged
  them, as a heatmap: rows are sublayers (``<i>.mixer``, ``<i>.mlp``, ``final``), columns the sources
  (``embed``, ``<j>.mixer`` / ``<j>.mlp`` or ``block<n>``, ``partial``), each row a softmax over its sources.

Runs have one colour each; in per-layer panels a line style tells the layers apart (with one run, colours do).
The same keys, grouped the same way, on wandb: docs/dashboards.md.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kimi.diagnostics import attnres_matrix
from kimi.diagnostics.record import Matrix, natural_key  # Matrix: rows, columns, values (nan: not logged)
from kimi.diagnostics.render import draw_heatmap

Record = Dict[str, Any]
STYLES = ("-", "--", ":", "-.")


@dataclass
class Run:
    label: str
    records: List[Record]


@dataclass
class Dashboard:
    """What was drawn: the PNG, the panels' titles in order, the image size in pixels, and the AttnRes
    matrix of the heatmap (None when no run logged AttnRes weights)."""

    path: Path
    panels: List[str]
    size: Tuple[int, int]
    attnres: Optional[Matrix] = None
    attnres_step: Optional[int] = None
    skipped: List[str] = field(default_factory=list)  # panels without data
    lines: Dict[str, List[str]] = field(default_factory=dict)  # each panel's labelled lines


# ---- reading -----------------------------------------------------------------------------------------------
def load_runs(run_dirs: Sequence[Path]) -> List[Run]:
    from kimi.run.metrics import read_metrics

    runs = []
    names = [Path(d).resolve().name for d in run_dirs]
    for d, name in zip(run_dirs, names):
        path = Path(d) / "metrics.jsonl" if Path(d).is_dir() else Path(d)
        if not path.is_file():
            raise FileNotFoundError(f"{d}: no metrics.jsonl (is it a run directory?)")
        label = name if names.count(name) == 1 else f"{Path(d).resolve().parent.name}/{name}"
        runs.append(Run(label, read_metrics(path)))
    return runs


def series(records: Sequence[Record], key: str) -> Tuple[List[int], List[float]]:
    """(steps, values) of the records that logged `key` with a finite number."""
    pts = [(r["step"], float(r[key])) for r in records
           if isinstance(r.get(key), (int, float)) and "step" in r and math.isfinite(float(r[key]))]
    return [s for s, _ in pts], [v for _, v in pts]


def keys_under(runs: Sequence[Run], prefix: str, depth: int = 1) -> List[str]:
    """The distinct key suffixes after `prefix` of `depth` parts (split on '/'), in natural order."""
    found = {k[len(prefix):] for run in runs for r in run.records for k in r if k.startswith(prefix)}
    return sorted((k for k in found if k and len(k.split("/")) == depth), key=natural_key)


# ---- panels ------------------------------------------------------------------------------------------------
def _plot_runs(ax, runs: Sequence[Run], key: str, scale: float = 1.0, style: str = "-", marker=None,
               label_suffix: str = "", lw: float = 1.2) -> bool:
    drew = False
    for i, run in enumerate(runs):
        steps, vals = series(run.records, key)
        if steps:  # a single point gets a marker, or it would not show
            ax.plot(steps, [v * scale for v in vals], style, color=f"C{i % 10}", ms=3, lw=lw,
                    marker=marker or ("o" if len(steps) == 1 else None),
                    label=f"{run.label}{label_suffix}")
            drew = True
    return drew


def _per_layer(ax, runs: Sequence[Run], prefix: str, thin_prefix: Optional[str] = None) -> bool:
    """One line per run and layer of the keys prefix<layer>; with thin_prefix, thin lines for the keys
    prefix<layer>/<sub> (heads)."""
    layers = keys_under(runs, prefix)
    drew = False
    for li, layer in enumerate(layers):
        for ri, run in enumerate(runs):
            color = f"C{li % 10}" if len(runs) == 1 else f"C{ri % 10}"
            style = "-" if len(runs) == 1 else STYLES[li % len(STYLES)]
            steps, vals = series(run.records, prefix + layer)
            if steps:
                label = layer if len(runs) == 1 else f"{run.label}: {layer}"
                ax.plot(steps, vals, style, color=color, lw=1.3, label=label, ms=3,
                        marker="o" if len(steps) == 1 else None)
                drew = True
            if thin_prefix:
                for sub in keys_under([run], f"{prefix}{layer}/"):
                    steps, vals = series(run.records, f"{prefix}{layer}/{sub}")
                    if steps:
                        ax.plot(steps, vals, style, color=color, lw=0.6, alpha=0.45)
    return drew


def _loss(ax, runs):
    drew = _plot_runs(ax, runs, "loss", label_suffix=" train")
    drew |= _plot_runs(ax, runs, "val_loss", style="--", marker="o", label_suffix=" val", lw=1.0)
    for si, source in enumerate(keys_under(runs, "val_loss/")):  # a run's colour, a line style per source
        drew |= _plot_runs(ax, runs, f"val_loss/{source}", style=STYLES[(si + 2) % len(STYLES)], marker="s",
                           lw=1.0, label_suffix=f" val {source}")
    ax.set_ylabel("cross-entropy (nats/token)")
    return drew


def _families(ax, runs, prefix: str, log: bool = False) -> bool:
    drew = False
    for fi, fam in enumerate(keys_under(runs, prefix)):
        drew |= _plot_runs(ax, runs, prefix + fam, style=STYLES[fi % len(STYLES)], label_suffix=f" {fam}")
    if drew and log:
        ax.set_yscale("log")
    return drew


def _grad_norm(ax, runs):
    drew = _plot_runs(ax, runs, "grad_norm", label_suffix=" all", lw=1.6)
    for fi, fam in enumerate(keys_under(runs, "optim/grad_norm/")):
        drew |= _plot_runs(ax, runs, f"optim/grad_norm/{fam}", style=STYLES[(fi + 1) % len(STYLES)],
                           label_suffix=f" {fam}")
    return drew


PANELS: List[Tuple[str, Callable[[Any, Sequence[Run]], bool], str]] = [
    ("loss (train; val: markers)", _loss, ""),
    ("learning rate", lambda ax, runs: _plot_runs(ax, runs, "lr"), "lr"),
    ("tokens/s", lambda ax, runs: _plot_runs(ax, runs, "tokens_per_s"), "tokens/s"),
    ("MFU (%)", lambda ax, runs: _plot_runs(ax, runs, "mfu", scale=100.0), "%"),
    ("gradient norm (all; per optimizer family)", _grad_norm, "norm"),
    ("update RMS per optimizer family", lambda ax, runs: _families(ax, runs, "optim/update_rms/", log=True),
     "RMS"),
    ("QK max logit (worst MLA head)", lambda ax, runs: _plot_runs(ax, runs, "qk_max_logit"), "scaled logit"),
    ("QK max logit per layer (thin: heads)", lambda ax, runs: _per_layer(ax, runs, "qk_max_logit/", "h"),
     "scaled logit"),
    ("QK-Clip: fraction of heads clipped", lambda ax, runs: _plot_runs(ax, runs, "qk_clipped_frac"),
     "fraction"),
    ("KDA decay exp(g): mean per layer", lambda ax, runs: _per_layer(ax, runs, "kda/decay_mean/"), "decay"),
    ("KDA decay exp(g): min per layer", lambda ax, runs: _per_layer(ax, runs, "kda/decay_min/"), "decay"),
    ("KDA beta: mean per layer", lambda ax, runs: _per_layer(ax, runs, "kda/beta_mean/"), "beta"),
    ("MoE load: max / mean tokens per expert",
     lambda ax, runs: _per_layer(ax, runs, "moe/load_max_over_mean/"), "ratio"),
]
ATTNRES_TITLE = "AttnRes weights"


def _last_attnres(run: Run) -> Tuple[Optional[Matrix], Optional[int]]:
    for r in reversed(run.records):
        m = attnres_matrix(r)
        if m[0]:
            return m, r.get("step")
    return None, None


def draw(run_dirs: Sequence[Path], out: Path, columns: int = 3) -> Dashboard:
    """The dashboard of `run_dirs` as one PNG at `out`."""
    runs = load_runs(run_dirs)
    if not any(run.records for run in runs):
        raise ValueError(f"no metrics records in {', '.join(map(str, run_dirs))}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matrix, step = _last_attnres(runs[0])
    # which panels have data: draw each on a scratch axis first (cheap at these sizes)
    scratch_fig, scratch = plt.subplots()
    have = []
    skipped = []
    for title, fn, ylabel in PANELS:
        scratch.cla()
        (have if fn(scratch, runs) else skipped).append((title, fn, ylabel))
    plt.close(scratch_fig)
    n = len(have) + (matrix is not None)
    cols = max(1, min(columns, n))
    nrows = math.ceil(n / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5.4 * cols, 3.7 * nrows), dpi=100, squeeze=False)
    flat = list(axes.flat)
    titles, lines = [], {}
    for ax, (title, fn, ylabel) in zip(flat, have):
        fn(ax, runs)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if ylabel:
            ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        lines[title] = labels
        if handles and len(handles) <= 16:
            ax.legend(fontsize=7)
        titles.append(title)
    if matrix is not None:
        ax = flat[len(have)]
        title = f"{ATTNRES_TITLE}: {runs[0].label}, step {step}"
        draw_heatmap(ax, fig, matrix, title, "source", "sublayer", "{:.2f}", "viridis", 0.0, 1.0)
        titles.append(title)
    for ax in flat[n:]:
        ax.axis("off")
    fig.suptitle("  vs  ".join(run.label for run in runs), fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / fig.get_size_inches()[1]))  # room for the title
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    size = tuple(int(x) for x in fig.get_size_inches() * fig.dpi)
    plt.close(fig)
    return Dashboard(out, titles, size, matrix, step, [t for t, _, _ in skipped], lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kimi.cli import keyvalue
    from kimi.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        args = keyvalue.parse(argv, {"runs": keyvalue.paths, "out": Path, "columns": keyvalue.positive_int},
                              "kimi.dashboard")
        if "runs" not in args:
            raise ConfigError("no runs: give the run directories, e.g. runs=[runs/a,runs/b]")
        d = draw(args["runs"], args.get("out") or args["runs"][0] / "dashboard.png", args.get("columns", 3))
    except (ConfigError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[dashboard] wrote {d.path} ({d.size[0]}x{d.size[1]} px): {len(d.panels)} panels: "
          + "; ".join(d.panels))
    if d.skipped:
        print(f"[dashboard] no data for: {'; '.join(d.skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
