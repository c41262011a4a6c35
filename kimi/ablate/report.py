"""The report of an ablation study: per-arm statistics over seeds, the plots and the results section
(README_section.md, and with docs=true the generated part of docs/ablations.md)."""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from . import records
from .study import ROOT, AblateError, Experiment, Run, load_experiment

# The papers' directions, set beside ours in the report (docs/ablations.md): the claim, the arm it is about,
# and the verdicts against the baseline that agree with it
PAPERS = {
    "ablate_optimizer": ("Moonlight (arXiv 2502.16982): Muon reaches AdamW's loss with about half the "
                         "training FLOPs (~2x compute efficiency)", "muonclip", ("win",)),
    "ablate_residual": ("Attention Residuals (arXiv 2603.15031): Block AttnRes matches the baseline trained "
                        "with ~1.25x the compute", "attnres_block", ("win",)),
    "ablate_mixer": ("Kimi Linear (arXiv 2510.26692): the 3:1 KDA:MLA hybrid is at least as good as all-MLA "
                     "attention", "hybrid_3to1", ("win", "tie")),
    **{f"ablate_depth{n}": ("Attention Residuals (arXiv 2603.15031): Block AttnRes matches the baseline "
                            "trained with ~1.25x the compute, a gain the paper reports growing with depth",
                            "attnres_block",
                            ("win",)) for n in (8, 16)},
    "ablate_k3_mla_gate": ("Gated attention (arXiv 2505.06708): a per-element sigmoid gate on the attention "
                           "output lowers perplexity and training instability", "gated", ("win",)),
    "ablate_k3_moe": ("Normalized LatentMoE (Kimi K3, as Megatron issue 6448 quotes it): the norm before the "
                      "up-projection stabilises training and improves validation loss", "latent_situ",
                      ("win", "tie")),
    "ablate_k3_kda_gate": ("Kimi K3's report (section 2.1.1): the lower-bounded gate is chosen so that every "
                           "chunk tile runs as tensor-core matmuls; it is trained with it, at no stated cost "
                           "in quality",
                           "safe", ("win", "tie")),
    "ablate_k3_muon_heads": ("Kimi K3's report (section 2.5, as torchtitan and DeepSpeed issue 8367 quote "
                             "it): orthogonalising each head's block keeps large-gradient heads from "
                             "dominating the update of Q, K and V", "per_head", ("win", "tie")),
    "ablate_k3_balance": ("Kimi K3's report (section 2.3.3): Quantile Balancing sets the router bias to the "
                          "exact minimiser of the balance objective the sign step only steps along, with no "
                          "step size to tune", "quantile", ("win", "tie")),
}


def paper_agreement(verdict: str, agreeing: Sequence[str]) -> str:
    """Whether our verdict on the paper's arm agrees with the paper's claim, said plainly."""
    if verdict in agreeing:
        return "this agrees with the paper"
    if verdict == "tie":
        return "the paper's gain is not seen at this scale: the difference is within the seed spread"
    if verdict == "loss":  # every claim counts a win as agreeing
        return "this disagrees with the paper: at this scale the arm loses to the baseline"
    return "no verdict yet to set beside the paper (the baseline or a second seed is missing)"


RULE = ("An arm wins (or loses) against the baseline only when the gap between their mean final validation "
        "losses is larger than the sum of their standard deviations over seeds; a smaller gap is a tie at "
        "this scale, and with one seed there is no verdict.")


# ---- report ------------------------------------------------------------------------------------------------
def tokens_to_reach(evals: List[dict], target: float) -> Optional[float]:
    """Training tokens at which validation loss first reaches target, linearly between evaluations (also
    bench/convergence.py's)."""
    for a, b in zip(evals, evals[1:]):
        if b["val_loss"] <= target:
            if a["val_loss"] <= target:
                return a["tokens"]
            frac = (a["val_loss"] - target) / (a["val_loss"] - b["val_loss"])
            return a["tokens"] + frac * (b["tokens"] - a["tokens"])
    return None


def _mean_std(xs: List[float]) -> Tuple[Optional[float], Optional[float]]:
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else None)


