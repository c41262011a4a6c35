"""Ablation studies: one factor at a time at matched tokens, several seeds, and their report.

    python -m kimi.ablate NAME [NAME ...] [--seeds 1 2 3] [--steps N] [--arms ARM ...] [--root runs/ablate]
                          [--dry-run] [--quiet] [--retry-failed] [-- OVERRIDE ...]
    python -m kimi.ablate all                 # every experiment, one after another (the whole study)
    python -m kimi.ablate report [NAME ...]   # statistics, plots and a README section from the runs
    python -m kimi.ablate list                # the experiments and their arms

An experiment is a Hydra config, ``conf/experiment/<NAME>.yaml``: it includes the study's scale
(``conf/ablate/study.yaml``) and lists its arms (``conf/ablate/<NAME>/<ARM>.yaml``, each the overrides that
make it; the first arm is the baseline) and seeds in ``hydra.sweeper.params``, so Hydra's multirun runs the
same study: ``python train.py -m +experiment=NAME`` (arms x seeds, one process). This wrapper runs the same
runs instead as subprocesses of train.py, one after another, into the same run directories
(``<root>/<NAME>/<ARM>_seed<N>``), and resumes a study that was stopped: a run whose final checkpoint (at
trainer.max_steps) is complete is done and skipped, a run stopped half-way resumes from its newest
checkpoint, and a run that failed (its ``exit_code`` file says 1 or 2: a diverged lr) is skipped unless
``--retry-failed``. A run started with another trainer.max_steps (an earlier ``--steps``) is refused rather
than stretched. Ctrl-C lets the current run save a checkpoint, then stops the study.

Any other key in ``hydra.sweeper.params`` is a sweep run on the first seed only (``ablate_optimizer``'s
``optim.lr``): each arm's value with the lowest final validation loss is chosen (recorded in
``<root>/<NAME>/sweep.json``) and the other seeds run at that value only. Those runs are named
``<ARM>_<key's last part><value>_seed<N>`` (``adamw_lr0.003_seed1``), as the multirun names them.

When the config has them (``logging.wandb.group`` / ``.tags``), every run is grouped under its experiment and
tagged with its arm and seed (docs/dashboards.md); ``logging.wandb.name`` is ``<NAME>/<run directory>``.

``report`` reads the finished runs and writes, per experiment, ``<out>/<NAME>.json`` and ``<out>/<NAME>.png``
(validation loss per arm, mean +- std over seeds), ``<out>/cost_vs_loss.png`` over all experiments, and
``<out>/README_section.md``, which it also prints (docs/ablations.md says what each number means).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
CONF_DIR = ROOT / "conf"
DEFAULT_ROOT = Path("runs/ablate")
DEFAULT_OUT = ROOT / "bench" / "results" / "ablations"
# `all` runs them in this order (the cheapest questions first would be another choice; this is the issue's)
ORDER = ("ablate_optimizer", "ablate_mixer", "ablate_residual", "ablate_qk_clip", "ablate_muon_split")

# The papers' directions, set beside ours in the report (docs/ablations.md)
PAPERS = {
    "ablate_optimizer": ("Moonlight (arXiv 2502.16982): Muon reaches AdamW's loss with about half the "
                         "training FLOPs (~2x compute efficiency)", "muonclip"),
    "ablate_residual": ("Attention Residuals (arXiv 2603.15031): Block AttnRes matches the baseline trained "
                        "with ~1.25x the compute", "attnres_block"),
    "ablate_mixer": ("Kimi Linear (arXiv 2510.26692): the 3:1 KDA:MLA hybrid is at least as good as all-MLA "
                     "attention", "hybrid_3to1"),
}
RULE = ("An arm wins (or loses) against the baseline only when the gap between their mean final validation "
        "losses is larger than the sum of their standard deviations over seeds; a smaller gap is a tie at "
        "this scale, and with one seed there is no verdict.")


class AblateError(RuntimeError):
    """A problem with an experiment's definition or the command line; printed as one line (exit code 2)."""


