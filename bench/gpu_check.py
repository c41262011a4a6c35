"""`make gpu-check`: the GPU checks of this repository, on one CUDA GPU, offline, as one device call of at
most 8 minutes from cold caches: the steps in priority order, each under its own cap, each writing its
results as soon as it ends (a call cut short still returns every finished step).

The default plan (PLAN; `--plan` prints it with each step's cap and predicted seconds, running nothing):

  1 kda_check        bench/kda.py --check: every KDA Triton op vs the PyTorch path and fp64 in bf16 at 1b's
                     heads (16 x 128) on packed documents, whole and in 2 and 4 context-parallel shards
                     (--check-fla adds fla-core's chunk_kda: 85 s more)
  2 kda_speed        bench/kda.py: ours vs fla-core's chunk_kda / fused_recurrent_kda and SDPA, bf16,
                     T = 4k, 16k, 64k at 64k tokens, H = 32, d = 128, decoding, the bounded safe-gate form,
                     and ours under each launch layout of the two scores kernels (the 2026-12-04 profile's
                     costliest KDA kernels; kimi.ops.kda.triton.common.SCORES_GRIDS)
  3 train            bench/parallel.py --layouts single --profile: 1b, 4 x 4096 tokens, compiled bf16 (the
                     settings expected to be fastest, KDA's scores kernels in the layout kda_speed timed
                     fastest, as every training step): tokens/s, MFU, peak memory, the losses, the dtypes
                     reaching the KDA kernels, any fallback to PyTorch, and one profiled step: its costliest
                     kernels, the GPU's busy time against the step's (the share spent waiting on the host),
                     kernels launched and aten ops dispatched
  4 train_fp8        bench/parallel.py --layouts fp8_rowwise: 1b with trainer.precision=fp8, against train's
                     bf16 row
  5 peer             bench/peer.py --titan: torchtitan's trainer on a Llama of dense_1b's shape and dense_1b,
                     same tokens, steps and settings, beside train's 1b row (reused, not trained again);
                     torchtitan is skipped, with its reason, where it does not import

More steps, for a second call (`--steps NAME ...`; `--steps all` for every one):

  train_graphs       bench/parallel.py --layouts graphs_step graphs_regions --profile: train's 1b run with
                     parallel.cuda_graphs=step and =regions, against train's row: tokens/s and the share of
                     the step the GPU waits on the host (bench/host_audit.py predicts both)
  attention_auto     bench/attention.py --auto: what model.attention.backend=auto picks at 1b's MLA shape and
                     Kimi Linear's, 4k-16k tokens per row, with its timing of both backends
  attnres            bench/attnres.py --gpu: the fused AttnRes depth mix and pre-norm at 1b's width vs fp64,
                     timed against the eager and compiled mixes (--fla adds fla-core's fused AttnRes)
  attention_check    bench/attention.py --check-only: the flash-attention kernels vs fp32, and context
                     parallelism's MLA over blocks of latents (latent_attention)
  attention_speed    bench/attention.py --skip-check: vs SDPA's flash backend, max logits, atomic dQ
  optim              bench/optim.py --device cuda: optimizer.step() of MuonClip vs torch.optim.Muon + AdamW

Each step is a subprocess that gets its cap (STEPS) or what is left of --total, whichever is less; a step that
hangs or crashes loses only itself. After each one it writes <out>/<step>.json (status, seconds, commands,
each command's log tail and its own JSON under runs.<name>.result) and <out>/summary.md (the table so far);
all output goes to <out>/gpu_check.log: the plan's 7 files, within the 8 the device tool brings back. At
the end it prints one markdown table (summary.md) and exits 1 if a check failed, a step crashed or ran out
of time. Each step's sizes are in SIZES and TRAIN below; --step-args NAME="..." appends to a step's arguments
(the scripts take the last value of a repeated option), e.g. --step-args train_fp8="--layouts bf16
fp8_tensorwise fp8_rowwise".

On the GPU machine python3 lacks hydra-core, omegaconf, datasets, fla-core and torchtitan: `make gpu-wheels`
(here, where pip can download) puts their wheels in .whl/, and a device session carries .whl and runs

    make gpu-check GPU_CHECK_ARGS="--out $OUT"        (the device tool's run: carry [".whl"], timeout_s 600)

The Makefile installs the wheels into /tmp/kimi-site and puts it and the repository on PYTHONPATH; without
make, the same is

    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/kimi-site .whl/*.whl
    PYTHONPATH=$PWD:/tmp/kimi-site python3 bench/gpu_check.py --out $OUT

    python bench/gpu_check.py [--out DIR] [--steps NAME ... | all] [--budget NAME=SECONDS ...]
                              [--total SECONDS] [--step-args NAME="ARGS" ...] [--after DIR]
                              [--gpu-memory GIB] [--verbose] [--plan]
    python bench/gpu_check.py --dry-run [--out DIR] [--steps ...]

The training steps take 1b's 4 rows per step in as many micro-batches as the GPU's memory needs (one on the
140 GiB H200, two of two rows on an 80 GB H100): rows_per_micro_batch, from the H200's measured peak.

--dry-run runs the steps' code on CPU at tiny sizes (Triton interpreted, fla-core left out, the tiny model
without torch.compile instead of 1b, two steps), each step with DRY_CAP seconds, so a plumbing bug shows
without a GPU; it writes to a new temporary directory unless --out is given (tests/project/test_gpu_check.py).
For those tests, --plant-failure NAME perturbs a check step's result (and crashes any other step) and
--plant-hang NAME makes a step hang until its cap ends.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
LOG = "gpu_check.log"
LOG_TAIL = 40  # lines of each command's output kept in its step's JSON
CHECK_STEPS = ("kda_check", "attention_check")  # whose results --plant-failure perturbs
PLANTED_CRASH = "raise SystemExit('planted failure (--plant-failure)')"
PLANTED_HANG = "import time; print('planted hang (--plant-hang)', flush=True); time.sleep(3600)"

# name: (what it measures, its cap in seconds on the GPU from cold caches). PLAN's five are the default, in
# priority order: one device call of at most 480 s (the device's 15 minutes hold its start-up and one such
# call with room to rerun part of it); the rest are for a second call (--steps ...).
STEPS = {
    "kda_check": ("bf16 KDA Triton ops vs fp64 at 1b's heads", 50),
    "kda_speed": ("KDA vs fla-core and SDPA, each scores-kernel layout", 150),
    "train": ("1b training, compiled bf16: tokens/s, MFU, memory, a profiled step", 150),
    "train_fp8": ("1b with fp8 (rowwise) against train's bf16", 110),
    "peer": ("torchtitan's Llama and dense_1b beside train's 1b", 120),
    "train_graphs": ("1b with CUDA graphs (step, regions) against train's row", 200),
    "attention_auto": ("what model.attention.backend=auto picks per shape", 50),
    "attnres": ("fused AttnRes depth mix vs fp64, eager and compiled at 1b's width", 40),
    "attention_check": ("flash attention vs fp32", 120),
    "attention_speed": ("flash attention vs SDPA", 120),
    "optim": ("optimizer step", 90),
}
PLAN = ("kda_check", "kda_speed", "train", "train_fp8", "peer")
TOTAL = 470  # seconds for the default plan's steps; the Makefile's wheel install and start make up the 480
# a dry run interprets the kernels on a CPU: every step gets DRY_CAP seconds, all of them DRY_TOTAL
DRY_CAP, DRY_TOTAL = 600, 3600
# What each step is predicted to take on an H200 from cold caches (--plan prints them), and on what that
# rests: the 2026-11-30 run's seconds where it ran the same work, else an estimate from its parts.
PREDICTED = {
    "kda_check": (40, "2026-12-04: ours done in 25 s from cold caches (fla-core's chunk_kda rows took over "
                      "85 s more, its autotuning: --step-args kda_check=--check-fla adds them); the context "
                      "rows since compile the chunk kernels once more at V = 256 (estimate: 10 s)"),
    "train": (130, "2026-12-04: 119 s, twice (start and compile, then 2 + 10 timed + 1 profiled steps), "
                   "and more compilation since: the pre-norm joined the depth mix's graphs (estimate)"),
    "peer": (95, "2026-12-04: dense_1b's command 89 s with 1b reused; torchtitan 0.3.0 does not import on "
                 "the image's torch 2.11 (seconds to find out; where it does, as long again)"),
    "attention_auto": (40, "2026-12-04: the first of 6 shapes (both backends compiled and timed) took most "
                           "of 30 s; the others reuse the compiled kernels (estimate)"),
    "train_fp8": (100, "train's 119 s (2026-12-04) less 5 of its 13 steps; the first try stopped at the "
                       "config check: the image has no torchao, now among the wheels (estimate)"),
    "train_graphs": (150, "train's run twice from warm compile caches (its 119 s less most of the compile, "
                          "2026-12-04), 4 more untimed steps each to record the graphs (estimate)"),
    "attention_check": (47, "2026-11-30: 47 s"),
    "kda_speed": (100, "2026-11-30: crashed after 21 s; a cold compile of every kernel (three layouts of the "
                       "scores kernels) plus fla-core's autotuning, 85 s in kda_check on 2026-12-04, at 3 "
                       "lengths (estimate)"),
    "attention_speed": (76, "2026-11-30: 76 s"),
    "optim": (16, "2026-11-30: 16 s"),
    "attnres": (25, "2026-12-04: eager, compiled and fused at 2, 5 and 9 sources in about 15 s after a 5 s "
                    "start (fla-core's fused AttnRes autotuned 40 s per shape: --step-args attnres=--fla)"),
}
# Each step's size arguments: (on the GPU, in a dry run). The dry run's are tiny because the interpreter
# runs each program of a kernel in Python; fla-core is left out there (not written for the interpreter).
# kda_check: 1b's KDA heads (16 of dimension 128), bf16 as the model trains.
SIZES = {
    "kda_check": ("--check-dtypes bfloat16 --check-docs 100 1 199 137 63 --check-heads 16 --check-dim 128",
                  "--dry-run --check-dtypes bfloat16 --check-fla --check-docs 5 1 70 --check-heads 1 "
                  "--check-dim 16"),
    "attention_check": ("", "--dry-run"),  # cases: bench/attention.py's GPU_CHECKS (DRY_CHECKS in a dry run)
    "kda_speed": ("--T 4096 16384 65536 --tokens 65536 --heads 32 --dim 128",
                  "--dry-run --T 64 --tokens 64 --heads 1 --dim 16"),
    # 1b's MLA (16 heads, 128/128) at 4k to 16k tokens per row, and Kimi Linear's 192/128 heads
    "attention_auto": ("--T 4096 8192 16384 --tokens 16384 --heads 16 --dims 128/128 192/128",
                       "--dry-run --T 64 --tokens 64 --heads 1 --dims 48/32"),
    "attention_speed": ("--T 4096 8192 16384 --tokens 16384 --heads 16 --dims 128/128 192/128",
                        "--dry-run --T 64 --tokens 64 --heads 1 --dims 48/32"),
    "optim": ("--device cuda --models 1b --repeats 5", "--device cpu --models tiny --repeats 1"),
    # 1b's width and 4 x 4096 tokens, 2 to 9 sources (its Block AttnRes mixes 1 to 9)
    "attnres": ("--gpu --tokens 16384 --d-model 2048 --sources 2 5 9", "--gpu --dry-run --sources 2 9"),
}
# train: model -> (sequences per step, timed steps, seq_len); the presets' 32k vocabulary (the tokenizer
# trained on this repository's ~1 MB of text has 4096 pieces). The peer step trains with the same sizes, so
# it takes train's 1b row instead of training it again.
TRAIN = {"1b": (4, 10, 4096)}
TRAIN_DRY = {"tiny": (4, 2, 64)}
TRAIN_FP8 = {"1b": (4, 5, 4096)}
# peer: (sequences per step, timed steps, seq_len), and the dry run's dense stand-in: tiny made dense
PEER, PEER_DRY = TRAIN["1b"], TRAIN_DRY["tiny"]
DENSE_TINY = ["--dense-set", "model.layer_pattern=A", "model.residual=standard", "model.mha.num_heads=2"]
# What 1b's training holds on a GPU, measured: 130.6 GiB at the peak (torch.cuda.max_memory_allocated) with
# 4 rows of 4096 tokens in one micro-batch, compiled bf16, no activation checkpointing, 0.93 of the H200's
# 140.4 GiB (2026-12-04, calls 2 and 3). Of it, the fp32 weights and Muon momentum are 6.5 GiB (python -m
# kimi.summary model=1b) and about 31 GiB each row of 4096 tokens; a step of several micro-batches holds the
# fp32 gradients (3.25 GiB) as well. On a GPU with less memory (an 80 GB H100) the training steps take the
# same tokens per step in more micro-batches: the most rows per micro-batch within FIT_SHARE of its memory.
ROW_GIB, STATE_GIB, GRADS_GIB, FIT_SHARE = 31.0, 6.5, 3.25, 0.95


def rows_per_micro_batch(batch: int, seq: int, gpu_gib: float | None) -> int:
    """The most rows (a divisor of `batch`) one micro-batch of 1b can hold on a GPU of `gpu_gib` GiB (all
    of them when its memory is unknown, 1 when not even one row fits), at ROW_GIB per 4096 tokens of a row."""
    if gpu_gib is None:
        return batch
    for rows in (r for r in range(batch, 0, -1) if batch % r == 0):
        need = STATE_GIB + (GRADS_GIB if rows < batch else 0) + rows * ROW_GIB * seq / 4096
        if need <= FIT_SHARE * gpu_gib:
            return rows
    return 1


def gpu_memory_gib() -> float | None:
    """The first GPU's memory in GiB, from nvidia-smi, else from torch in a child process (no CUDA context
    in this one: the steps need all of the memory); None where neither can say."""
    asks = ((["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], 2**10),  # MiB
            ([sys.executable, "-c", "import torch; print(torch.cuda.get_device_properties(0).total_memory)"],
             2**30))
    for cmd, unit in asks:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            if proc.returncode == 0:
                return float(proc.stdout.split()[0]) / unit
        except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
            pass
    return None


def micro_batches(ctx: "Context", batch: int, seq: int) -> list[str]:
    """--set's overrides that split a step of `batch` rows into micro-batches that fit the GPU (none when
    one fits)."""
    rows = rows_per_micro_batch(batch, seq, ctx.gpu_gib)
    return [] if rows == batch else [f"trainer.micro_batch_size={rows}",
                                     f"trainer.grad_accum_steps={batch // rows}"]


TRAINING_STEPS = ("train", "train_fp8", "peer", "train_graphs")


def layout_times(row: dict) -> dict[str, float]:
    """Forward+backward ms per scores layout in one row of bench/kda.py's timings (grid_<spec>_fwdbwd_ms)."""
    return {k[5:-10]: v for k, v in row.items() if k.startswith("grid_") and k.endswith("_fwdbwd_ms")}