def _mean_curve(runs: List[dict]) -> List[dict]:
    """Validation loss at the evaluation steps every run has: mean and std over runs."""
    steps = sorted(set.intersection(*(set(e["step"] for e in r["evals"]) for r in runs))) if runs else []
    out = []
    for s in steps:
        vals = [next(e["val_loss"] for e in r["evals"] if e["step"] == s) for r in runs]
        mean, std = _mean_std(vals)
        out.append({"step": s, "tokens": s * runs[0]["tokens_per_step"], "val_loss": mean, "std": std or 0.0})
    return out


def _fmt(x: Optional[float], spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def _human(x: float) -> str:
    for unit, div in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.2f}{unit}"
    return f"{x:.0f}"


def analyse(exp: Experiment, root: Path, out: Path) -> Optional[dict]:
    """Every arm's statistics from the experiment's records (<out>/runs/<NAME>/) and its run dirs that have
    none yet (runs under way); None if it has no runs."""
    exp_dir = Path(root) / exp.name
    found = {r["run"]: r for r in records.of_experiment(out, exp.name) if exp.parse_name(r["run"])}
    for d in sorted(p for p in exp_dir.iterdir() if p.is_dir()) if exp_dir.is_dir() else []:
        parsed = exp.parse_name(d.name)
        if parsed and d.name not in found:
            info = records.summarise(Run(exp, *parsed, d))
            if info:
                found[d.name] = info
    runs = [found[k] for k in sorted(found)]
    if not runs:
        return None
    # the sweep: each arm's values with the lowest final loss on the sweep's seed (sweep.json's, else the
    # lowest seed)
    sweep = {}
    if exp.sweep:
        recorded = exp_dir / "sweep.json"
        rec_seed = json.loads(recorded.read_text()).get("seed") if recorded.is_file() else None
        for arm in exp.arms:
            mine = [r for r in runs if r["arm"] == arm]
            if not mine:
                continue
            seed = rec_seed if rec_seed in {r["seed"] for r in mine} else min(r["seed"] for r in mine)
            table = {json.dumps(r["values"], sort_keys=True): r for r in mine if r["seed"] == seed}
            done = [r for r in table.values() if r["final_val_loss"] is not None]
            best = min(done, key=lambda r: r["final_val_loss"])["values"] if done else None
            grid_values = [v for _, vals in exp.sweep for v in vals]
            edge = best is not None and any(best[k] in (vals[0], vals[-1]) for k, vals in exp.sweep)
            sweep[arm] = {"seed": seed, "chosen": best, "at_grid_edge": edge and len(grid_values) > 1,
                          "runs": [{"values": r["values"], "status": r["status"],
                                    "final_val_loss": r["final_val_loss"]} for r in table.values()]}
    arms_out = []
    for arm in exp.arms:
        mine = [r for r in runs if r["arm"] == arm
                and (not exp.sweep or (sweep.get(arm) and r["values"] == sweep[arm]["chosen"]))]
        done = [r for r in mine if r["final_val_loss"] is not None]
        if not mine:
            continue
        finals = [r["final_val_loss"] for r in sorted(done, key=lambda r: r["seed"])]
        mean, std = _mean_std(finals)
        ref = done[0] if done else mine[0]
        tps = [r["tokens_per_s"] for r in done if r["tokens_per_s"]]
        arms_out.append({
            "arm": arm, "values": ref["values"], "seeds": sorted(r["seed"] for r in done),
            "incomplete": sorted((r["run"], r["status"]) for r in mine if r["final_val_loss"] is None),
            "shared": sorted((r["run"], r["same_as"]) for r in done if r.get("same_as")),
            "final_val_loss": finals, "mean": mean, "std": std,
            "params": ref["params"], "flops_per_token": ref["flops_per_token"],
            "tokens": ref["max_steps"] * ref["tokens_per_step"],
            "train_flops": ref["flops_per_token"] * ref["max_steps"] * ref["tokens_per_step"],
            "tokens_per_s": statistics.fmean(tps) if tps else None,
            "train_seconds": statistics.fmean(r["train_seconds"] for r in done) if done else None,
            "qk_clip_tau": ref["qk_clip_tau"],
            "qk_clipped_frac_mean": _mean_std([r["qk_clipped_frac_mean"] for r in done
                                               if r["qk_clipped_frac_mean"] is not None])[0],
            "qk_max_logit_final": _mean_std([r["qk_max_logit_final"] for r in done
                                             if r["qk_max_logit_final"] is not None])[0],
            "curve": _mean_curve(done),
            "qk_max_logit": [r["qk_max_logit"] for r in sorted(done, key=lambda r: r["seed"])],
            "peak_flops": [r.get("peak_flops") for r in sorted(done, key=lambda r: r["seed"])],
        })
    base = next((a for a in arms_out if a["arm"] == exp.baseline and a["mean"] is not None), None)
    target = base["mean"] if base else None
    base_need = tokens_to_reach(base["curve"], target) if base else None
    for a in arms_out:
        a["delta"] = None if base is None or a["mean"] is None else a["mean"] - base["mean"]
        spread = None if base is None or a["std"] is None or base["std"] is None else a["std"] + base["std"]
        if a is base:
            a["verdict"] = "baseline"
        elif a["delta"] is None or spread is None:
            a["verdict"] = "no verdict (one seed)" if a["delta"] is not None else "no verdict"
        else:
            a["verdict"] = "win" if a["delta"] < -spread else "loss" if a["delta"] > spread else "tie"
        need = tokens_to_reach(a["curve"], target) if target is not None and a["curve"] else None
        a["tokens_to_baseline"] = need
        a["flops_to_baseline"] = None if need is None else need * a["flops_per_token"]
        a["compute_multiplier"] = (None if need is None or not base_need or not a["flops_to_baseline"] else
                                   base_need * base["flops_per_token"] / a["flops_to_baseline"])
    ref = runs[0]
    return {"experiment": exp.name, "baseline": exp.baseline, "rule": RULE, "root": _rel(exp_dir),
            "scale": {"steps": ref["max_steps"], "tokens_per_step": ref["tokens_per_step"]},
            "baseline_final_val_loss": target, "sweep": sweep, "arms": arms_out,
            "paper": PAPERS[exp.name][0] if exp.name in PAPERS else None,
            "failed": sorted(r["run"] for r in runs if r["status"] == "failed")}