# ---- experiments -------------------------------------------------------------------------------------------
@dataclass
class Experiment:
    name: str
    arms: List[str]  # the first is the baseline
    sweep: List[Tuple[str, List[str]]]  # (key, values as Hydra writes them): ("optim.lr", ["0.001", ...])
    seeds: List[int]  # the file's default seeds
    path: Path

    @property
    def baseline(self) -> str:
        return self.arms[0]

    @property
    def arm_group(self) -> str:
        return f"ablate/{self.name}"

    def run_name(self, arm: str, values: Dict[str, str], seed: int) -> str:
        """The run directory's name, as hydra.sweep.subdir writes it: <arm>[_<short><value>...]_seed<N>."""
        return arm + "".join(f"_{_short(k)}{values[k]}" for k, _ in self.sweep) + f"_seed{seed}"

    def subdir_template(self) -> str:
        return ("${hydra:runtime.choices." + self.arm_group + "}"
                + "".join(f"_{_short(k)}${{{k}}}" for k, _ in self.sweep) + "_seed${trainer.seed}")

    def grid(self) -> List[Dict[str, str]]:
        """Every combination of the sweep's values ([{}] without a sweep)."""
        keys = [k for k, _ in self.sweep]
        return [dict(zip(keys, combo)) for combo in itertools.product(*(v for _, v in self.sweep))]

    def parse_name(self, name: str) -> Optional[Tuple[str, Dict[str, str], int]]:
        """(arm, sweep values, seed) of a run directory's name; None if it is not one of this experiment's."""
        m = re.fullmatch(r"(.+)_seed(\d+)", name)
        if not m:
            return None
        head, seed = m.group(1), int(m.group(2))
        for arm in sorted(self.arms, key=len, reverse=True):  # the longest arm name that fits
            if not head.startswith(arm):
                continue
            rest, values = head[len(arm):], {}
            for key, _ in self.sweep:
                prefix = f"_{_short(key)}"
                nxt = re.match(re.escape(prefix) + r"(.+?)(?=_[a-z]|$)", rest)
                if not nxt:
                    break
                values[key], rest = nxt.group(1), rest[nxt.end():]
            else:
                if not rest:
                    return arm, values, seed
        return None


def _short(key: str) -> str:
    return key.rsplit(".", 1)[-1]


def experiment_names() -> List[str]:
    found = sorted(p.stem for p in (CONF_DIR / "experiment").glob("ablate_*.yaml"))
    return [n for n in ORDER if n in found] + [n for n in found if n not in ORDER]