def fastest_scores_layout(done: dict) -> tuple[str, str] | None:
    """(layout, why) of KDA's scores kernels for the training steps: the fastest forward+backward in this
    call's (or --after's) kda_speed step at the row length closest to the training rows', so `train` runs
    the settings expected to be fastest; None when kda_speed timed no layout."""
    record = done.get("kda_speed") or {}
    rows = [x for e in record.get("runs", {}).values() for x in e.get("result", {}).get("rows", [])]
    seq = TRAIN["1b"][2]
    timed = [(abs(x["T"] - seq), x) for x in rows if layout_times(x)]
    if not timed:
        return None
    row = min(timed, key=lambda t: t[0])[1]
    grids = layout_times(row)
    best = min(grids, key=grids.get)
    return best, (f"the fastest in kda_speed at T={row['T']}: " +
                  ", ".join(f"{g} {ms:.2f} ms" for g, ms in grids.items()) + " fwd+bwd")


def training_set(ctx: "Context", seq: int, *extra: str) -> list[str]:
    """--set's overrides of a training measurement: the sequence length, compiled on a GPU, this repository's
    text with a 32k vocabulary (the presets' size; the tokenizer trained on ~1 MB has 4096 pieces)."""
    vocab, pieces, compiled = (512, 384, "false") if ctx.dry else (32000, 4096, "true")
    return ["--set", f"trainer.seq_len={seq}", *extra, f"parallel.compile={compiled}",
            f"model.vocab_size={vocab}",
            "data=files", f"data.data_files=[{ctx.corpus()}/*.txt]", f"data.cache_dir={ctx.tmp / 'data'}",
            f"data.tokenizer.vocab_size={pieces}", "data.val_fraction=0.15"]