def machines_note(arms: List[dict], same: float = 0.15) -> str:
    """Which machines an experiment's runs trained on, told apart by the peak their MFU divided by (a CPU's
    measured fp32 matmul rate; runs within `same` of each other count as one kind of machine)."""
    rates = [rate for a in arms for rate in a.get("peak_flops", [])]
    known = sorted(rate for rate in rates if rate)
    missing = len(rates) - len(known)
    kinds: List[List[float]] = []
    for rate in known:
        if kinds and rate <= kinds[-1][0] * (1 + same):
            kinds[-1].append(rate)
        else:
            kinds.append([rate])
    names = ", ".join(f"{statistics.median(k) / 1e9:.0f} GFLOP/s ({len(k)} run{'s' * (len(k) != 1)})"
                      for k in kinds)
    if not kinds:
        return "Machine: not in these records (they predate it), so tokens/s may mix machines."
    if len(kinds) == 1 and not missing:
        return f"Machine: one kind for every run (the peak MFU divides by: {names})."
    text = f"Machines, by the peak MFU divides by: {names}"
    if missing:
        text += f", and {missing} run{'s' * (missing != 1)} whose record predates it"
    return text + ": tokens/s compare only between runs of one machine."


def _band(ax, xs, mean, std, label, color=None):
    line, = ax.plot(xs, mean, "-", lw=1.6, label=label, color=color)
    lo = [m - s for m, s in zip(mean, std)]
    hi = [m + s for m, s in zip(mean, std)]
    ax.fill_between(xs, lo, hi, alpha=0.2, color=line.get_color())
    return line