def load_experiment(name: str) -> Experiment:
    """conf/experiment/<name>.yaml's arms, sweep and seeds (hydra.sweeper.params), checked against its arm
    files and its hydra.sweep.subdir (which must name runs as this module does)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    path = CONF_DIR / "experiment" / f"{name}.yaml"
    if not path.is_file():
        raise AblateError(f"no experiment {name!r}: choose one of {' '.join(experiment_names())} "
                          "(conf/experiment/ablate_*.yaml), or `all`")
    cfg = OmegaConf.load(path)
    params = OmegaConf.select(cfg, "hydra.sweeper.params") or {}
    parser = OverridesParser.create()
    arms, sweep, seeds = None, [], None
    for key, value in params.items():
        o = parser.parse_override(f"{key}={value}")
        values = list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
        if o.key_or_group == f"ablate/{name}":
            arms = values
        elif o.key_or_group == "trainer.seed":
            seeds = [int(v) for v in values]
        else:
            sweep.append((o.key_or_group, values))
    if not arms:
        raise AblateError(f"{path}: hydra.sweeper.params has no +ablate/{name} (the arms)")
    missing = [a for a in arms if not (CONF_DIR / "ablate" / name / f"{a}.yaml").is_file()]
    if missing:
        raise AblateError(f"{path}: arms without a file in conf/ablate/{name}/: {' '.join(missing)}")
    exp = Experiment(name, arms, sweep, seeds or [1], path)
    raw = OmegaConf.to_container(cfg, resolve=False).get("hydra", {}).get("sweep", {}).get("subdir")
    if raw != exp.subdir_template():
        raise AblateError(f"{path}: hydra.sweep.subdir is {raw!r}; it must be {exp.subdir_template()!r} so "
                          "that the multirun and python -m kimi.ablate name the runs alike")
    return exp


# ---- runs --------------------------------------------------------------------------------------------------
@dataclass
class Run:
    exp: Experiment
    arm: str
    values: Dict[str, str]
    seed: int
    dir: Path

    @property
    def name(self) -> str:
        return self.dir.name


def plan_run(exp: Experiment, root: Path, arm: str, values: Dict[str, str], seed: int) -> Run:
    return Run(exp, arm, values, seed, root / exp.name / exp.run_name(arm, values, seed))


def complete_at(run_dir: Path, step: int) -> bool:
    """Whether the run dir holds a complete checkpoint of `step` (its COMPLETE marker is written last)."""
    return (run_dir / "checkpoints" / f"step_{step:08d}" / "COMPLETE").is_file()


def exit_code(run_dir: Path) -> Optional[int]:
    try:
        return int((run_dir / "exit_code").read_text().strip())
    except (OSError, ValueError):
        return None


def status(run_dir: Path, max_steps: int) -> str:
    """done (a complete final checkpoint), failed (exit code 1 or 2 and no final checkpoint), partial
    (started, not finished: it resumes) or new."""
    if complete_at(run_dir, max_steps):
        return "done"
    if exit_code(run_dir) in (1, 2):
        return "failed"
    return "partial" if run_dir.exists() else "new"


def started_steps(run_dir: Path) -> Optional[int]:
    """trainer.max_steps of the run dir's newest start (its config.yaml), None before one."""
    from omegaconf import OmegaConf

    try:
        return int(OmegaConf.load(run_dir / "config.yaml").trainer.max_steps)
    except Exception:  # noqa: BLE001: no config.yaml yet, or one cut short
        return None


def wandb_overrides(run: Run) -> List[str]:
    """wandb's run name, and its group (the experiment) and tags (arm, seed, sweep values) where the config
    has those keys (logging.wandb.group / .tags)."""
    from kimi.config import WandbConfig

    have = {f.name for f in fields(WandbConfig)}
    out = [f"logging.wandb.name={run.exp.name}/{run.name}"]
    if "group" in have:
        out.append(f"logging.wandb.group={run.exp.name}")
    if "tags" in have:
        tags = [run.arm, f"seed={run.seed}", *(f"{_short(k)}={v}" for k, v in run.values.items())]
        out.append("logging.wandb.tags=[" + ",".join(f"'{t}'" for t in tags) + "]")
    return out


def train_overrides(run: Run, user: Sequence[str]) -> List[str]:
    """train.py's arguments for a run: the experiment, its arm, the sweep values and seed, wandb, then the
    user's overrides (which win), and the run dir."""
    return [f"+experiment={run.exp.name}", f"+{run.exp.arm_group}={run.arm}",
            *(f"{k}={v}" for k, v in run.values.items()), f"trainer.seed={run.seed}", *wandb_overrides(run),
            *user, f"hydra.run.dir={run.dir}"]