def commands(step: str, ctx: "Context") -> list[tuple[str, list[str]]]:
    """(name, arguments after `python bench/`) of each command of a step."""
    if step in ("train", "train_fp8", "train_graphs"):
        # fp8: its recipes are layouts (bench/parallel.py's PRECISION_LAYOUTS), against train's bf16 row;
        # --step-args train_fp8="--layouts bf16 fp8_tensorwise fp8_rowwise" measures all three in one run.
        # graphs: both kinds of parallel.cuda_graphs, profiled, against train's row; they need CUDA, so a
        # dry run checks the step's plumbing on the single layout
        fp8 = step == "train_fp8"
        sizes = TRAIN_DRY if ctx.dry else TRAIN_FP8 if fp8 else TRAIN
        layouts = (["fp8_rowwise"] if fp8 else ["single"] if step == "train" or ctx.dry
                   else ["graphs_step", "graphs_regions"])
        return [(model, ["parallel.py", "--layouts", *layouts, "--model", model, "--batch", str(batch),
                         "--steps", str(steps), *([] if fp8 else ["--profile"]),
                         *training_set(ctx, seq, *([] if fp8 else ["trainer.precision=bf16"]),
                                       *micro_batches(ctx, batch, seq))])
                for model, (batch, steps, seq) in sizes.items()]
    if step == "peer":
        batch, steps, seq = PEER_DRY if ctx.dry else PEER
        kimi = "tiny" if ctx.dry else "1b"
        models = ["--kimi", kimi, "--dense", "tiny", *DENSE_TINY] if ctx.dry else ["--kimi", kimi, "--dense",
                                                                                   "dense_1b"]
        return [("peer", ["peer.py", *models, "--titan", "--batch", str(batch), "--steps", str(steps),
                          "--kimi-result", str(ctx.tmp / f"train.{kimi}.json"),
                          *training_set(ctx, seq, "trainer.precision=bf16",
                                        *micro_batches(ctx, batch, seq))])]
    script = {"kda_check": "kda.py --check", "attention_check": "attention.py --check-only",
              "kda_speed": "kda.py --no-self-check", "attention_speed": "attention.py --skip-check",
              "attention_auto": "attention.py --auto", "optim": "optim.py --ranks 0",
              "attnres": "attnres.py"}[step]
    return [(script.split(".")[0], [*script.split(), *SIZES[step][ctx.dry].split()])]


class Context:
    def __init__(self, dry: bool, tmp: Path, gpu_gib: float | None = None):
        self.dry, self.tmp, self._corpus = dry, tmp, None
        self.gpu_gib = gpu_gib  # the GPU's memory, which sizes the training steps' micro-batches

    def corpus(self) -> Path:
        """This repository's .md and .py files as .txt documents: about 1 MB of text on a machine that cannot
        download any (200 kB in a dry run, enough for its tiny tokenizer)."""
        if self._corpus is None:
            self._corpus = self.tmp / "corpus"
            self._corpus.mkdir(parents=True)
            skip = {"outputs", "runs", "results", "__pycache__"}  # and hidden folders (.venv, .git, .whl)
            limit, total = (200_000 if self.dry else float("inf")), 0
            for top, dirs, files in os.walk(ROOT):  # in sorted order, skipped folders never entered
                dirs[:] = sorted(d for d in dirs
                                 if not (d in skip or d.startswith(".") or d.endswith(".egg-info")))
                for name in sorted(f for f in files if f.endswith((".md", ".py"))):
                    if total > limit:
                        break
                    path = Path(top, name)
                    text = path.read_text(errors="replace")
                    (self._corpus / ("__".join(path.relative_to(ROOT).parts) + ".txt")).write_text(text)
                    total += len(text)
        return self._corpus