def plot_experiment(result: dict, out: Path) -> Path:
    """Validation loss per arm (mean +- std over seeds) against tokens; QK max logit per arm when logged;
    the sweep's final losses when there is one."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in result["arms"] if a["curve"]]
    has_qk = any(trace for a in arms for trace in a["qk_max_logit"])
    panels = ["loss"] + (["qk"] if has_qk else []) + (["sweep"] if result["sweep"] else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.2), dpi=110, squeeze=False)
    axes = dict(zip(panels, axes[0]))
    ax = axes["loss"]
    tail = []
    for a in arms:
        xs = [p["tokens"] for p in a["curve"]]
        n = len(a["seeds"])
        label = (f"{a['arm']} ({n} seed{'s' * (n != 1)})"
                 + (" [baseline]" if a["arm"] == result["baseline"] else ""))
        _band(ax, xs, [p["val_loss"] for p in a["curve"]], [p["std"] for p in a["curve"]], label)
        tail += [p["val_loss"] + p["std"] for p in a["curve"] if p["tokens"] >= 0.25 * xs[-1]]
        tail += [p["val_loss"] - p["std"] for p in a["curve"] if p["tokens"] >= 0.25 * xs[-1]]
    if tail:  # the first evaluations (loss ~ log(vocab)) would flatten the comparison
        lo, hi = min(tail), max(tail)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    ax.set_xlabel("training tokens")
    ax.set_ylabel("validation loss (nats/token)")
    ax.set_title(f"{result['experiment']}: validation loss, mean +- std over seeds")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if "qk" in axes:
        ax = axes["qk"]
        for a in arms:
            traces = [t for t in a["qk_max_logit"] if t]
            if not traces:
                continue
            steps = sorted(set.intersection(*(set(s for s, _ in t) for t in traces)))
            vals = [[dict(t)[s] for s in steps] for t in traces]
            mean = [statistics.fmean(v[i] for v in vals) for i in range(len(steps))]
            std = [statistics.stdev(v[i] for v in vals) if len(vals) > 1 else 0.0 for i in range(len(steps))]
            line = _band(ax, steps, mean, std, a["arm"])
            tau = a["qk_clip_tau"]
            if tau and tau <= 2 * max(mean):
                ax.axhline(tau, ls=":", color=line.get_color(), lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("max scaled QK logit (all MLA heads)")
        ax.set_title("QK max logit (dotted: an arm's tau)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if "sweep" in axes:
        ax = axes["sweep"]
        for arm, s in result["sweep"].items():
            pts = sorted((float(next(iter(r["values"].values()))), r["final_val_loss"])
                         for r in s["runs"] if r["final_val_loss"] is not None and len(r["values"]) == 1)
            if pts:
                ax.plot(*zip(*pts), "o-", label=f"{arm} (seed {s['seed']})")
        ax.set_xscale("log")
        ax.set_xlabel(" ".join(k for k, _ in result.get("sweep_keys", [])) or "swept value")
        ax.set_ylabel("final validation loss")
        ax.set_title("the sweep (diverged runs are missing)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def plot_cost(results: List[dict], out: Path) -> Optional[Path]:
    """Final validation loss (mean +- std) against training FLOPs and against training seconds, every arm
    of every experiment."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(r["experiment"], a) for r in results for a in r["arms"] if a["mean"] is not None]
    if not points:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8), dpi=110)
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(e for e, _ in points))}
    for ax, key, label in ((axes[0], "train_flops", "training FLOPs (model, forward + backward)"),
                           (axes[1], "train_seconds", "training seconds (on the machines that ran them)")):
        seen, near = set(), {}
        xs = [a[key] for _, a in points if a[key]]
        ys = [a["mean"] for _, a in points]
        dx, dy = 0.02 * (max(xs) - min(xs)) if xs else 0.0, 0.02 * (max(ys) - min(ys))
        for name, a in points:
            if a[key] is None:
                continue
            ax.errorbar(a[key], a["mean"], yerr=a["std"] or 0.0, fmt="o", color=colors[name], capsize=3,
                        label=None if name in seen else name)
            seen.add(name)
            # arms at (nearly) the same point, e.g. the baseline configuration in several experiments:
            # their labels stacked instead of printed over each other
            spot = (round(a[key] / dx) if dx else 0, round(a["mean"] / dy) if dy else 0)
            k = near[spot] = near.get(spot, -1) + 1
            ax.annotate(a["arm"], (a[key], a["mean"]), fontsize=7, color=colors[name], xytext=(4, 3 + 8 * k),
                        textcoords="offset points")
        xs = [a[key] for _, a in points if a[key]]
        if xs and max(xs) > 3 * min(xs):
            ax.set_xscale("log")
        ax.set_xlabel(label)
        ax.set_ylabel("final validation loss, mean +- std over seeds")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_title("cost vs loss: every arm of every experiment")
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)
    return out


