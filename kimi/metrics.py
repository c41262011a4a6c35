"""Training metrics: the console progress line, ``metrics.jsonl``, wandb, MFU and the loss-curve PNG."""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from kimi import cpu
from kimi.config import WANDB_MODES, ConfigError, LoggingConfig, WandbConfig, mixer_pattern
from kimi.model.registry import legend

# Dense bf16 tensor-core peak per device (FLOP/s), from the vendors' datasheets (no sparsity); the first
# key found in the device's name applies (so "H100 PCIe" before "H100", "A100" before "A10").
_CUDA_PEAK_BF16 = {"H200": 989e12, "H100 PCIe": 756e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12,
                   "A10": 125e12, "4090": 165e12}
_CUDA_UNKNOWN = 100e12  # a GPU not in the table: MFU against this, and the start-up line says so


def _cuda_peak(device: torch.device) -> Tuple[float, str]:
    name = torch.cuda.get_device_name(device)
    for key, value in _CUDA_PEAK_BF16.items():
        if key in name:
            return value, f"{name}, datasheet dense bf16 peak"
    return _CUDA_UNKNOWN, f"{name}, not in kimi/metrics.py's table: assumed; set trainer.peak_flops"


def peak_flops(device: torch.device, configured: Optional[float]) -> float:
    """Per-device FLOP/s: trainer.peak_flops, else the datasheet's (CUDA) or the measured CPU rate."""
    return PeakFlops(device, configured).per_device


def format_flops(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6)):
        if abs(x) >= div:
            return f"{x / div:.1f} {unit}FLOP/s"
    return f"{x:.0f} FLOP/s"


class PeakFlops:
    """What MFU divides by (`world` devices' peak) and where the number comes from. On a CPU: one core's
    fp32 matmul rate (kimi.cpu.per_core_peak, cached per machine) times the threads training uses. An
    achieved rate above the peak means the peak is wrong (a trainer.peak_flops set too low, a CPU rate
    measured while something else ran): MFU is then n/a, said once, and null in metrics.jsonl, not a
    number that looks exact."""

    def __init__(self, device: torch.device, configured: Optional[float], world: int = 1,
                 cache_dir: Optional[Path] = None):
        self.world, self.unreliable, self.measured_cpu = world, False, False
        if configured:
            self.per_device, self.source = float(configured), "trainer.peak_flops"
            self.kind, self.fix = self.source, "set trainer.peak_flops to the device's peak"
        elif device.type == "cuda":
            (self.per_device, self.source), self.kind = _cuda_peak(device), "the datasheet peak"
            self.fix = "set trainer.peak_flops to the device's peak"
        else:
            cache = Path(cache_dir) if cache_dir else cpu.default_cache_dir()
            cores = cpu.usable_cores()
            remeasure = os.environ.get(cpu.REMEASURE_ENV, "") not in ("", "0")
            per_core, cached = cpu.per_core_peak(cache, cpu.peak_key(cpu.cpu_model(), cores), remeasure)
            n = min(torch.get_num_threads(), cores)
            self.per_device, self.kind, self.measured_cpu = per_core * n, "the measured CPU rate", True
            self.fix = f"{cpu.REMEASURE_ENV}=1 measures this CPU again"
            self.source = (f"{n} thread{'s' * (n != 1)} x this CPU's fp32 matmul rate per core "
                           f"({format_flops(per_core)}, {'cached in' if cached else 'measured now, kept in'} "
                           f"{cache / cpu.PEAK_FILE}; {cpu.REMEASURE_ENV}=1 measures again), not a datasheet "
                           "peak")

    @property
    def total(self) -> float:
        return self.per_device * self.world

    def describe(self) -> str:
        devices = f" x {self.world} devices" if self.world > 1 else ""
        return f"[kimi] MFU against {format_flops(self.per_device)}{devices}: {self.source}"

    def mfu(self, flops_per_s: float) -> Tuple[Optional[float], Optional[str]]:
        """(MFU in [0, 1], or None from the first achieved rate above the peak on; a note that first time)."""
        if flops_per_s > self.total and not self.unreliable:
            self.unreliable = True
            return None, (f"[kimi] MFU n/a (peak unreliable: achieved {format_flops(flops_per_s)}, more than "
                          f"{self.kind} {format_flops(self.total)}): logged as null from now on; {self.fix}")
        return (None if self.unreliable else flops_per_s / self.total), None


# Below this MFU a CPU run is far slower than its threads can go (a healthy tiny run: about 25% on 1 thread
# of a 2-core machine; 2 threads on the same machine kept busy by other processes: 1 to 4%).
SLOW_CPU_MFU = 0.1