# ----------------------------------------------------------------------------------- reading the results
# Each returns (rows of (what, result) for the table, failures) from one command's JSON.


def kda_check_rows(r: dict, done: dict):
    rows, failures = [], []
    for dtype in sorted({x["dtype"] for x in r["rows"]}, reverse=True):  # float32 first
        mine = [x for x in r["rows"] if x["dtype"] == dtype and x.get("ours", True)]
        cells = [f"{x['op']} " + ("error" if "error" in x else f"{x['max_vs_fp64']:.1e}") for x in mine]
        rows.append((f"KDA Triton vs fp64, {dtype}: H={r['H']} d={r['d']}, packed docs {r['docs']}",
                     ", ".join(cells) + f" (max rel. error; pass < {mine[0]['tol']:.0e})"))
        failures += [f"{x['what']} ({dtype}): " + (x["error"] if "error" in x else
                     f"{x['worst']} {x['max_vs_fp64']:.1e} from fp64 (pass < {x['tol']:.0e}), PyTorch path "
                     f"{max(x['torch_vs_fp64'].values()):.1e}") for x in mine if not x["ok"]]
        theirs = [x for x in r["rows"] if x["dtype"] == dtype and not x.get("ours", True)]
        if theirs:  # reported, not failing the check: a fault of fla-core's is theirs to fix
            rows.append((f"{r['fla']} chunk_kda vs fp64, {dtype}, the same cases",
                         ", ".join(f"{x['op']} " + (f"error: {x['error'][:80]}" if "error" in x else
                                                     f"{x['max_vs_fp64']:.1e}" + ("" if x["ok"] else " over"))
                                   for x in theirs)))
    if not any(not x.get("ours", True) for x in r["rows"]):
        rows.append(("fla-core", r.get("fla", "not checked")))
    return rows, failures


def attention_check_rows(r: dict, done: dict):
    rows, failures = [], []
    keys = ("o", "lse", "max_logits", "dq", "dk", "dv")
    for dtype in sorted({x["dtype"] for x in r["checks"]}):
        mine = [x for x in r["checks"] if x["dtype"] == dtype]
        worst = ", ".join(f"{k} {max(x[k] for x in mine):.1e}" for k in keys)
        rows.append((f"attention vs fp32, {dtype}: {len(mine)} cases x dQ modes",
                     f"{worst} (max rel. error); {sum(x['ok'] for x in mine)}/{len(mine)} pass"))
        failures += [f"{x['dtype']} {x['case']} ({x['dq_mode']} dQ): "
                     + ", ".join(f"{k} {x[k]:.1e}" for k in keys) for x in mine if not x["ok"]]
    latent = r.get("latent_checks", [])
    if latent:  # context parallelism's MLA over blocks of latents (bench/attention.py, latent_check)
        keys = ("o", "max_logits", "dq", "dc", "dr", "dw")
        worst = ", ".join(f"{k} {max(x[k] for x in latent):.1e}" for k in keys)
        rows.append((f"MLA over latent blocks (cp) vs fp32: {len(latent)} cases",
                     f"{worst} (max rel. error); {sum(x['ok'] for x in latent)}/{len(latent)} pass"))
        failures += [f"{x['dtype']} MLA over latent blocks, {x['case']}: "
                     + ", ".join(f"{k} {x[k]:.1e}" for k in keys) for x in latent if not x["ok"]]
    return rows, failures


def kda_speed_rows(r: dict, done: dict):
    c, rows = r["config"], []
    for x in r["rows"]:
        parts = []
        for mode, name in (("fwd", "fwd"), ("fwdbwd", "fwd+bwd")):
            if f"ours_{mode}_ms" not in x:
                parts.append(f"{name}: ours failed")
                continue
            ours, fla = x[f"ours_{mode}_ms"], x.get(f"fla_{mode}_ms")
            parts.append(f"{name} {ours:.2f} ms ({x[f'ours_{mode}_tflops']:.0f} TFLOP/s)"
                         + (f", fla {fla:.2f} ms = {fla / ours:.2f}x ours" if fla else "")
                         + f", SDPA {x[f'sdpa_{mode}_ms']:.2f} ms")
        if "safe_bounded_fwdbwd_ms" in x and "safe_general_fwdbwd_ms" in x:
            bounded, general = x["safe_bounded_fwdbwd_ms"], x["safe_general_fwdbwd_ms"]
            parts.append(f"safe gate fwd+bwd: bounded {bounded:.2f} ms = {bounded / general:.2f}x general")
        grids = layout_times(x)
        if grids:  # which launch layout common.SCORES_GRID should default to
            diffs = [v for k, v in x.items() if k.startswith("grid_") and k.endswith("_rel_diff")]
            parts.append("scores layouts fwd+bwd: " + ", ".join(f"{g} {ms:.2f} ms" for g, ms in grids.items())
                         + f" (fastest {min(grids, key=grids.get)}"
                         + (f"; results within {max(diffs):.1e} of the first's)" if diffs else ")"))
        decode = f"decode {x['decode_ours_us']:.0f} us" if "decode_ours_us" in x else "decode: ours failed"
        decode += f" (fla {x['decode_fla_us']:.0f} us)" if "decode_fla_us" in x else ""
        parts.append(decode + f", attention over the cache {x['decode_sdpa_us']:.0f} us")
        rows.append((f"KDA bf16 T={x['T']} B={x['B']} H={c['H']} d={c['d']}", "; ".join(parts)))
    if not any("fla_fwd_ms" in x for x in r["rows"]):
        rows.append(("fla-core", c["fla"]))
    # fla-core's own failures are noted in the JSON; only ours fail the step
    return rows, [f"{e['where']} {e['impl']}: {e['error']}" for e in r["errors"] if "fla" not in e["impl"]]


