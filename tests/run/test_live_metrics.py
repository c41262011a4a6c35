"""What a run shows while it trains: TensorBoard's event files beside metrics.jsonl (every scalar at its step,
each step once after a resume), the grouped names wandb and TensorBoard show, the step-time breakdown and the
window's memory peak in metrics.jsonl and the progress line, and loss_curve.png redrawn at each evaluation
with a blend's per-source validation losses."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from helpers import train_run

from kimi.config import ConfigError, LoggingConfig
from kimi.run.metrics import grouped_name, read_metrics
from kimi.run.validation import validate_logging

TIME_PARTS = ("time/data_s", "time/forward_backward_s", "time/optimizer_s", "time/other_s")


def scalars(folder: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of one TensorBoard tag in a folder's event files, as TensorBoard reads them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.mark.unit
@pytest.mark.parametrize("key, shown", [
    ("loss", "train/loss"), ("lr", "train/lr"), ("grad_norm", "train/grad_norm"), ("mfu", "train/mfu"),
    ("tokens_per_s", "train/tokens_per_s"), ("moe_imbalance", "train/moe_imbalance"),
    ("qk_max_logit", "train/qk_max_logit"), ("val_loss", "val/loss"), ("val_ppl", "val/ppl"),
    ("val_loss/books", "val/loss/books"), ("eval/hellaswag/acc", "eval/hellaswag/acc"),
    ("optim/grad_norm/muon", "optim/grad_norm/muon"),
    ("qk_max_logit/blocks.1.mixer", "qk_max_logit/blocks.1.mixer"),
    ("time/data_s", "time/data_s"), ("peak_memory_gib", "memory/peak_gib"), ("tokens", "tokens"),
])
def test_flat_keys_are_shown_in_groups(key, shown):
    assert grouped_name(key) == shown


@pytest.mark.unit
def test_tensorboard_without_its_package_is_one_line_naming_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    validate_logging(LoggingConfig())  # off by default: nothing asked of the package
    missing = r"^logging.tensorboard=true needs the tensorboard package, which is not installed: pip install"
    with pytest.raises(ConfigError, match=missing + r" -e '.\[tensorboard\]'") as e:
        validate_logging(LoggingConfig(tensorboard=True))
    assert "\n" not in str(e.value)


@pytest.mark.e2e
def test_tensorboard_has_every_logged_step_once_also_after_a_resume(tmp_path, data, capsys):
    run = tmp_path / "run"
    common = ["logging.tensorboard=true", "trainer.max_steps=4",
              "trainer.checkpoint_every=2", "trainer.eval_every=2"]
    train_run(run, data, *common)
    # the last checkpoint lost: the next start resumes at step 2 and logs steps 3 and 4 again
    shutil.rmtree(run / "checkpoints" / "step_00000004")
    train_run(run, data, *common)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one file per start
    rows = read_metrics(run / "metrics.jsonl")
    for key in ("loss", "val_loss", "lr", "time/step_s"):
        logged = [(r["step"], r[key]) for r in rows if key in r]
        shown = scalars(run / "tensorboard", grouped_name(key))
        assert [s for s, _ in shown] == [s for s, _ in logged], key  # each step once, in order
        assert [v for _, v in shown] == pytest.approx([v for _, v in logged], rel=1e-6), key
    per_step = 4 * 32  # TINY_TRAINER's micro-batch x seq_len
    by_tokens = scalars(run / "tensorboard" / "tokens", "train/loss")
    assert by_tokens == [(s * per_step, v) for s, v in scalars(run / "tensorboard", "train/loss")]


@pytest.mark.e2e
def test_the_step_time_breakdown_adds_up_and_the_progress_line_shows_it(tmp_path, data, capsys):
    run = tmp_path / "run"
    train_run(run, data, "trainer.max_steps=6", "trainer.log_every=2",
              "trainer.eval_every=2", "trainer.checkpoint_every=3")
    out = capsys.readouterr().out
    records = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in records] == [2, 4, 6]
    for r in records:
        step = r["time/step_s"]
        assert step == pytest.approx(4 * 32 / r["tokens_per_s"], rel=1e-6)  # the window's training time
        assert sum(r[k] for k in TIME_PARTS) == pytest.approx(step, rel=0.05), r
        assert all(r[k] >= 0 for k in TIME_PARTS)
        assert r["time/forward_backward_s"] > 0 and r["time/optimizer_s"] > 0
        # what the three timed parts leave is the loop's own bookkeeping: a small share of a step
        assert r["time/other_s"] < 0.25 * step, r
        assert r["memory/window_peak_gib"] > 0.05  # this process's peak resident memory (a CPU run)
    # evaluations and checkpoints are timed apart: each evaluation with its own record, a checkpoint with the
    # next record logged after it (step 3's with step 4's)
    assert all(r["time/eval_s"] > 0 for r in records) and "time/checkpoint_s" in records[1]
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    form = re.compile(r"\| ([\d.]+) ms/step \(data (\d+)%, fwd\+bwd (\d+)%, optim (\d+)%\) \|")
    shown = [form.search(line) for line in lines]
    assert len(shown) == 3 and all(shown), lines
    for m, r in zip(shown, records):
        assert float(m[1]) == pytest.approx(1e3 * r["time/step_s"], abs=0.05)
        assert int(m[3]) == round(100 * r["time/forward_backward_s"] / r["time/step_s"])


def blend(data: list[str]) -> list[str]:
    """The corpus of `data` as a blend of two sources, a and b (half its files each)."""
    files = next(d for d in data if d.startswith("data.data_files=")).split("=", 1)[1].strip("[]").split(",")
    half = len(files) // 2
    cache = next(d for d in data if d.startswith("data.cache_dir="))
    return [f"{cache}_blend", f"data.sources=[{{name:a,weight:1,data_files:[{','.join(files[:half])}]}},"
                              f"{{name:b,weight:1,data_files:[{','.join(files[half:])}]}}]"]


@pytest.mark.e2e
def test_the_loss_curve_is_redrawn_at_each_evaluation_with_the_blend_sources(tmp_path, data, monkeypatch):
    from PIL import Image

    from kimi.trainer import Trainer

    run, seen = tmp_path / "run", []
    save = Trainer.save_checkpoint

    def look_then_save(self, *args, **kwargs):  # after the step's evaluation, before the start's end
        png = run / "loss_curve.png"
        seen.append((self.step, Image.open(png).text["Description"] if png.exists() else None))
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "save_checkpoint", look_then_save)
    train_run(run, blend(data), "trainer.max_steps=6", "trainer.eval_every=2", "trainer.checkpoint_every=2",
              "trainer.stop_at_step=2", "logging.plot=true")
    assert seen == [(2, "lines: train loss; validation loss; validation loss: a; validation loss: b")]
    assert not list(run.glob(".loss_curve.png*"))  # written aside, then renamed over the old one


@pytest.mark.unit
def test_the_loss_curve_is_drawn_once_a_step_has_trained_and_not_again_unchanged(tmp_path, monkeypatch):
    """The step-0 evaluation draws nothing (one validation point is no curve); an evaluation after training
    draws; the run's end, right after its last evaluation, keeps that PNG instead of drawing it again."""
    import matplotlib.figure

    from kimi.run.metrics import MetricsLogger

    drawn = []
    savefig = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (drawn.append(1), savefig(fig, *a, **k))[1])
    cfg = LoggingConfig()
    cfg.wandb.mode = "disabled"
    metrics = MetricsLogger(tmp_path, cfg, {})
    png = tmp_path / "loss_curve.png"
    metrics.log({"step": 0, "val_loss": 7.0})
    assert not png.exists() and not drawn
    metrics.log({"step": 1, "loss": 6.5})
    metrics.log({"step": 1, "val_loss": 6.4})
    assert png.exists() and len(drawn) == 1
    assert metrics.plot(png) == png and len(drawn) == 1  # the end of the run: nothing new to draw
    metrics.log({"step": 2, "loss": 6.0})
    assert metrics.plot(png) == png and len(drawn) == 2
    png.unlink()  # a PNG removed meanwhile is drawn again
    assert metrics.plot(png) == png and len(drawn) == 3 and png.exists()