def arm_config(exp: Experiment, arm: str, user: Sequence[str]) -> Dict[str, Any]:
    """An arm's config under the user's overrides, composed as train.py would compose it (which also refuses
    a misspelt override before hours of runs), as plain containers."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kimi.cli import check_overrides
    from kimi.config import register_configs

    register_configs()
    check_overrides([f"+experiment={exp.name}", f"+{exp.arm_group}={arm}", *user], str(CONF_DIR))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=["trainer.run_dir=unused", f"+experiment={exp.name}",
                                           f"+{exp.arm_group}={arm}", *user])
    return OmegaConf.to_container(cfg, resolve=False)


def check_factor_kept(exp: Experiment, configs: Dict[str, Dict[str, Any]], user: Sequence[str]) -> None:
    """Refuse overrides that would erase what the experiment varies: a sweep key, or a key that makes two arms
    the same config (an override after `--` applies to every arm alike)."""
    keys = {u.split("=", 1)[0].lstrip("+~") for u in user if "=" in u}
    swept = sorted(keys & {k for k, _ in exp.sweep})
    if swept:
        raise AblateError(f"{exp.name} sweeps {' '.join(swept)}: an override of it after -- would make every "
                          "sweep run alike; change the sweep in " + str(exp.path.relative_to(ROOT)))
    arms = list(configs)
    same = [(a, b) for i, a in enumerate(arms) for b in arms[i + 1:] if configs[a] == configs[b]]
    if same:
        a, b = same[0]
        raise AblateError(f"{exp.name}'s arms {a} and {b} are the same config under the overrides after "
                          f"--: one of them sets what the arms vary (conf/ablate/{exp.name}/*.yaml); "
                          "leave it out")


def final_val_loss(run_dir: Path, max_steps: int) -> Optional[float]:
    """The validation loss logged at max_steps (None if there is none)."""
    from kimi.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    vals = [r["val_loss"] for r in read_metrics(path) if "val_loss" in r and r.get("step") == max_steps]
    return vals[-1] if vals else None


def choose(exp: Experiment, root: Path, arm: str, seed: int,
           max_steps: int) -> Tuple[Optional[Dict[str, str]], dict]:
    """The sweep values of `arm` with the lowest final validation loss on `seed` (None until every sweep run
    is done or failed; a failed run counts as infinite loss), and the table {run name: loss or None}."""
    table, best, best_loss, pending = {}, None, math.inf, False
    for values in exp.grid():
        run = plan_run(exp, root, arm, values, seed)
        st = status(run.dir, max_steps)
        loss = final_val_loss(run.dir, max_steps) if st == "done" else None
        table[run.name] = {"values": values, "status": st, "final_val_loss": loss}
        if st in ("new", "partial"):
            pending = True
        elif loss is not None and math.isfinite(loss) and loss < best_loss:
            best, best_loss = values, loss
    return (None if pending else best), table


def _run_train(run: Run, overrides: List[str], quiet: bool) -> int:
    """train.py in a subprocess. Ctrl-C reaches it too: it finishes its step and saves a checkpoint, which is
    waited for (a second Ctrl-C stops it at once), then the study stops."""
    cmd = [sys.executable, str(ROOT / "train.py"), *overrides]
    err = None
    if quiet:
        run.dir.parent.mkdir(parents=True, exist_ok=True)
        err = open(run.dir.parent / f".{run.name}.stderr", "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL if quiet else None, stderr=err)
    try:
        try:
            return proc.wait()
        except KeyboardInterrupt:
            print(f"\n[ablate] interrupted: waiting for {run.name} to save its checkpoint (Ctrl-C again "
                  "stops it at once); rerun the same command to continue the study", flush=True)
            try:
                proc.wait()
            except KeyboardInterrupt:
                proc.kill()
                proc.wait()
            raise
    finally:
        if err is not None:
            err.close()
            if proc.returncode not in (0, None):
                tail = Path(err.name).read_text().strip().splitlines()[-5:]
                print("\n".join(f"    {line}" for line in tail), flush=True)


def run_study(names: Sequence[str], root: Path, seeds: Optional[Sequence[int]], user: Sequence[str],
              arms: Optional[Sequence[str]] = None, dry_run: bool = False, quiet: bool = False,
              retry_failed: bool = False, log=print) -> Dict[str, int]:
    """Run (or, dry, list) every run of the experiments `names`; returns counts by outcome."""
    counts = {"done": 0, "trained": 0, "failed": 0, "skipped": 0, "planned": 0, "waiting": 0}
    root = Path(root).resolve()
    for name in names:
        exp = load_experiment(name)
        chosen_arms = list(arms) if arms else exp.arms
        unknown = [a for a in chosen_arms if a not in exp.arms]
        if unknown:
            raise AblateError(f"{name} has no arm {' '.join(unknown)}: its arms are {' '.join(exp.arms)}")
        exp_seeds = list(seeds) if seeds else exp.seeds
        configs = {a: arm_config(exp, a, user) for a in chosen_arms}
        check_factor_kept(exp, configs, user)
        steps = {a: int(c["trainer"]["max_steps"]) for a, c in configs.items()}
        swept = "".join(f"; sweep {k} over {' '.join(v)} on seed {exp_seeds[0]}" for k, v in exp.sweep)
        log(f"[ablate] {name}: arms {' '.join(chosen_arms)} (baseline {exp.baseline}), seeds "
            f"{' '.join(map(str, exp_seeds))}, {steps[chosen_arms[0]]} steps{swept}; runs in {root / name}")

        def one(run: Run, max_steps: int) -> str:
            st = status(run.dir, max_steps)
            args = train_overrides(run, user)
            started = started_steps(run.dir)
            if st in ("partial", "failed") and started not in (None, max_steps):
                raise AblateError(f"{run.dir} was started with trainer.max_steps={started}, this study runs "
                                  f"{max_steps}: resuming would stretch its schedule. Use another --root (or "
                                  "the same --steps), or move that run away")
            if st == "done" or (st == "failed" and not retry_failed):
                counts["done" if st == "done" else "skipped"] += 1
                why = ("" if st == "done" else
                       f" (failed with exit code {exit_code(run.dir)}; --retry-failed reruns it)")
                log(f"[ablate]   {run.name}: {st}{why}")
                return st
            if dry_run:
                counts["planned"] += 1
                log(f"[ablate]   {run.name}: {st}, would run: train.py {shlex.join(args)}")
                return st
            how = "resuming" if st == "partial" else "training"
            log(f"[ablate]   {run.name}: {how}" + (f" (its output: {run.dir}/train.log)" if quiet else
                                                   f": train.py {shlex.join(args)}"))
            sys.stdout.flush()
            t0 = time.perf_counter()
            code = _run_train(run, args, quiet)
            took = time.perf_counter() - t0
            if code == 0:
                counts["trained"] += 1
                log(f"[ablate]   {run.name}: done in {took:.0f} s")
                return "done"
            if code in (75, 130):
                raise KeyboardInterrupt
            counts["failed"] += 1
            log(f"[ablate]   {run.name}: failed with exit code {code} after {took:.0f} s "
                f"(see {run.dir}/train.log)")
            return "failed"

        if not exp.sweep:
            for arm in chosen_arms:
                for seed in exp_seeds:
                    one(plan_run(exp, root, arm, {}, seed), steps[arm])
            continue
        first, rest = exp_seeds[0], exp_seeds[1:]
        for arm in chosen_arms:  # the sweep, on the first seed
            for values in exp.grid():
                one(plan_run(exp, root, arm, values, first), steps[arm])
        record_path = root / name / "sweep.json"
        record = json.loads(record_path.read_text()) if record_path.is_file() else {}
        record.update({"seed": first, "grid": {k: v for k, v in exp.sweep}, "rule": "lowest final val_loss"})
        for arm in chosen_arms:
            best, table = choose(exp, root, arm, first, steps[arm])
            record.setdefault("arms", {})[arm] = {"chosen": best, "runs": table}
            if best is None:
                if rest:
                    counts["waiting"] += len(rest)
                    keys = " ".join(k for k, _ in exp.sweep)
                    log(f"[ablate]   {arm}: seeds {' '.join(map(str, rest))} wait for the sweep's best "
                        f"{keys} (the sweep is not finished, or all of it failed)")
                continue
            log(f"[ablate]   {arm}: the sweep chose " + " ".join(f"{k}={v}" for k, v in best.items()))
            for seed in rest:
                one(plan_run(exp, root, arm, best, seed), steps[arm])
        if not dry_run:
            record_path.parent.mkdir(parents=True, exist_ok=True)
            record_path.write_text(json.dumps(record, indent=2) + "\n")
    return counts


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


_COST_CACHE: Dict[str, Tuple[int, float]] = {}


def model_cost(model: Dict[str, Any], seq_len: int) -> Tuple[int, float]:
    """(parameters, training FLOPs per token) of a run's model config, built on the meta device."""
    key = json.dumps([model, seq_len], sort_keys=True)
    if key not in _COST_CACHE:
        import torch

        from kimi.config import ModelConfig
        from kimi.model import KimiModel

        with torch.device("meta"):
            m = KimiModel(ModelConfig(**model))
        _COST_CACHE[key] = (m.num_params(), m.flops_per_token(seq_len))
    return _COST_CACHE[key]