def attention_speed_rows(r: dict, done: dict):
    rows, failures = [], []
    for x in r["rows"]:
        fwd, both = x["triton_fwd_ms"], x["triton_fwdbwd_ms"]
        fwd_max, both_max = x["triton_fwd_max_ms"] / fwd - 1, x["triton_fwdbwd_max_ms"] / both - 1
        atomic = x["triton_fwdbwd_atomic_dq_ms"] / x["sdpa_fwdbwd_ms"]
        # what QK-Clip training runs: both backends with max logits, against SDPA without
        with_max = {name: x[key] / x["sdpa_fwdbwd_ms"] for name, key in (
            ("ours", "triton_fwdbwd_atomic_dq_max_ms"), ("SDPA path", "sdpa_path_fwdbwd_max_ms")) if key in x}
        rows.append((f"attention bf16 {x['dims']} T={x['T']} B={x['B']} H={r['heads']}",
                     f"fwd {fwd:.2f} ms = {fwd / x['sdpa_fwd_ms']:.2f}x SDPA, max logits "
                     f"{100 * fwd_max:+.1f}%; fwd+bwd {both:.2f} ms = {both / x['sdpa_fwdbwd_ms']:.2f}x, max "
                     f"logits {100 * both_max:+.1f}%, atomic dQ {atomic:.2f}x"
                     + "".join(f"; with max logits {k} {v:.2f}x" for k, v in with_max.items())))
        if not x["rel_err_vs_fp32"] < 2e-2:  # bench/attention.py's bf16 mark
            failures.append(f"{x['dims']} T={x['T']}: output {x['rel_err_vs_fp32']:.1e} from fp32 SDPA "
                            "(pass < 2e-2)")
    return rows, failures


def optim_rows(r: dict, done: dict):
    rows = []
    for x in r["single"]:
        t = {k: v * 1e3 for k, v in x["step_s"].items()}
        ratio = x["ratio_to_torch_muon"]["muonclip_bf16"]
        rows.append((f"optimizer.step() {x['model']} ({x['params'] / 1e6:.0f}M params), {r['device']}",
                     f"MuonClip (bf16 NS) {t['muonclip_bf16']:.1f} ms = {ratio:.2f}x torch.optim.Muon + "
                     f"AdamW ({t['torch_muon']:.1f} ms); MuonClip fp32 NS {t['muonclip']:.1f} ms; AdamW "
                     f"{t['adamw']:.1f} ms"))
    return rows, []


def train_rows(r: dict, done: dict):
    """A row per layout: single, and any other asked for with --step-args (kda_fla: fla-core's KDA
    kernels)."""
    rows, failures = [], []
    for name, (x, *_) in r["layouts"].items():
        row, failed = _train_row(r, x, "" if name == "single" else f" {name}")
        rows.append(row)
        failures += failed
    return rows, failures


def roofline_note(model: str, seq: str, batch: int, device: str) -> str:
    """bench/step_audit.py's prediction for this model, sequence length and GPU, when it has one: the ops of
    one forward and backward at their datasheet roofline, unfused (an upper bound on fusion's room), and
    compiled as parallel.compile=true runs them (bench/compiled_roofline.py) where it was priced."""
    path = ROOT / "bench" / "results" / "step_audit.json"
    family = json.loads(path.read_text())["families"].get(model, {}) if path.exists() else {}
    roof = family.get("roofline") or {}
    gpu = next((name for name in roof.get("gpus", {}) if name in device), None)
    if gpu is None or str(roof.get("T")) != seq:
        return ""
    pred = roof["gpus"][gpu]
    note = (f"; roofline ({gpu}, bench/step_audit.py): {1e3 * batch * pred['predicted_step_s']:.0f} ms "
            f"without the optimizer, MFU ceiling {100 * pred['mfu_ceiling']:.0f}%")
    compiled = (family.get("compiled") or {}).get("gpus", {}).get(gpu)
    if compiled and str(family["compiled"].get("T")) == seq:  # what parallel.compile=true should approach
        note += (f"; compiled roofline {1e3 * batch * compiled['compiled_step_s']:.0f} ms, MFU ceiling "
                 f"{100 * compiled['mfu_ceiling']:.0f}%")
    return note


def _train_row(r: dict, x: dict, layout: str):
    seq = next(s.split("=", 1)[1] for s in r["set"] if s.startswith("trainer.seq_len="))
    flags = " ".join(s for s in r["set"] if s.startswith(("trainer.precision", "parallel.compile")))
    losses = x.get("losses") or [float("nan")]
    extra = f"; loss {losses[0]:.3f} -> {losses[-1]:.3f}; KDA inputs {x.get('kda_dtypes') or '-'}"
    extra += roofline_note(r["model"], seq, r["batch"], x.get("device", ""))
    extra += f"; fell back to PyTorch: {x['fallbacks']}" if x.get("fallbacks") else ""
    host = x.get("host")
    extra += (f"; GPU busy {host['gpu_busy_ms']:.0f} ms of the {1e3 * x['step_s']:.0f} ms step "
              f"({100 * host['gpu_idle_share']:.0f}% waiting on the host), {host['kernels']:,} kernels and "
              f"{host['aten_ops']:,} aten ops per step" if host else "")
    top = x.get("top_kernels") or []
    extra += ("; costliest kernels: " + ", ".join(f"{k['kernel'][:40]} {k['ms']:.1f} ms" for k in top[:3])
              if top else "")
    hungry = x.get("memory_ops") or []
    extra += ("; most memory: " + ", ".join(f"{m['op'][:40]} {m['mib']:,.0f} MiB" for m in hungry[:3])
              if hungry else "")
    if x.get("peak_mem_timed_bytes"):  # CUDA: before the profiled and counted steps
        extra += f"; peak memory of the timed steps {x['peak_mem_timed_bytes'] / 2**30:.1f} GiB"
    failures = [f"train {r['model']}{layout}: loss not finite"] if not all(v == v and abs(v) != float("inf")
                                                                           for v in losses) else []
    return (f"train {r['model']}{layout}: {r['batch']} x {seq} tokens per step{split(r['set'])}, {flags}",
            f"{x['tokens_per_s']:,.0f} tokens/s, MFU {100 * x['mfu']:.1f}%, peak memory "
            f"{x['peak_mem_bytes'] / 2**30:.1f} GiB, {1e3 * x['step_s']:.0f} ms per step "
            f"({r['steps']} timed){extra}"), failures


def split(overrides: list[str]) -> str:
    """' in N micro-batches of R rows' where micro_batches split the step, else ''."""
    sets = dict(o.split("=", 1) for o in overrides if "=" in o)
    accum = int(sets.get("trainer.grad_accum_steps", 1))
    return f" in {accum} micro-batches of {sets['trainer.micro_batch_size']}" if accum > 1 else ""


def _host_wait(x: dict) -> str:
    """The share of a profiled step the GPU waited on the host, or '-' when the row has no profile."""
    return f"{100 * x['host']['gpu_idle_share']:.0f}%" if x.get("host") else "-"