def markdown(results: List[dict], out_dir: Path, links_from: Optional[Path] = None) -> str:
    """The results section, generated from the results. Its plots are linked relative to `links_from` (the
    directory of the page that shows the section), or without it relative to the repository root."""
    lines = ["<!-- generated by `python -m kimi.ablate report`; do not edit by hand -->", ""]
    for r in results:
        base = r["baseline"]
        scale = r["scale"]
        lines += [f"**{r['experiment']}** ({scale['steps']} steps of {scale['tokens_per_step']:,} tokens; "
                  f"baseline `{base}`, final validation loss {_fmt(r['baseline_final_val_loss'])}):", ""]
        extra_qk = any(a["qk_clipped_frac_mean"] for a in r["arms"])  # QK-Clip acted in some arm
        head = ["arm", "params", "train FLOPs", "final val loss (mean +- std)", "seeds", "vs baseline",
                "verdict", "tokens to baseline's loss", "compute multiplier", "tokens/s"]
        if r["sweep"]:
            swept = sorted({k for s in r["sweep"].values() for k in (s["chosen"] or {})})
            head.insert(1, "chosen " + ", ".join(swept))
        if extra_qk:
            head += ["QK-Clip: heads clipped per step (mean)", "QK max logit at the end"]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for a in r["arms"]:
            std = f" +- {a['std']:.4f}" if a["std"] is not None else ""
            cells = [f"`{a['arm']}`", _human(a["params"]), _human(a["train_flops"]),
                     f"{_fmt(a['mean'])}{std}", str(len(a["seeds"])),
                     "-" if a["delta"] is None or a["arm"] == base else f"{a['delta']:+.4f}", a["verdict"],
                     "not reached" if a["tokens_to_baseline"] is None and a["mean"] is not None
                     else _fmt(a["tokens_to_baseline"], ",.0f"),
                     _fmt(a["compute_multiplier"], ".2f") + ("x" if a["compute_multiplier"] else ""),
                     _fmt(a["tokens_per_s"], ",.0f")]
            if r["sweep"]:
                s = r["sweep"].get(a["arm"], {})
                chosen = s.get("chosen") or {}
                edge = " (grid edge)" if s.get("at_grid_edge") else ""
                cells.insert(1, ", ".join(chosen.values()) + edge)
            if extra_qk:
                cells += [_fmt(a["qk_clipped_frac_mean"], ".3f"), _fmt(a["qk_max_logit_final"], ".2f")]
            lines.append("| " + " | ".join(cells) + " |")
        shared = [f"`{run}` is `{other}`" for a in r["arms"] for run, other in a["shared"]]
        if shared:
            lines += ["", "Trained once for two experiments (the same config and seed): " + "; ".join(shared)
                      + "."]
        if r["sweep"]:
            lines += ["", "The sweep (final validation loss on seed "
                      + ", ".join(sorted({str(s['seed']) for s in r['sweep'].values()})) + "):", ""]
            keys = {json.dumps(run["values"], sort_keys=True)
                    for s in r["sweep"].values() for run in s["runs"]}
            cols = sorted(keys, key=lambda k: [float(v) if _isfloat(v) else v
                                               for v in json.loads(k).values()])
            lines += ["| arm | " + " | ".join(", ".join(json.loads(c).values()) for c in cols) + " |",
                      "|" + "---|" * (len(cols) + 1)]
            for arm, s in r["sweep"].items():
                by = {json.dumps(run["values"], sort_keys=True): run for run in s["runs"]}
                lines.append(f"| `{arm}` | " + " | ".join(
                    "-" if c not in by else by[c]["status"] if by[c]["final_val_loss"] is None
                    else _fmt(by[c]["final_val_loss"]) for c in cols) + " |")
        if r["experiment"] in PAPERS:
            paper, ours, agreeing = PAPERS[r["experiment"]]
            arm = next((a for a in r["arms"] if a["arm"] == ours), None)
            if arm and arm["compute_multiplier"]:
                m = arm["compute_multiplier"]
                measured = (f"`{ours}` reached `{base}`'s final loss with {1 / m:.2f}x its training FLOPs (a "
                            f"compute multiplier of {m:.2f}x); verdict on the final loss: {arm['verdict']}")
            elif arm and arm["mean"] is not None:
                measured = (f"`{ours}` did not reach `{base}`'s final loss; verdict on the final loss: "
                            f"{arm['verdict']}")
            else:
                measured = "no finished runs of that arm"
            if arm and arm["mean"] is not None:
                measured += "; " + paper_agreement(arm["verdict"], agreeing)
            lines += ["", f"Papers: {paper}. Here: {measured}."]
        lines += ["", machines_note(r["arms"])]
        if r["failed"]:
            lines += ["", "Failed runs (not counted): " + ", ".join(f"`{f}`" for f in r["failed"]) + "."]
        lines += ["", f"![{r['experiment']}]({_rel(out_dir / (r['experiment'] + '.png'), links_from)})", ""]
    lines += [RULE + " The compute multiplier is the baseline's training FLOPs to its own final loss over "
              "the arm's FLOPs to the same loss (from the seed-mean curves, interpolated between "
              "evaluations): above 1 the arm is more compute-efficient. tokens/s is the training throughput "
              "(each run's median logging window, averaged over seeds), on the machines each experiment's "
              "line names; the training seconds of the cost plot follow from it.", "",
              f"![cost vs loss]({_rel(out_dir / 'cost_vs_loss.png', links_from)})", ""]
    return "\n".join(lines)