def read_run(run: Run) -> Optional[dict]:
    """What the report needs of one run dir; None if it has no config.yaml yet."""
    from omegaconf import OmegaConf

    from kimi.metrics import read_metrics

    cfg_path, metrics = run.dir / "config.yaml", run.dir / "metrics.jsonl"
    if not cfg_path.is_file() or not metrics.is_file():
        return None
    cfg = OmegaConf.to_container(OmegaConf.load(cfg_path))
    t = cfg["trainer"]
    max_steps, tokens_per_step = t["max_steps"], t["micro_batch_size"] * t["seq_len"] * t["grad_accum_steps"]
    records = read_metrics(metrics)
    logged = [r for r in records if "tokens_per_s" in r and r.get("tokens_per_s")]
    if logged and logged[0].get("tokens"):
        tokens_per_step = round(logged[0]["tokens"] / logged[0]["step"])  # all ranks together
    evals = [{"step": r["step"], "tokens": r["step"] * tokens_per_step, "val_loss": r["val_loss"]}
             for r in records if "val_loss" in r]
    seconds, prev = 0.0, 0
    for r in logged:  # training time only: each logging window's tokens over its rate
        seconds += (r["tokens"] - prev) / r["tokens_per_s"]
        prev = r["tokens"]
    clip = [r["qk_clipped_frac"] for r in records if "qk_clipped_frac" in r]
    logits = [(r["step"], r["qk_max_logit"]) for r in records if "qk_max_logit" in r]
    params, fpt = model_cost(cfg["model"], t["seq_len"])
    st = status(run.dir, max_steps)
    return {"run": run.name, "dir": str(run.dir), "arm": run.arm, "values": run.values, "seed": run.seed,
            "status": st, "max_steps": max_steps, "tokens_per_step": tokens_per_step,
            "final_val_loss": next((e["val_loss"] for e in reversed(evals) if e["step"] == max_steps), None)
            if st == "done" else None,
            "evals": evals, "train_seconds": seconds, "tokens_per_s": prev / seconds if seconds else None,
            "params": params, "flops_per_token": fpt, "qk_clip_tau": cfg["optim"].get("qk_clip_tau"),
            "qk_clipped_frac_mean": sum(clip) / len(clip) if clip else None,
            "qk_max_logit": logits, "qk_max_logit_final": logits[-1][1] if logits else None}


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