def train_graphs_rows(r: dict, done: dict):
    """A row per kind of CUDA graphs, as train's rows, with its tokens/s against train's row of the same
    model and the share of the step the GPU waited on the host, there and here."""
    trained = done.get("train", {}).get("runs", {}).get(r["model"], {}).get("result", {})
    base = trained.get("layouts", {}).get("single", [None])[0]
    rows, failures = [], []
    for name, (x, *_) in r["layouts"].items():
        (what, result), failed = _train_row(r, x, f" {name}")
        if base is not None:
            result = (f"{x['tokens_per_s'] / base['tokens_per_s']:.2f}x train's tokens/s, GPU waiting on the "
                      f"host {_host_wait(x)} of the step (train: {_host_wait(base)}); {result}")
        rows.append((what, result))
        failures += [f.replace("train ", "train_graphs ", 1) for f in failed]
    return rows, failures


def train_fp8_rows(r: dict, done: dict):
    """A row per precision this run measured, each against bf16: its own bf16 layout when it ran one, else
    train's row of the same model (same batch and length; train times more steps)."""
    seq = next(s.split("=", 1)[1] for s in r["set"] if s.startswith("trainer.seq_len="))
    base = r["layouts"].get("bf16", [None])[0]
    if base is None:
        trained = done.get("train", {}).get("runs", {}).get(r["model"], {}).get("result", {})
        base = trained.get("layouts", {}).get("single", [None])[0]
    rows, failures = [], []
    for name, (x, *_) in r["layouts"].items():
        losses = x.get("losses") or [float("nan")]
        ratio = ("" if name == "bf16" or base is None
                 else f" = {x['tokens_per_s'] / base['tokens_per_s']:.2f}x bf16")
        rows.append((f"train {r['model']} {name}: {r['batch']} x {seq} tokens per step{split(r['set'])}",
                     f"{x['tokens_per_s']:,.0f} tokens/s{ratio}, MFU {100 * x['mfu']:.1f}% (of the bf16 "
                     f"peak), peak memory {x['peak_mem_bytes'] / 2**30:.1f} GiB; loss {losses[0]:.3f} -> "
                     f"{losses[-1]:.3f} ({r['steps']} timed)"))
        if not all(v == v and abs(v) != float("inf") for v in losses):
            failures.append(f"train_fp8 {r['model']} {name}: loss not finite")
    return rows, failures


def attention_auto_rows(r: dict, done: dict):
    rows = [(f"attention auto bf16 {x['dims']} T={x['T']} B={x['B']} H={r['heads']}",
             f"picks {x['choice']}: " + ", ".join(f"{name} {x[f'{name}_fwdbwd_ms']:.2f} ms" for name in
                                                  ("triton", "sdpa") if f"{name}_fwdbwd_ms" in x)
             + " (forward+backward with max logits, auto's own timing)") for x in r["rows"]]
    return rows, ([] if r.get("complete") else ["attention_auto: cut short before every shape was timed"])


def peer_rows(r: dict, done: dict):
    runs = [{**r[name], "role": name} for name in ("titan", "dense", "kimi") if name in r]
    seq = next(s.split("=", 1)[1] for s in r["set"] if s.startswith("trainer.seq_len="))
    rows = [(f"peer {x['role']} {x['model']}: {r['batch']} x {seq} tokens per step{split(r['set'])}"
             + (" (train's row)" if x.get("reused") else ""),
             f"{x['tokens_per_s']:,.0f} tokens/s, MFU {100 * x['mfu']:.1f}%, peak memory "
             f"{x['peak_mem_bytes'] / 2**30:.1f} GiB, {1e3 * x['step_s']:.0f} ms per step") for x in runs]
    for a, b in zip(runs[1:], runs):  # dense / torchtitan (the framework), kimi / dense (the blocks)
        rows.append((f"peer {a['role']} / {b['role']} ({a['model']} / {b['model']})",
                     f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s, {a['mfu'] / b['mfu']:.2f}x "
                     f"MFU, {a['peak_mem_bytes'] / b['peak_mem_bytes']:.2f}x peak memory"))
    if "titan_skipped" in r:  # this machine's torch cannot run the torchtitan carried: said, not failed
        rows.append(("peer torchtitan", f"not run: {r['titan_skipped']}"))
    failures = [f"peer {x['model']}: loss not finite" for x in runs
                if not all(v == v and abs(v) != float("inf") for v in x.get("losses") or [float("nan")])]
    return rows, failures


def attnres_rows(r: dict, done: dict):
    rows, failures = [], []
    for x in r["rows"]:
        e, ms = x["errors"]["fused"], x["ms"]
        pred = "" if x["predicted_ms"] is None else f", roofline {x['predicted_ms']:.3f} ms"
        rows.append((f"fused AttnRes + pre-norm, {x['sources']} sources, T={r['T']} d={r['D']} bf16",
                     f"vs fp64 out {e['out']:.1e} grad {e['grad']:.1e} (pass < {x['limit']:.1e}); fwd+bwd "
                     + ", ".join(f"{name} {t:.3f} ms" for name, t in ms.items()) + pred))
        if not x["ok"]:
            failures.append(f"attnres {x['sources']} sources: fused {e['out']:.1e}/{e['grad']:.1e} from fp64 "
                            f"(pass < {x['limit']:.1e})")
    return rows, failures


# each (one command's JSON, the records of the steps before) -> (rows of (what, result), failures)
SUMMARIES = {"kda_check": kda_check_rows, "attention_check": attention_check_rows,
             "kda_speed": kda_speed_rows, "attention_speed": attention_speed_rows, "optim": optim_rows,
             "train": train_rows, "train_fp8": train_fp8_rows, "train_graphs": train_graphs_rows,
             "peer": peer_rows,
             "attention_auto": attention_auto_rows, "attnres": attnres_rows}


# ------------------------------------------------------------------------------------------ running them


def kill_group(proc: subprocess.Popen) -> None:
    """End a command and whatever it started: SIGTERM to its process group (start_new_session gave it one),
    time to exit (torchrun passes the signal on to its workers, which sit in sessions of their own and
    which it kills if they linger), then SIGKILL to whatever is left of the group."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        for _ in range(50):
            proc.poll()  # reap the command itself, so only live members keep the group
            os.killpg(proc.pid, 0)
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone
        pass
    proc.wait()


def run(argv: list[str], env: dict, timeout: float, log, verbose: bool) -> tuple[int | None, list[str]]:
    """(exit status, or None when it ran out of time; the last lines of its output). All output goes to
    the log, and with verbose to stdout too."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    tail = collections.deque(maxlen=LOG_TAIL)

    def pump():
        for line in proc.stdout:
            log.write(line)
            tail.append(line.rstrip("\n"))
            if verbose:
                sys.stdout.write(line)
                sys.stdout.flush()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        kill_group(proc)
        code = None
    except BaseException:  # Ctrl-C: take the command down too
        kill_group(proc)
        raise
    reader.join(timeout=10)
    log.flush()
    return code, list(tail)


