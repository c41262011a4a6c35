"""A finished run's record: what the report needs of it, kept beside the report
(``<out>/runs/<NAME>/<run>.json``) so that it outlives the run directory (checkpoints are not committed): a
study continues, and its report is redrawn, on another machine. Each record carries its run's config
fingerprint, so that a run whose training config equals one finished in another experiment (the default model
is an arm of several) reuses that result instead of training it again."""

from __future__ import annotations

import hashlib
import json
import statistics
from pathlib import Path
from typing import Any, Dict, Iterator, Optional, Tuple

from .state import status

# Keys of the composed config that do not change what is trained: where it is written, how it is logged, and
# which kernels compute the same attention (so that adding such a switch keeps earlier records current).
_NOT_TRAINING = ("logging", "trainer.run_dir", "model.attention_backend", "model.attention_deterministic")


def fingerprint(cfg: Dict[str, Any]) -> str:
    """A hash of a run's composed config (plain containers) without the keys that only name or log it."""
    cfg = json.loads(json.dumps(cfg))
    for key in _NOT_TRAINING:
        *parents, last = key.split(".")
        node = cfg
        for p in parents:
            node = node.get(p, {})
        node.pop(last, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def path(out: Path, experiment: str, run: str) -> Path:
    return Path(out) / "runs" / experiment / f"{run}.json"


def read(out: Path, experiment: str, run: str) -> Optional[dict]:
    p = path(out, experiment, run)
    return json.loads(p.read_text()) if p.is_file() else None


def write(out: Path, experiment: str, record: dict) -> Path:
    p = path(out, experiment, record["run"])
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(p)
    return p


def of_experiment(out: Path, experiment: str) -> Iterator[dict]:
    for p in sorted((Path(out) / "runs" / experiment).glob("*.json")):
        yield json.loads(p.read_text())


def find_done(out: Path, fp: str) -> Optional[dict]:
    """A finished (not shared) record of any experiment with this fingerprint, with its experiment's name."""
    for p in sorted((Path(out) / "runs").glob("*/*.json")):
        rec = json.loads(p.read_text())
        if rec.get("fingerprint") == fp and rec.get("status") == "done" and not rec.get("same_as"):
            return {**rec, "experiment": p.parent.name}
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


def summarise(run) -> Optional[dict]:
    """What the report needs of one run dir (a study.Run): its record without the fingerprint; None if it has
    no config.yaml yet."""
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
    # training speed: the median logging window's, so that a stretch slowed by other work on the machine
    # moves neither it nor the training time derived from it (evaluation and checkpoints excluded)
    rate = statistics.median(r["tokens_per_s"] for r in logged) if logged else None
    trained = logged[-1]["tokens"] if logged else 0
    clip = [r["qk_clipped_frac"] for r in records if "qk_clipped_frac" in r]
    logits = [(r["step"], r["qk_max_logit"]) for r in records if "qk_max_logit" in r]
    params, fpt = model_cost(cfg["model"], t["seq_len"])
    # what MFU divided by (on a CPU its fp32 matmul rate, measured at the run's start), from the logged MFU:
    # it tells the machines apart, so tokens/s are compared only between runs of one kind of machine
    peaks = [r["tokens_per_s"] * fpt / r["mfu"] for r in logged if r.get("mfu")]
    st = status(run.dir, max_steps)
    return {"run": run.name, "arm": run.arm, "values": run.values, "seed": run.seed,
            "status": st, "max_steps": max_steps, "tokens_per_step": tokens_per_step,
            "final_val_loss": next((e["val_loss"] for e in reversed(evals) if e["step"] == max_steps), None)
            if st == "done" else None,
            "evals": evals, "train_seconds": trained / rate if rate else 0.0, "tokens_per_s": rate,
            "peak_flops": statistics.median(peaks) if peaks else None,
            "params": params, "flops_per_token": fpt, "qk_clip_tau": cfg["optim"].get("qk_clip_tau"),
            "qk_clipped_frac_mean": sum(clip) / len(clip) if clip else None,
            "qk_max_logit": logits, "qk_max_logit_final": logits[-1][1] if logits else None}