def busy_cpu_hint(mfu: float, threads: int, cores: int, load: float) -> Optional[str]:
    """One line for a CPU run at under SLOW_CPU_MFU of its measured rate, naming the threads and the load;
    None for a run that is not."""
    if mfu >= SLOW_CPU_MFU:
        return None
    return (f"[kimi] hint: training runs at {100 * mfu:.1f}% of this CPU's measured rate for {threads} "
            f"thread{'s' * (threads != 1)} with a load of {load:.1f} on {cores} cores over the last minute: "
            "threads that other processes keep waiting slow every step; set trainer.threads lower (1 on a "
            "busy machine), or null to take the cores free at the start")


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
    for r in _records(Path(path)):
        if r.get("event") == "start":
            rows = [x for x in rows if r["step"] and x.get("step", 0) <= r["step"]]
        else:
            rows.append(r)
    return rows


def _records(path: Path) -> Iterator[Dict[str, Any]]:
    """Every JSON object line of metrics.jsonl, in order (a line cut short by a crash is skipped)."""
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict):
            yield r


def tokens_per_step(t, data_parallel: int) -> int:
    """Training tokens one optimizer step takes (trainer section `t`, over `data_parallel` ranks)."""
    return t.micro_batch_size * t.seq_len * t.grad_accum_steps * data_parallel