def child_env(dry: bool, tmp: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    # nothing may wait on the network (the GPU machine has none); datasets' caches stay in the run's tmp
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(tmp / "hf_datasets"))
    if dry:  # triton reads it at import: the kernels are interpreted on CPU tensors; no GPU even if present
        env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    else:
        env.pop("TRITON_INTERPRET", None)
    return env


def run_step(step: str, index: int, args, ctx: Context, env: dict, deadline: float, log,
             done: dict | None = None) -> dict:
    """Run a step's commands under its cap and what is left of the total; its record. done: the records of
    the steps before (a step may read theirs: train_fp8 compares with train's bf16 row)."""
    title, budget = STEPS[step][0], args.caps[step]
    record = {"step": step, "title": title, "budget_s": budget, "dry_run": args.dry_run, "status": "ok",
              "seconds": 0.0, "summary": [], "failures": [], "runs": {}}
    start = time.monotonic()
    if deadline - start < 10:
        record.update(status="skipped", failures=[f"not run: the {args.total:.0f} s total was spent"])
        print(f"[gpu-check {index}/{len(args.steps)}] {step}: skipped, no time left", flush=True)
        return record
    print(f"[gpu-check {index}/{len(args.steps)}] {step} ({title}) ...", flush=True)
    layout = fastest_scores_layout(done or {}) if step in TRAINING_STEPS else None
    if layout and "KIMI_KDA_SCORES_GRID" not in env:  # a layout set by hand wins
        env = {**env, "KIMI_KDA_SCORES_GRID": layout[0]}
        print(f"    KIMI_KDA_SCORES_GRID={layout[0]}: {layout[1]}", flush=True)
    for name, script_args in commands(step, ctx):
        raw = ctx.tmp / f"{step}.{name}.json"
        argv = [sys.executable, str(BENCH / script_args[0]), *script_args[1:],
                *shlex.split(args.step_args.get(step, "")), "--out", str(raw)]
        if step in args.plant_failure:
            argv = argv + ["--plant-failure"] if step in CHECK_STEPS else [sys.executable, "-c",
                                                                             PLANTED_CRASH]
        if step in args.plant_hang:
            argv = [sys.executable, "-c", PLANTED_HANG]
        timeout = min(budget - (time.monotonic() - start), deadline - time.monotonic())
        if record["runs"] and timeout < 5:  # an earlier command of this step spent its budget
            record["runs"][name] = {"command": shlex.join(argv), "returncode": None, "seconds": 0.0,
                                    "status": "timeout", "log_tail": []}
            record["failures"].append(f"{name}: not started, the step's {budget:.0f} s were spent")
            continue
        log.write(f"\n===== {step} / {name}: {shlex.join(argv)}\n")
        log.flush()
        t0 = time.monotonic()
        code, tail = run(argv, env, timeout, log, args.verbose)
        entry = {"command": shlex.join(argv), "returncode": code, "seconds": round(time.monotonic() - t0, 1),
                 "log_tail": tail}
        result, rows, failures, unreadable = read_json(raw), [], [], None
        if result is not None:  # after a timeout too: the scripts write what they measured so far
            entry["result"] = result
            try:
                rows, failures = SUMMARIES[step](result, done or {})
            except (KeyError, TypeError, ValueError, ZeroDivisionError, StopIteration) as exc:
                unreadable = f"{name}: unreadable result ({type(exc).__name__}: {exc}); {_last_line(tail)}"
        if code is None:
            entry["status"] = "timeout"
            failures.append(f"{name}: out of time after {entry['seconds']:.0f} s (budget {budget:.0f} s)")
        elif result is None or unreadable:
            entry["status"] = "crashed"
            failures.append(unreadable or f"{name}: exit {code}, no result: {_last_line(tail)}")
        else:
            entry["status"] = "failed" if failures else "crashed" if code else "ok"
            if code and not failures:
                failures.append(f"{name}: exit {code}: {_last_line(tail)}")
        record["runs"][name] = entry
        record["summary"] += [list(row) for row in rows]
        record["failures"] += failures
        if deadline - time.monotonic() < 1:
            break
    if layout and env.get("KIMI_KDA_SCORES_GRID") == layout[0]:
        record["summary"].append([f"KDA scores layout {layout[0]}", layout[1]])
    statuses = [e["status"] for e in record["runs"].values()]
    record["status"] = next((s for s in ("crashed", "timeout", "failed") if s in statuses), "ok")
    record["seconds"] = round(time.monotonic() - start, 1)
    print(f"[gpu-check {index}/{len(args.steps)}] {step}: {record['status']}, {record['seconds']:.0f} s",
          flush=True)
    for failure in record["failures"]:
        print(f"    {failure}", flush=True)
    return record


def earlier_records(after: Path | None, steps: list[str]) -> dict[str, dict]:
    """The records of an earlier call (--after) of the steps this call does not run."""
    if after is None:
        return {}
    found = {step: read_json(after / f"{step}.json") for step in STEPS if step not in steps}
    return {step: record for step, record in found.items() if record is not None}


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):  # none, or cut short by a kill
        return None


def _last_line(tail: list[str]) -> str:
    return next((line.strip() for line in reversed(tail) if line.strip()), "(no output)")[:300]