def analyse(exp: Experiment, root: Path) -> Optional[dict]:
    """Every arm's statistics from the experiment's run dirs (None if it has no runs)."""
    exp_dir = Path(root) / exp.name
    if not exp_dir.is_dir():
        return None
    runs = []
    for d in sorted(p for p in exp_dir.iterdir() if p.is_dir()):
        parsed = exp.parse_name(d.name)
        if parsed:
            info = read_run(Run(exp, *parsed, d))
            if info:
                runs.append(info)
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
    return {"experiment": exp.name, "baseline": exp.baseline, "rule": RULE, "root": str(exp_dir),
            "scale": {"steps": ref["max_steps"], "tokens_per_step": ref["tokens_per_step"]},
            "baseline_final_val_loss": target, "sweep": sweep, "arms": arms_out,
            "paper": PAPERS.get(exp.name, (None, None))[0],
            "failed": sorted(r["run"] for r in runs if r["status"] == "failed")}


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
                           (axes[1], "train_seconds", "training seconds (this machine)")):
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


def markdown(results: List[dict], out_dir: Path) -> str:
    """The README section, generated from the results."""
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
        paper, ours = PAPERS.get(r["experiment"], (None, None))
        if paper:
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
            lines += ["", f"Papers: {paper}. Here: {measured}."]
        if r["failed"]:
            lines += ["", "Failed runs (not counted): " + ", ".join(f"`{f}`" for f in r["failed"]) + "."]
        lines += ["", f"![{r['experiment']}]({_rel(out_dir / (r['experiment'] + '.png'))})", ""]
    lines += [RULE + " The compute multiplier is the baseline's training FLOPs to its own final loss over "
              "the arm's FLOPs to the same loss (from the seed-mean curves, interpolated between "
              "evaluations): above 1 the arm is more compute-efficient. tokens/s is the mean training "
              "throughput on the machine the runs shared.", "",
              f"![cost vs loss]({_rel(out_dir / 'cost_vs_loss.png')})", ""]
    return "\n".join(lines)