class MetricsLogger:
    """Appends one JSON object per logged step to ``metrics.jsonl`` (see :func:`read_metrics`) and mirrors
    it to wandb, each wandb row with the tokens trained so far (the charts' x axis, see start_wandb) and, with
    logging.wandb.log_checkpoints, each checkpoint the saver completes as a model artifact."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, config_dict: Dict[str, Any], resume_step: int = 0,
                 enabled: bool = True, run_id: str = "", tokens_per_step: int = 0, saver=None):
        self.enabled, self.tokens_per_step = enabled, tokens_per_step
        self.path = Path(run_dir) / cfg.metrics_file
        self.history: List[Dict[str, Any]] = []
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            _drop_torn_line(self.path)
        mode = wandb_mode(cfg.wandb)
        wandb_id, rewound = wandb_run_id(run_id or Path(run_dir).resolve().name, resume_step, self.path)
        self._append({"event": "start", "step": resume_step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                      **({"wandb_id": wandb_id} if mode != "disabled" else {})})
        self.history = read_metrics(self.path)
        if mode != "disabled":
            self._wandb = start_wandb(cfg.wandb, Path(run_dir), config_dict, wandb_id, rewound)
            if cfg.wandb.log_checkpoints and saver is not None:
                saver.on_saved.append(self.log_checkpoint)

    def log(self, record: Dict[str, Any], images: Optional[Dict[str, Path]] = None,
            tables: Optional[Dict[str, Tuple[List[str], List[list]]]] = None) -> None:
        """Append `record` (it has a "step"); images (PNG paths) and tables ((columns, rows)) go to wandb
        only, at the same step, as wandb.Image and wandb.Table under their keys."""
        if not self.enabled:
            return
        record = {k: (float(v) if isinstance(v, torch.Tensor) else v) for k, v in record.items()}
        self.history.append(record)
        self._append(record)
        if self._wandb is not None:
            import wandb

            media = {k: wandb.Image(str(path)) for k, path in (images or {}).items()}
            media.update({k: wandb.Table(columns=cols, data=rows)
                          for k, (cols, rows) in (tables or {}).items()})
            # every row has the x axis, also an evaluation's or the diagnostics' off the progress lines' steps
            tokens = {"tokens": record["step"] * self.tokens_per_step} if self.tokens_per_step else {}
            self._wandb.log({**tokens, **{k: v for k, v in record.items() if k != "step"}, **media},
                            step=record["step"])

    def log_checkpoint(self, path: Path, step: int) -> None:
        """A complete checkpoint directory as the next version of the run's model artifact, aliased
        step_<N> and latest."""
        if self._wandb is None:
            return
        import wandb

        artifact = wandb.Artifact(f"checkpoint-{self._wandb.id}", type="model",
                                  metadata={"step": step, "tokens": step * self.tokens_per_step})
        artifact.add_dir(str(path))
        self._wandb.log_artifact(artifact, aliases=[f"step_{step}", "latest"])

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


def _drop_torn_line(path: Path) -> None:
    """Cut a last line without its newline (a crash mid-write): a record cut short is no record, and the
    steps after the checkpoint are logged again anyway."""
    with path.open("rb+") as f:
        end = f.seek(0, 2)
        if end == 0 or (f.seek(end - 1), f.read(1))[1] == b"\n":
            return
        start = end
        while start > 0:  # back to the newline before the torn line, a block at a time
            block = min(start, 1 << 16)
            f.seek(start - block)
            cut = f.read(block).rfind(b"\n")
            if cut >= 0:
                start = start - block + cut + 1
                break
            start -= block
        f.truncate(start)


WANDB_ONLINE_TIMEOUT_S = 20.0  # wandb's own default (90 s, then a traceback) holds every start of a run


def wandb_mode(cfg: WandbConfig) -> str:
    """logging.wandb.mode; where the config leaves it null, $WANDB_MODE (wandb's own variable), else
    offline."""
    if cfg.mode is not None:
        return cfg.mode
    env = os.environ.get("WANDB_MODE", "").strip()
    mode = {"": "offline", "dryrun": "offline", "run": "online"}.get(env, env)  # wandb's older spellings
    if mode not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={env!r} in the environment is invalid: choose one of "
                          f"{'|'.join(WANDB_MODES)}, or set logging.wandb.mode (which wins over it)")
    return mode


def wandb_run_id(run_id: str, resume_step: int, metrics: Path) -> Tuple[str, Optional[str]]:
    """(the wandb run id of this start, the earlier wandb run it rewinds or None).

    The id is the run's own (kept in its checkpoints): a resumed or moved run directory continues its wandb
    run, an overwritten one (a new run id) starts another. wandb only takes steps forward within a run, so a
    resume from a checkpoint older than steps already logged would silently lose the re-logged steps; such a
    start gets a run of its own, `<run id>-r<k>`, which names the earlier one in its notes. The id in use is
    kept in metrics.jsonl's start records."""
    used, logged, rewinds, ours = run_id, 0, set(), False
    for r in _records(metrics):
        if r.get("event") == "start":
            wid = str(r.get("wandb_id", ""))
            ours = wid == run_id or wid.startswith(f"{run_id}-r")  # what an earlier run id logged is not ours
            if ours:
                used = wid
                rewinds.add(wid)
        elif ours and isinstance(r.get("step"), int):
            logged = max(logged, r["step"])
    if logged <= resume_step:
        return used, None
    return f"{run_id}-r{len(rewinds - {run_id}) + 1}", used


def start_wandb(cfg: WandbConfig, run_dir: Path, config: Dict[str, Any], wandb_id: str,
                rewound: Optional[str] = None):
    """wandb's run `wandb_id` (wandb_run_id) for `run_dir`. Online without credentials is a one-line
    ConfigError at once (there is nothing to wait for); online without a reachable server logs offline
    instead, with one warning line, after WANDB_ONLINE_TIMEOUT_S, as a wandb run of its own
    (`<id>-offline-<hex>`): a network outage should not cost a training run (`wandb sync` uploads it later).
    Null keys leave wandb's environment variables in charge (WANDB_ENTITY, WANDB_NAME, WANDB_RUN_GROUP,
    WANDB_TAGS); the project is logging.wandb.project, $WANDB_PROJECT, else kimi."""
    import wandb

    notes = (f"resumed from an older checkpoint than wandb run {rewound} had logged: this run continues it"
             if rewound else None)

    def init(mode: str, run_id: str = wandb_id, **settings):
        return wandb.init(project=cfg.project or os.environ.get("WANDB_PROJECT") or "kimi", entity=cfg.entity,
                          name=cfg.name, group=cfg.group, tags=list(cfg.tags) or None, notes=notes, mode=mode,
                          dir=str(run_dir), config=config, resume="allow", id=run_id,
                          # our own progress line already says everything wandb would print
                          settings=wandb.Settings(quiet=True, console="off", **settings))

    mode = wandb_mode(cfg)
    if mode != "online":
        return tokens_axis(init(mode))
    try:
        return tokens_axis(init("online", init_timeout=WANDB_ONLINE_TIMEOUT_S))
    except wandb.errors.UsageError as e:
        raise ConfigError(f"logging.wandb.mode=online, but wandb cannot start: {_first_line(e)}. Set "
                          "WANDB_API_KEY (or run `wandb login`), or use logging.wandb.mode=offline and "
                          "`wandb sync` later") from None
    except wandb.errors.CommError as e:
        # wandb's service still holds the online attempt's id ("run ID is in use"): the offline record is a
        # run of its own, which `wandb sync` uploads beside the online one
        offline_id = f"{wandb_id}-offline-{uuid.uuid4().hex[:6]}"
        print(f"[kimi] warning: wandb's server did not answer within {WANDB_ONLINE_TIMEOUT_S:.0f} s "
              f"({_first_line(e)}): logging offline to {run_dir / 'wandb'} as run {offline_id} instead; "
              "upload it with `wandb sync` once the network is back", flush=True)
        return tokens_axis(init("offline", run_id=offline_id))


def tokens_axis(run):
    """Make the tokens trained so far (every row's `tokens`, MetricsLogger.log) the default x axis of every
    chart: runs of different batch sizes line up where they have seen the same data. Step stays a choice in
    each panel's x-axis setting."""
    run.define_metric("tokens")
    run.define_metric("*", step_metric="tokens")
    return run


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")


def progress_line(step: int, max_steps: int, loss: float, lr: float, grad_norm: float, tokens_per_s: float,
                  mfu: Optional[float], eta_s: float, memory_gib: Optional[float] = None,
                  loss_steps: int = 1, moe_imbalance: Optional[float] = None) -> str:
    """One line per logging window. `loss` is the mean over the window's `loss_steps` steps (metrics.jsonl's
    `loss`), labelled `loss(avg N)` when N > 1; lr, gnorm and the experts' load imbalance (max/mean tokens
    per expert, the worst MoE layer) are the last step's."""
    label = f"loss(avg {loss_steps})" if loss_steps > 1 else "loss"
    parts = [f"step {step:>{len(str(max_steps))}}/{max_steps}", f"{label} {loss:.4f}", f"lr {lr:.2e}",
             f"gnorm {grad_norm:.3f}"]
    if moe_imbalance is not None:
        parts.append(f"moe {moe_imbalance:.2f}x")
    parts.append(f"{format_count(tokens_per_s)} tok/s")
    if mfu is not None and math.isfinite(mfu):
        parts.append(f"MFU {100 * mfu:.1f}%")
    if memory_gib is not None:
        parts.append(f"mem {memory_gib:.1f} GiB")
    parts.append(f"ETA {format_duration(eta_s)}")
    return " | ".join(parts)


class ProgressWindow:
    """The steps since the last progress line: their losses, their training time (evaluations and checkpoints
    excluded with `paused`), and what they give: the progress line and metrics.jsonl's record, which agree."""

    def __init__(self, peak: PeakFlops, tokens_per_step: int, flops_per_token: float, start_step: int,
                 max_steps: int, device: torch.device):
        self.peak, self.tokens_per_step, self.flops_per_token = peak, tokens_per_step, flops_per_token
        self.start_step, self.max_steps, self.device = start_step, max_steps, device
        self.t_start = self.t0 = time.perf_counter()
        self.losses: List[float] = []
        self.windows, self.hinted = 0, False

    @staticmethod
    def header(log_every: int) -> str:
        if log_every == 1:
            return "[kimi] a progress line every step: tok/s and MFU over its training time"
        return (f"[kimi] a progress line every {log_every} steps: loss is the mean of those steps "
                "(metrics.jsonl's loss), lr and gnorm the last one's, tok/s and MFU over their training time")

    def add(self, loss: float) -> None:
        self.losses.append(loss)

    def due(self, step: int, out: Dict[str, Any], log_every: int) -> Tuple[Optional[str], Dict[str, Any]]:
        """(the console text due after `step`, or None; its metrics record, or {}): the progress line and its
        record every log_every steps and at the end, and after a start's first step its pace (first_step)."""
        if step % log_every == 0 or step == self.max_steps:
            line, record, note = self.report(step, out)
            return (line if note is None else f"{line}\n{note}"), record
        if step == self.start_step + 1:  # a slow run's pace at once, not after log_every steps
            return self.first_step(step, log_every), {}
        return None, {}

    def first_step(self, step: int, log_every: int) -> str:
        """The line after a start's first step, before its first progress line: a slow run (a large model on
        a CPU) says at once how fast it goes and when it ends, not after log_every steps. The window goes on
        (its line and record at log_every are unchanged). This step includes one-off work (allocations, the
        kernels' first calls), so its ETA is an upper bound."""
        took = time.perf_counter() - self.t0
        seconds = f"{took:.2f} s" if took < 60 else format_duration(took)
        eta = format_duration(took * (self.max_steps - step))
        return (f"[kimi] step {step}/{self.max_steps} took {seconds} (start-up work included): "
                f"{format_count(self.tokens_per_step / took)} tok/s, ETA {eta} at that pace; a progress line "
                f"every {log_every} steps follows")

    @contextmanager
    def paused(self):
        t = time.perf_counter()
        try:
            yield
        finally:
            self.t0 += time.perf_counter() - t

    def report(self, step: int, out: Dict[str, float]) -> Tuple[str, Dict[str, Any], Optional[str]]:
        """(progress line, metrics record, a note on the MFU peak or a busy CPU, or None); starts the next
        window."""
        now, n = time.perf_counter(), len(self.losses)
        tps = n * self.tokens_per_step / (now - self.t0)
        mfu, note = self.peak.mfu(tps * self.flops_per_token)
        self.windows += 1
        if not self.hinted and mfu is not None and self.peak.measured_cpu and self.windows > 1:
            # the first window holds the start's one-off work; a hint once, from the second window on
            threads = torch.get_num_threads()
            hint = busy_cpu_hint(mfu, threads, cpu.usable_cores(), cpu.cpu_load())
            self.hinted = hint is not None
            note = "\n".join(x for x in (note, hint) if x) or None
        eta = (now - self.t_start) / max(1, step - self.start_step) * (self.max_steps - step)
        loss = sum(self.losses) / n
        # this rank's peak allocation on its GPU so far (ranks differ little but for pipeline stages)
        memory = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        line = progress_line(step, self.max_steps, loss, out["lr"], out["grad_norm"], tps, mfu, eta, memory,
                             loss_steps=n, moe_imbalance=out.get("moe_imbalance"))
        record = {"step": step, "loss": loss, "lr": out["lr"], "grad_norm": out["grad_norm"],
                  "tokens_per_s": tps, "mfu": mfu, "tokens": step * self.tokens_per_step}
        record.update({k: v for k, v in out.items() if k.startswith("moe_")})
        if memory is not None:
            record["peak_memory_gib"] = memory
        self.t0, self.losses = time.perf_counter(), []
        return line, record, note


# Parameters from which a run on a CPU gets a note: the presets made for a CPU (tiny, moe_tiny, k3_tiny) have
# at most 2M, small (126M) and up are sized for GPUs, where their steps take seconds, not minutes.
CPU_NOTE_PARAMS = 50_000_000


def cpu_size_note(device: torch.device, num_params: int) -> Optional[str]:
    """A note for a GPU-sized model on a CPU (before its first step, which may take minutes), else None."""
    if device.type != "cpu" or num_params < CPU_NOTE_PARAMS:
        return None
    return (f"[kimi] note: {num_params / 1e6:.1f}M parameters on a CPU: a model this size is meant for a GPU "
            "and its steps take long here (the first step's time and an ETA follow it); the CPU presets are "
            "model=tiny, moe_tiny and k3_tiny")


def _count(meta) -> str:
    n = meta["num_tokens"]
    return f"{n:,}" if isinstance(n, int) else str(n)  # a stream's size is not known ahead


def banner(cfg, dims, num_params, flops_per_token: float, data, device, routing: Optional[str] = None,
           layout: Optional[str] = None, threads: str = "") -> str:
    """The lines printed before training: model, data and batch, the device (`threads`: its CPU threads and
    why, kimi.cpu.set_threads), the engine's line on the layout (Engine.layout), and the optimizer's
    parameter routing (a one-line summary: the table itself is a file, see kimi.runlog.write_routing)."""
    m, t = cfg.model, cfg.trainer
    n, n_emb = num_params[0], num_params[0] - num_params[1]
    tokens = tokens_per_step(t, dims.dp)
    ranks = f" x {dims.dp} data-parallel ranks" if dims.enabled else ""
    moe = (f", MLPs from block {m.moe_first_dense} on: {m.moe_num_experts} experts, top-{m.moe_top_k} + "
           f"{m.moe_shared_experts} shared" if m.moe_num_experts else "")
    lines = [f"[kimi] model {m.name}: {n / 1e6:.2f}M parameters ({n_emb / 1e6:.2f}M embedding), blocks "
             f"{mixer_pattern(m)} ({legend(m)}){moe}, residual={m.residual}, vocab {m.vocab_size}, "
             f"{flops_per_token / 1e6:.1f} MFLOP/token (train)",
             f"[kimi] data {cfg.data.name}: {_count(data.train_meta)} train / {_count(data.val_meta)} "
             f"val tokens; batch {t.micro_batch_size}x{t.seq_len}x{t.grad_accum_steps}{ranks} = {tokens:,} "
             f"tokens/step; device {device}{threads}; run dir {t.run_dir}"]
    if layout:
        lines.append(layout)
    if routing:  # MuonClip: which parameters Muon and AdamW each update
        lines.append(routing)
    return "\n".join(lines)