def table(records: dict[str, dict], steps: list[str], started: float) -> str:
    """The markdown summary: a line on the machine, then one row per result."""
    results = [e["result"] for r in records.values() for e in r["runs"].values() if "result" in e]
    def first(*keys):
        for res in results:
            for source in (res, res.get("config", {})):
                if all(k in source for k in keys):
                    return source
        return {}
    env = first("device", "triton") or first("device", "torch")
    done = [records[s] for s in steps if s in records]
    counts = collections.Counter(r["status"] for r in done)
    dry = " (DRY RUN on CPU: plumbing, not measurements)" if done and done[0]["dry_run"] else ""
    when = f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC"
    head = (f"GPU check{dry}: {env.get('device', 'device unknown')}, torch {env.get('torch', '?')}, "
            f"triton {env.get('triton', '?')}, {when}; {len(done)} of {len(steps)} steps in "
            f"{time.monotonic() - started:.0f} s: "
            + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    lines = [head, "", "| step | what | result | status |", "|---|---|---|---|"]
    for step in steps:
        if step not in records:
            lines.append(f"| {step} | {STEPS[step][0]} | not run yet | - |")
            continue
        r = records[step]
        status = {"ok": "ok", "failed": "FAILED", "crashed": "CRASHED", "timeout": "OUT OF TIME",
                  "skipped": "SKIPPED"}[r["status"]]
        rows = r["summary"] or [(r["title"], "; ".join(r["failures"]) or "-")]
        for i, (what, result) in enumerate(rows):
            cell = f"{step} ({r['seconds']:.0f} s)" if i == 0 else ""
            lines.append(f"| {cell} | {_cell(what)} | {_cell(result)} | {status if i == 0 else ''} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return str(text).replace("|", "/").replace("\n", " ")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None,
                        help="results directory (default bench/results/gpu; a temporary one in a dry run)")
    parser.add_argument("--steps", nargs="+", choices=[*STEPS, "all"], default=list(PLAN),
                        help="which steps (run in the order of STEPS); default the plan: "
                             f"{' '.join(PLAN)}; all: every step")
    parser.add_argument("--plan", action="store_true",
                        help="print the steps in order with their caps and predicted seconds; run nothing")
    parser.add_argument("--dry-run", action="store_true", help="every step's code on CPU at tiny sizes")
    parser.add_argument("--total", type=float, default=None,
                        help=f"seconds for all steps (default {TOTAL}; {DRY_TOTAL} in a dry run): a step "
                             "gets its cap or what is left, whichever is less, then none run")
    parser.add_argument("--budget", nargs="+", default=[], metavar="NAME=SECONDS",
                        help="a step's own time limit")
    parser.add_argument("--step-args", nargs="+", default=[], metavar='NAME="ARGS"',
                        help="arguments appended to a step's commands")
    parser.add_argument("--after", type=Path, default=None, metavar="DIR",
                        help="an earlier call's results (its <step>.json files, carried to the machine): the "
                             "steps that compare with another's row read it there when it does not run now "
                             "(train_graphs and train_fp8 with train's)")
    parser.add_argument("--gpu-memory", type=float, default=None, metavar="GIB",
                        help="the GPU's memory, which sizes the training steps' micro-batches (default: "
                             "nvidia-smi's; in a dry run none, one micro-batch, unless given)")
    parser.add_argument("--verbose", action="store_true", help="show every command's output as it runs")
    parser.add_argument("--keep-tmp", action="store_true", help="keep the corpus, token cache and raw JSONs")
    parser.add_argument("--plant-failure", nargs="+", default=[], choices=list(STEPS), metavar="NAME",
                        help="tests: a check step's result is perturbed, any other step crashes")
    parser.add_argument("--plant-hang", nargs="+", default=[], choices=list(STEPS), metavar="NAME",
                        help="tests: the step hangs until its budget ends")
    args = parser.parse_args(argv)
    args.steps = [s for s in STEPS if s in args.steps or "all" in args.steps]
    args.total = args.total or (DRY_TOTAL if args.dry_run else TOTAL)
    for option in ("budget", "step_args"):
        pairs = {}
        for item in getattr(args, option):
            name, sep, value = item.partition("=")
            if not sep or name not in STEPS:
                parser.error(f"--{option.replace('_', '-')} {item!r}: expected NAME=VALUE with NAME one of "
                             f"{', '.join(STEPS)}")
            pairs[name] = float(value) if option == "budget" else value
        setattr(args, option, pairs)
    # the caps are GPU seconds; a dry run interprets the kernels on a CPU, so each step gets DRY_CAP there
    args.caps = {step: args.budget.get(step, DRY_CAP if args.dry_run else STEPS[step][1]) for step in STEPS}
    return args


def plan(args) -> str:
    """The steps in the order they run, each with its cap, the time it is predicted to take (PREDICTED)
    and when it is predicted to end; a step predicted to need more than it gets is marked."""
    lines = [f"gpu-check plan: {len(args.steps)} steps, at most {args.total:.0f} s in all; each step gets "
             "its cap or what is left, whichever is less, and writes <out>/<step>.json when it ends", "",
             "| # | step | what | cap | predicted | ends by | prediction rests on |",
             "|---|---|---|---|---|---|---|"]
    clock = 0.0
    for i, step in enumerate(args.steps, 1):
        cap, (predicted, basis) = args.caps[step], PREDICTED[step]
        gets = max(0.0, min(cap, args.total - clock))
        took = min(predicted, gets)
        mark = "" if predicted <= gets else f" (CUT: needs {predicted} s, gets {gets:.0f})"
        clock += took
        lines.append(f"| {i} | {step} | {STEPS[step][0]} | {cap:.0f} s | {predicted} s{mark} | "
                     f"{clock:.0f} s | {basis} |")
    lines += ["", f"predicted: {clock:.0f} s of the {args.total:.0f} s"]
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.plan:
        print(plan(args))
        return 0
    started = time.monotonic()
    deadline = started + args.total
    out = args.out or (Path(tempfile.mkdtemp(prefix="kimi-gpu-check-dry-")) if args.dry_run
                       else BENCH / "results" / "gpu")
    out.mkdir(parents=True, exist_ok=True)
    for name in [*(f"{s}.json" for s in STEPS), "summary.md", LOG]:  # no stale results beside new ones
        (out / name).unlink(missing_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="kimi-gpu-check-"))
    gpu_gib = args.gpu_memory if args.gpu_memory is not None or args.dry_run else gpu_memory_gib()
    ctx, env = Context(args.dry_run, tmp, gpu_gib), child_env(args.dry_run, tmp)
    print(f"[gpu-check] {len(args.steps)} steps{' (dry run on CPU)' if args.dry_run else ''}, at most "
          f"{args.total:.0f} s; results in {out}", flush=True)
    if gpu_gib is not None:
        batch, _, seq = TRAIN["1b"]
        rows = rows_per_micro_batch(batch, seq, gpu_gib)
        print(f"[gpu-check] GPU memory {gpu_gib:.1f} GiB: 1b's steps of {batch} x {seq} tokens train "
              f"{rows} row(s) per micro-batch, {batch // rows} micro-batch(es) per step", flush=True)
    records: dict[str, dict] = {}
    earlier = earlier_records(args.after, args.steps)
    summary = table(records, args.steps, started)
    try:
        with open(out / LOG, "w") as log:
            for index, step in enumerate(args.steps, 1):
                records[step] = run_step(step, index, args, ctx, env, deadline, log, {**earlier, **records})
                (out / f"{step}.json").write_text(json.dumps(records[step], indent=2) + "\n")
                summary = table(records, args.steps, started)  # printed at the end as written here
                (out / "summary.md").write_text(summary)
    finally:
        if not args.keep_tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print("\n" + summary)
    failures = [f"{step}: {f}" for step, r in records.items() for f in r["failures"]]
    for failure in failures:
        print(f"FAILED {failure}")
    print(f"results: {out} (summary.md, one JSON per step, {LOG})")
    return 1 if failures or any(r["status"] != "ok" for r in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