def _isfloat(v: str) -> bool:
    try:
        float(v)
        return True
    except ValueError:
        return False


def _rel(p: Path) -> str:
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def report(names: Sequence[str], root: Path, out: Path, log=print) -> List[dict]:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        exp = load_experiment(name)
        result = analyse(exp, root)
        if result is None:
            log(f"[ablate] {name}: no runs in {Path(root) / name}")
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
    log(section)
    log(f"[ablate] wrote {out / 'cost_vs_loss.png'} and {out / 'README_section.md'}")
    return results


# ---- command line ------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    overrides: List[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(prog="python -m kimi.ablate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="+", metavar="NAME",
                        help="experiments (conf/experiment/ablate_*.yaml) or all; report [NAME...]; list")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds (default: the experiment file's, 1 2 3)")
    parser.add_argument("--steps", type=int, help="trainer.max_steps of every run (default: the study's 600)")
    parser.add_argument("--arms", nargs="+", help="run only these arms")
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT, help="the runs' directory (runs/ablate)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="report: the JSON, PNGs and README section go here (bench/results/ablations)")
    parser.add_argument("--dry-run", action="store_true", help="list the runs and their state; train nothing")
    parser.add_argument("--quiet", action="store_true", help="train.py's output only in each run's train.log")
    parser.add_argument("--retry-failed", action="store_true", help="rerun failed runs (exit code 1 or 2)")
    args = parser.parse_args(argv)
    try:
        if args.names[0] == "list":
            for name in experiment_names():
                exp = load_experiment(name)
                sweep = "".join(f"; sweep {k} over {' '.join(v)}" for k, v in exp.sweep)
                print(f"{name}: arms {' '.join(exp.arms)} (baseline {exp.baseline}); seeds "
                      f"{' '.join(map(str, exp.seeds))}{sweep}")
            return 0
        if args.names[0] == "report":
            names = args.names[1:] or [n for n in experiment_names() if (args.root / n).is_dir()]
            report(names, args.root, args.out)
            return 0
        names = experiment_names() if args.names == ["all"] else args.names
        user = ([f"trainer.max_steps={args.steps}"] if args.steps else []) + overrides
        counts = run_study(names, args.root, args.seeds, user, args.arms, args.dry_run, args.quiet,
                           args.retry_failed)
    except AblateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("[ablate] stopped; rerun the same command to continue", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001: a config error from composing the overrides
        from kimi.cli import exit_code_for

        if exit_code_for(e) is None:
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return exit_code_for(e)
    summary = ", ".join(f"{v} {k}" for k, v in counts.items() if v)
    print(f"[ablate] {summary or 'nothing to do'}; report: python -m kimi.ablate report "
          + " ".join(names) + (f" --root {args.root}" if args.root != DEFAULT_ROOT else ""))
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
