"""The experiments (conf/experiment/ablate_*.yaml) and their runs: planning, state, the lr sweep's choice,
and running them one after another as subprocesses of train.py (kimi/ablate/__init__.py says how)."""

from __future__ import annotations

import copy
import functools
import itertools
import json
import math
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kimi.cli.conf_dir import conf_dir

from . import records
from .state import exit_code, status

ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = conf_dir()
DEFAULT_ROOT = Path("runs/ablate")
DEFAULT_OUT = ROOT / "bench" / "results" / "ablations"
# `all` runs them in this order (the cheapest questions first would be another choice; this is the issue's)
ORDER = ("ablate_optimizer", "ablate_mixer", "ablate_residual", "ablate_qk_clip", "ablate_muon_split",
         "ablate_depth8", "ablate_depth16", "ablate_k3_balance", "ablate_k3_moe", "ablate_k3_mla_gate",
         "ablate_k3_kda_gate", "ablate_k3_muon_heads")


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


def started_steps(run_dir: Path) -> Optional[int]:
    """trainer.max_steps of the run dir's newest start (its config.yaml), None before one."""
    from omegaconf import OmegaConf

    try:
        return int(OmegaConf.load(run_dir / "config.yaml").trainer.max_steps)
    except Exception:  # noqa: BLE001 (no config.yaml yet, or one cut short)
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


def arm_config(exp: Experiment, arm: str, user: Sequence[str], run: Sequence[str] = ()) -> Dict[str, Any]:
    """An arm's config under the user's overrides (and a run's sweep values and seed), composed as train.py
    would compose it (which also refuses a misspelt override before hours of runs), as plain containers."""
    overrides = (f"+experiment={exp.name}", f"+{exp.arm_group}={arm}", *run, *user)
    return copy.deepcopy(_composed(overrides))


@functools.lru_cache(maxsize=None)
def _composed(overrides: Tuple[str, ...]) -> Dict[str, Any]:
    # A study plans, fingerprints and reports every run, each a second of Hydra's composition; the
    # configs do not change while it runs.
    from omegaconf import OmegaConf

    from kimi.cli import check_overrides
    from kimi.cli.conf_dir import compose
    from kimi.config import register_configs

    register_configs()
    try:
        cfg = compose(["trainer.run_dir=unused", *overrides])
    except Exception:  # noqa: BLE001 (Hydra's multi-line report; check_overrides says it in one line)
        check_overrides(list(overrides))
        raise
    return OmegaConf.to_container(cfg, resolve=False)


def run_config(run: Run, user: Sequence[str]) -> Dict[str, Any]:
    """The composed config the run trains with."""
    values = [f"{k}={v}" for k, v in run.values.items()]
    return arm_config(run.exp, run.arm, user, [*values, f"trainer.seed={run.seed}"])


def run_fingerprint(run: Run, user: Sequence[str]) -> str:
    """records.fingerprint of the config the run trains with."""
    return records.fingerprint(run_config(run, user))


def outcome(run: Run, out: Path, max_steps: int) -> Tuple[str, Optional[float]]:
    """(status, final validation loss) of a run: its record's if it has one, else its run dir's."""
    rec = records.read(out, run.exp.name, run.name)
    if rec is not None:
        return rec["status"], rec["final_val_loss"]
    st = status(run.dir, max_steps)
    return st, final_val_loss(run.dir, max_steps) if st == "done" else None


def record_run(run: Run, out: Path, cfg: Dict[str, Any]) -> None:
    """Write the record of a finished (done or failed) run dir trained with the composed config `cfg`."""
    info = records.summarise(run)
    if info is not None:
        records.write(out, run.exp.name, {**info, "fingerprint": records.fingerprint(cfg),
                                          "config": records.training_config(cfg)})


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
    from kimi.run.metrics import read_metrics

    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return None
    vals = [r["val_loss"] for r in read_metrics(path) if "val_loss" in r and r.get("step") == max_steps]
    return vals[-1] if vals else None


def choose(exp: Experiment, root: Path, out: Path, arm: str, seed: int,
           max_steps: int) -> Tuple[Optional[Dict[str, str]], dict]:
    """The sweep values of `arm` with the lowest final validation loss on `seed` (None until every sweep run
    is done or failed; a failed run counts as infinite loss), and the table {run name: loss or None}."""
    table, best, best_loss, pending = {}, None, math.inf, False
    for values in exp.grid():
        run = plan_run(exp, root, arm, values, seed)
        st, loss = outcome(run, out, max_steps)
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


def run_study(names: Sequence[str], root: Path, out: Path, seeds: Optional[Sequence[int]],
              user: Sequence[str], arms: Optional[Sequence[str]] = None, dry_run: bool = False,
              quiet: bool = False, retry_failed: bool = False, log=print) -> Dict[str, int]:
    """Run (or, dry, list) every run of the experiments `names`, keeping each finished run's record in `out`;
    returns counts by outcome."""
    counts = {"done": 0, "shared": 0, "trained": 0, "failed": 0, "skipped": 0, "planned": 0, "waiting": 0}
    root, out = Path(root).resolve(), Path(out)
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
            rec, cfg = records.read(out, name, run.name), run_config(run, user)
            differ = records.mismatch(rec, cfg) if rec is not None else []
            if differ:
                more = f" and {len(differ) - 1} more" if len(differ) > 1 else ""
                raise AblateError(f"{records.path(out, name, run.name)} records a run of another config than "
                                  f"this study trains ({differ[0]}{more}; another steps=, or other overrides "
                                  "after --?): give this study its own out= (and root=), or move that record "
                                  "away")
            st = rec["status"] if rec else status(run.dir, max_steps)
            if rec is None and st in ("done", "failed") and not dry_run:
                record_run(run, out, cfg)  # finished before records were kept, or its record was lost
            if st == "new":
                same = records.find_done(out, cfg)
                if same is not None:
                    counts["shared"] += 1
                    log(f"[ablate]   {run.name}: the same config and seed as {same['experiment']}/"
                        f"{same['run']}, which is done: its result is this run's too")
                    if not dry_run:
                        mine = {"run": run.name, "arm": run.arm, "values": run.values, "seed": run.seed,
                                "same_as": f"{same['experiment']}/{same['run']}"}
                        theirs = {k: v for k, v in same.items() if k != "experiment"}
                        records.write(out, name, {**theirs, **mine})
                    return "done"
            if st == "failed" and retry_failed and rec is not None and not dry_run:
                records.path(out, name, run.name).unlink()
            args = train_overrides(run, user)
            started = started_steps(run.dir)
            if st in ("partial", "failed") and started not in (None, max_steps):
                raise AblateError(f"{run.dir} was started with trainer.max_steps={started}, this study runs "
                                  f"{max_steps}: resuming would stretch its schedule. Use another root= (or "
                                  "the same steps=), or move that run away")
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
            if code in (0, 1, 2):
                record_run(run, out, cfg)
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
            best, table = choose(exp, root, out, arm, first, steps[arm])
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


