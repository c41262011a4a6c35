"""Training metrics: the console progress line, ``metrics.jsonl``, wandb, MFU and the loss-curve PNG."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

from kimi.config import LoggingConfig

# Dense bf16 tensor-core peak per device (FLOP/s), from the vendors' datasheets (no sparsity).
_CUDA_PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12, "4090": 165e12}


def measure_cpu_peak_flops(size: int = 512, seconds: float = 0.3) -> float:
    """Achieved fp32 matmul FLOP/s of this CPU with torch's current thread count: a practical ceiling
    for MFU on machines with no datasheet number at hand."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b  # warm up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ b
        n += 1
    return 2 * size**3 * n / (time.perf_counter() - t0)


def peak_flops(device: torch.device, configured: Optional[float]) -> float:
    if configured:
        return float(configured)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in _CUDA_PEAK_BF16.items():
            if key in name:
                return value
        return 100e12
    return measure_cpu_peak_flops()


def format_duration(seconds: float) -> str:
    seconds = int(max(0, seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_count(x: float) -> str:
    for unit, div in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.1f}{unit}"
    return f"{x:.0f}"



def qk_clip_record(stats: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    """QK-Clip's last-step statistics as metrics: the worst head over layers, the mean fraction of heads
    clipped, and both per layer (qk_max_logit/<layer>, qk_clipped_frac/<layer>); empty without QK-Clip."""
    if not stats:
        return {}
    record = {"qk_max_logit": max(s["max_logit"] for s in stats.values()),
              "qk_clipped_frac": sum(s["clipped_frac"] for s in stats.values()) / len(stats)}
    for layer, s in stats.items():
        record[f"qk_max_logit/{layer}"] = s["max_logit"]
        record[f"qk_clipped_frac/{layer}"] = s["clipped_frac"]
    return record


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """The records of metrics.jsonl that describe the run as it now stands.

    The file is only ever appended to. Each start of the trainer writes {"event": "start", "step": N}: the
    records logged after step N by an earlier, interrupted session (whose checkpoint was lost) no longer
    count, and a fresh start (N = 0) replaces everything before it. A line cut short by a crash is skipped."""
    rows: List[Dict[str, Any]] = []
    for line in Path(path).read_text(errors="replace").splitlines():
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if not isinstance(r, dict):
            continue
        if r.get("event") == "start":
            rows = [x for x in rows if r["step"] and x.get("step", 0) <= r["step"]]
        else:
            rows.append(r)
    return rows


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (see :func:`read_metrics`) and mirrors
    it to wandb."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, config_dict: Dict[str, Any], resume_step: int = 0,
                 enabled: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / cfg.metrics_file
        self.history: List[Dict[str, Any]] = []
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            with self.path.open("rb+") as f:  # a partial last line (a crash mid-write) stays on its own line
                if f.seek(0, 2) and (f.seek(-1, 2), f.read(1))[1] != b"\n":
                    f.write(b"\n")
        self._append({"event": "start", "step": resume_step, "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
        self.history = read_metrics(self.path)
        if cfg.wandb.mode != "disabled":
            import wandb

            self._wandb = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name,
                                     mode=cfg.wandb.mode, dir=str(run_dir), config=config_dict,
                                     resume="allow", id=_wandb_id(run_dir),
                                     # our own progress line already says everything wandb would print
                                     settings=wandb.Settings(quiet=True, console="off"))

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        self.history.append(record)
        self._append(record)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def _append(self, record: Dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")

    def close(self) -> None:
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def plot(self, out: Path) -> Optional[Path]:
        """Train and validation loss against step, as a PNG (matplotlib, no display needed)."""
        train = [(r["step"], r["loss"]) for r in self.history if "loss" in r]
        val = [(r["step"], r["val_loss"]) for r in self.history if "val_loss" in r]
        if not train and not val:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        if train:
            ax.plot(*zip(*train), label="train loss", lw=1.2)
        if val:
            ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out)
        plt.close(fig)
        return Path(out)


def _wandb_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same wandb run."""
    import hashlib

    return hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]


def progress_line(step: int, max_steps: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
                  mfu: Optional[float], eta_s: float, memory_gib: Optional[float] = None) -> str:
    parts = [f"step {step:>{len(str(max_steps))}}/{max_steps}", f"loss {loss:.4f}", f"lr {lr:.2e}",
             f"gnorm {grad_norm:.3f}", f"{format_count(tokens_per_s)} tok/s"]
    if mfu is not None and math.isfinite(mfu):
        parts.append(f"MFU {100 * mfu:.1f}%")
    if memory_gib is not None:
        parts.append(f"mem {memory_gib:.1f} GiB")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


def banner(cfg, dims, num_params, flops_per_token: float, data, device, routing_table=None) -> str:
    """The lines printed before training: model, data and batch, layout, and MuonClip's parameter routing."""
    from kimi.config import mla_layer_indices

    m, t = cfg.model, cfg.trainer
    mla = set(mla_layer_indices(m))
    pattern = "".join("M" if i in mla else "K" for i in range(m.num_layers))
    n, n_emb = num_params[0], num_params[0] - num_params[1]
    tokens = t.micro_batch_size * t.seq_len * t.grad_accum_steps * dims.dp
    ranks = f" x {dims.dp} data-parallel ranks" if dims.enabled else ""
    lines = [f"[kimi] model {m.name}: {n / 1e6:.2f}M parameters ({n_emb / 1e6:.2f}M embedding), blocks {pattern} "
             f"(K=KDA, M=MLA), residual={m.residual}, vocab {m.vocab_size}, {flops_per_token / 1e6:.1f} MFLOP/token "
             "(train)",
             f"[kimi] data {cfg.data.name}: {data.train_meta['num_tokens']:,} train / {data.val_meta['num_tokens']:,} "
             f"val tokens; batch {t.micro_batch_size}x{t.seq_len}x{t.grad_accum_steps}{ranks} = {tokens:,} tokens/step;"
             f" device {device}; run dir {t.run_dir}"]
    if dims.enabled:
        lines.append(f"[kimi] parallel: pp={dims.pp} x dp_replicate={dims.dp_replicate} x dp_shard={dims.dp_shard} x "
                     f"tp={dims.tp} over {dims.world} processes")
    if routing_table is not None:  # MuonClip: which parameters Muon and AdamW each update
        lines.append(f"[kimi] optimizer {cfg.optim.name} parameter routing:\n{routing_table()}")
    return "\n".join(lines)
