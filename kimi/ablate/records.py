"""A finished run's record: what the report needs of it, kept beside the report
(``<out>/runs/<NAME>/<run>.json``) so that it outlives the run directory (checkpoints are not committed): a
study continues, and its report is redrawn, on another machine.

Each record carries the config its run trained with (``config``: the composed config as dotted keys, without
the keys that only name, log or place a run). A study compares it with the config it would train now key by
key, a key added to the schema since counting as the same when it is at its default, so that adding a config
key (a new feature, off by default) keeps every earlier record current, while a changed value is named. The
same comparison finds a finished run of another experiment with the config of a new one (the default model is
an arm of several), whose result is then reused instead of trained again."""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from .state import status

# Keys of the composed config that do not change what is trained: where it is written, how it is logged, how
# many CPU threads or processes compute it (the token files do not depend on data.num_proc: kimi.data.pack's
# fingerprint leaves it out), which kernels compute the same attention, and the prompt of the sample printed
# after the last step.
_NOT_TRAINING = ("logging", "trainer.run_dir", "trainer.threads", "data.num_proc", "data.cache_dir",
                 "model.attention.backend", "model.attention.deterministic", "model.attnres.backend",
                 "trainer.sample_prompt")
# What the records of studies run before records kept their config hashed (kept to read those records)
_LEGACY_NOT_TRAINING = ("logging", "trainer.run_dir", "model.attention_backend",
                        "model.attention_deterministic")
# Settings that resolve by device, as the CPU the study trains on resolves them: a record of either value is
# the same run there (optim.ns_dtype=auto became the default, fp32 on CPU, after 90 records said fp32)
_ON_CPU = {"optim.ns_dtype": {"auto": "fp32"}}
_ABSENT = object()


def _flat(node: Any, prefix: str = "") -> Dict[str, Any]:
    if not isinstance(node, dict):
        return {prefix: node}
    out: Dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return {k.rstrip("."): v for k, v in out.items()}


def _renamed(flat: Dict[str, Any]) -> Dict[str, Any]:
    """The model section's old flat keys (a record written before its sections) under their new names; an
    old key left null (a config composed today) is dropped."""
    from kimi.model.sections import ALIASES

    out = {}
    for k, v in flat.items():
        old = k.removeprefix("model.")
        if k.startswith("model.") and old in ALIASES:
            if v is None:
                continue
            k = f"model.{ALIASES[old]}"
        out[k] = v
    return out


def _training(flat: Dict[str, Any]) -> Dict[str, Any]:
    return {k: _on_cpu(k, v) for k, v in _renamed(flat).items()
            if not any(k == n or k.startswith(n + ".") for n in _NOT_TRAINING)}


def _on_cpu(key: str, value: Any) -> Any:
    return _ON_CPU[key].get(value, value) if key in _ON_CPU else value


def training_config(cfg: Dict[str, Any]) -> Dict[str, Any]:
    """A run's composed config (plain containers) as dotted keys, without the keys that do not change what
    is trained."""
    return _training(_flat(json.loads(json.dumps(cfg))))


@functools.cache
def schema_defaults() -> Dict[str, Any]:
    """Every key of the structured config schema (kimi/config.py) at its default, as dotted keys."""
    from omegaconf import OmegaConf

    from kimi.config import Config

    flat = _renamed(_flat(OmegaConf.to_container(OmegaConf.structured(Config), resolve=False)))
    return {k: _on_cpu(k, v) for k, v in flat.items()}


def differences(recorded: Dict[str, Any], current: Dict[str, Any]) -> List[str]:
    """The keys in which a recorded training config differs from the current one, one phrase each. A key only
    the current config has is a key added since: the same run when it is at its schema default."""
    defaults, out = schema_defaults(), []
    for key in sorted(set(recorded) | set(current)):
        old, new = recorded.get(key, _ABSENT), current.get(key, _ABSENT)
        if old is _ABSENT:
            if new != defaults.get(key, _ABSENT):
                out.append(f"{key}={new!r} (a key added since the record, not at its default "
                           f"{defaults.get(key)!r})")
        elif new is _ABSENT:
            out.append(f"{key} (recorded {old!r}) is no longer a config key")
        elif old != new:
            out.append(f"{key}: recorded {old!r}, now {new!r}")
    return out


def fingerprint(cfg: Dict[str, Any]) -> str:
    """A short hash of what defines a run: its training config as it differs from the schema's defaults."""
    defaults = schema_defaults()
    own = {k: v for k, v in training_config(cfg).items() if defaults.get(k, _ABSENT) != v}
    return hashlib.sha256(json.dumps(own, sort_keys=True).encode()).hexdigest()[:16]


def _legacy_fingerprint(cfg: Dict[str, Any]) -> str:
    cfg = json.loads(json.dumps(cfg))
    for key in _LEGACY_NOT_TRAINING:
        *parents, last = key.split(".")
        node = cfg
        for p in parents:
            node = node.get(p, {})
        node.pop(last, None)
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:16]


def mismatch(record: dict, cfg: Dict[str, Any]) -> List[str]:
    """How the run a record describes differs from a run of the composed config `cfg` ([] when it is the
    same run). A record without its config (written before records kept it) is the same run only when its
    config hashes as `cfg` does with the keys of that time."""
    if "config" in record:  # the record's keys filtered as today's (a key may have joined _NOT_TRAINING)
        return differences(_training(record["config"]), training_config(cfg))
    if record.get("fingerprint") == _legacy_fingerprint(cfg):
        return []
    return ["an older record without its config, whose hash differs from this config's"]


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


def find_done(out: Path, cfg: Dict[str, Any]) -> Optional[dict]:
    """A finished (not shared) record of any experiment of a run of the composed config `cfg`, with its
    experiment's name."""
    for p in sorted((Path(out) / "runs").glob("*/*.json")):
        rec = json.loads(p.read_text())
        if rec.get("status") == "done" and not rec.get("same_as") and not mismatch(rec, cfg):
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
    """What the report needs of one run dir (a study.Run): its record without its config; None if it has no
    config.yaml yet."""
    from omegaconf import OmegaConf

    from kimi.run.metrics import read_metrics

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