def _isfloat(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def _rel(p: Path, start: Optional[Path] = None) -> str:
    """p as a link: relative to `start` (a page's directory), or without it to the repository root (else as
    given)."""
    if start is not None:
        return Path(os.path.relpath(Path(p).resolve(), Path(start).resolve())).as_posix()
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


# The page that shows the results (docs/ablations.md) holds them between these two lines
DOCS_PAGE = ROOT / "docs" / "ablations.md"
SECTION_BEGIN = "<!-- ablation results: generated by python -m kimi.ablate report docs=true -->"
SECTION_END = "<!-- ablation results: end -->"


def into_page(page: Path, section: str) -> None:
    """Replace what stands between the page's two markers by the section."""
    text = Path(page).read_text()
    begin, end = text.find(SECTION_BEGIN), text.find(SECTION_END)
    if begin < 0 or end < begin:
        raise AblateError(f"{page} has no place for the results: put the lines {SECTION_BEGIN!r} and "
                          f"{SECTION_END!r} where they go")
    Path(page).write_text(text[:begin + len(SECTION_BEGIN)] + "\n" + section.strip() + "\n" + text[end:])


def report(names: Sequence[str], root: Path, out: Path, log=print,
           page: Optional[Path] = None) -> List[dict]:
    """Write the experiments' JSON, plots and results section into `out` (and, given `page`, the section
    into that file between its markers, its plots linked from the page's directory); returns the results."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        exp = load_experiment(name)
        result = analyse(exp, root, out)
        if result is None:
            log(f"[ablate] {name}: no runs in {Path(root) / name} or {records.path(out, name, '*')}")
            continue
        result["sweep_keys"] = exp.sweep
        (out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        plot_experiment(result, out / f"{name}.png")
        results.append(result)
        log(f"[ablate] {name}: wrote {out / (name + '.json')} and {out / (name + '.png')}")
    if not results:
        raise AblateError(f"no finished ablation runs under {root}: run python -m kimi.ablate NAME first")
    plot_cost(results, out / "cost_vs_loss.png")
    section = markdown(results, out)
    (out / "README_section.md").write_text(section)
    if page is not None:
        into_page(page, markdown(results, out, links_from=Path(page).parent))
        log(f"[ablate] {page}: the results section is replaced")
    log(section)
    log(f"[ablate] wrote {out / 'cost_vs_loss.png'} and {out / 'README_section.md'}")
    return results


