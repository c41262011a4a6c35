"""python -m kimi.dashboard: one PNG of runs' metrics.jsonl, from a real short run and from records that carry
every diagnostic key (written here), without importing torch (a dashboard redrawn while a run trains starts
in a fraction of a second); panels without data are left out; the AttnRes heatmap's order."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest
from helpers import IMPORT_TIMES, ROOT, imported, train_run

from kimi import dashboard
from kimi.diagnostics import attnres_matrix

BASIC = ["loss (train; val: markers)", "learning rate", "tokens/s", "MFU (%)",
         "gradient norm (all; per optimizer family)"]
ALL = [title for title, _, _ in dashboard.PANELS]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory, data) -> Path:
    """3 steps of the tiny test model with MuonClip (QK-Clip tracks the MLA max logits), validated at each."""
    run = tmp_path_factory.mktemp("real") / "muonclip"
    train_run(run, data, "trainer.max_steps=3", "trainer.eval_every=1")
    return run


# Attention-Residual weights (Full AttnRes, 2 blocks) at two diagnostic steps; the keys in a shuffled order
SUBLAYERS = ["0.mixer", "0.mlp", "1.mixer", "1.mlp", "final"]
SOURCES = ["embed", "0.mixer", "0.mlp", "1.mixer", "1.mlp"]


def _attnres(step: int) -> dict:
    out = {}
    for i, sub in enumerate(SUBLAYERS):
        seen = SOURCES[:i + 1]
        for j, src in enumerate(seen):
            out[f"attnres/{sub}/{src}"] = (j + 1 + step) / sum(k + 1 + step for k in range(len(seen)))
    return dict(sorted(out.items(), key=lambda kv: kv[0][::-1]))


def _diagnostic_run(run: Path) -> Path:
    """Records with every key of the diagnostics contract (README: Diagnostics), written by hand."""
    records = [{"event": "start", "step": 0}]
    for step in (1, 2, 3, 4):
        r = {"step": step, "loss": 6 - step / 4, "lr": 1e-3 * step, "grad_norm": 1.0 / step,
             "tokens": 128 * step, "tokens_per_s": 1000.0 + step, "mfu": 0.01 * step,
             "qk_max_logit": 2.0 + step, "qk_clipped_frac": 0.25 * (step > 2)}
        for layer in ("blocks.1.mixer", "blocks.3.mixer"):
            r[f"qk_max_logit/{layer}"] = 1.5 + step
            r[f"qk_clipped_frac/{layer}"] = 0.5 * (step > 2)
            for h in range(2):
                r[f"qk_max_logit/{layer}/h{h}"] = 1.0 + step + h
        for i in (0, 2):
            r.update({f"kda/decay_mean/{i}": 0.9 - 0.01 * step, f"kda/decay_min/{i}": 0.3,
                      f"kda/decay_below_half/{i}": 0.1, f"kda/beta_mean/{i}": 0.5})
        for e in range(4):
            r[f"moe/load/1/e{e}"] = 0.25 + 0.05 * (e == 0)
        r["moe/load_max_over_mean/1"] = 1.2
        for fam in ("muon", "adamw"):
            r[f"optim/grad_norm/{fam}"] = 0.5 / step
            r[f"optim/update_rms/{fam}"] = 1e-3 * step
        if step % 2 == 0:  # diagnostics every other step; the heatmap shows the last (step 4)
            r.update(_attnres(step))
            r["val_loss"] = 6 - step / 3
        records.append(r)
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run


@pytest.mark.unit
def test_attnres_matrix_orders_sublayers_and_sources():
    record = {"attnres/final/partial": 0.1, "attnres/10.mlp/block2": 0.2, "attnres/2.mixer/embed": 1.0,
              "attnres/10.mixer/block1": 0.3, "attnres/2.mlp/partial": 0.4, "attnres/final/block1": 0.5,
              "attnres/final/embed": 0.4, "loss": 3.0, "qk_max_logit/blocks.1.mixer": 2.0}
    rows, cols, values = attnres_matrix(record)
    assert rows == ["2.mixer", "2.mlp", "10.mixer", "10.mlp", "final"]
    assert cols == ["embed", "block1", "block2", "partial"]
    assert values[4][:2] == [0.4, 0.5] and values[2][1] == 0.3 and str(values[0][1]) == "nan"
    full = attnres_matrix(_attnres(4))
    assert full[0] == SUBLAYERS and full[1] == SOURCES
    assert attnres_matrix({"loss": 1.0}) == ([], [], [])


@pytest.mark.e2e
def test_dashboard_of_a_real_run_and_a_diagnostic_run(tmp_path, real_run):
    diag = _diagnostic_run(tmp_path / "diag")
    d = dashboard.draw([diag, real_run], tmp_path / "both.png")
    assert d.panels[:len(ALL)] == ALL, d.panels  # every quantity had data in the diagnostic run
    assert d.panels[-1] == "AttnRes weights: diag, step 4" and len(d.panels) == len(ALL) + 1
    rows, cols, values = d.attnres
    assert (rows, cols) == (SUBLAYERS, SOURCES) and d.attnres_step == 4
    assert values[4][4] == pytest.approx(_attnres(4)["attnres/final/1.mlp"])
    h, w = matplotlib.image.imread(d.path).shape[:2]
    assert (w, h) == d.size and w >= 1500 and h >= 1800  # 3 columns x 5 rows of panels

    # the real run alone: what the trainer logs (its own panels), nothing invented
    real = dashboard.draw([real_run], tmp_path / "real.png")
    assert real.panels[:len(BASIC)] == BASIC
    assert "QK max logit (worst MLA head)" in real.panels  # MuonClip's QK-Clip tracks the MLA layer's logits
    assert "MoE load: max / mean tokens per expert" in real.skipped  # a dense model
    assert set(real.panels) | set(real.skipped) >= set(ALL)


@pytest.mark.unit
def test_panels_without_data_are_left_out(tmp_path):
    run = tmp_path / "adamw"
    run.mkdir()
    records = [{"step": s, "loss": 5.0 - s, "lr": 1e-3, "grad_norm": 1.0, "tokens": 64 * s,
                "tokens_per_s": 900.0, "mfu": 0.1} for s in (1, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    d = dashboard.draw([run], tmp_path / "d.png")
    assert d.panels == BASIC and d.attnres is None
    assert set(d.skipped) == set(ALL) - set(BASIC)
    h, w = matplotlib.image.imread(d.path).shape[:2]
    assert (w, h) == d.size == (3 * 540, 2 * 370)


@pytest.mark.unit
def test_a_blend_per_source_validation_losses_are_lines_of_the_loss_panel(tmp_path):
    run = tmp_path / "blend"
    run.mkdir()
    records = [{"step": s, "loss": 5.0 - s, "val_loss": 5.5 - s, "val_loss/books": 5.0 - s,
                "val_loss/web": 6.0 - s} for s in (0, 2)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    d = dashboard.draw([run], tmp_path / "d.png")
    assert d.lines[BASIC[0]] == ["blend train", "blend val", "blend val books", "blend val web"]


@pytest.mark.e2e
def test_command_line(tmp_path, real_run):
    out = tmp_path / "dash.png"
    env = {**os.environ, "OMP_NUM_THREADS": "1", **IMPORT_TIMES}
    diag = _diagnostic_run(tmp_path / "d")
    proc = subprocess.run([sys.executable, "-m", "kimi.dashboard", f"runs=[{diag},{real_run}]", f"out={out}"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert imported(proc.stderr, "matplotlib") and not imported(proc.stderr, "torch")
    assert f"wrote {out}" in proc.stdout and f"{len(ALL) + 1} panels" in proc.stdout
    assert out.stat().st_size > 50_000


@pytest.mark.unit
def test_a_directory_without_metrics_is_refused(tmp_path, capsys):
    assert dashboard.main([f"runs={tmp_path / 'nothing'}"]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


@pytest.mark.unit
@pytest.mark.parametrize("argv, words", [
    (["runs/a", "--out", "x.png"], "'runs/a': kimi.dashboard takes key=value arguments (runs, out, columns), "
                                   "e.g. runs=runs/a"),
    (["runs=[a,b]", "--out=x.png"], "--out=x.png: kimi.dashboard takes key=value arguments; write out=x.png"),
    (["runs=a", "colums=2"], "colums: not an argument of kimi.dashboard; did you mean columns?"),
    (["runs=a", "columns=0"], "columns=0 is invalid: must be an integer >= 1"),
    (["out=x.png"], "no runs: give the run directories, e.g. runs=[runs/a,runs/b]"),
])
def test_arguments_are_key_value(argv, words, capsys):
    """The old argparse style (a positional run dir, --out) and other mistakes: one line, exit code 2."""
    assert dashboard.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {words}") and err.count("\n") == 1, err


@pytest.mark.unit
def test_wandb_offline_reader_refuses_what_is_not_an_offline_run(tmp_path, capsys):
    from kimi import wandb_offline

    assert wandb_offline.main([f"run={tmp_path}"]) == 2
    assert "logging.wandb.mode=offline" in capsys.readouterr().err
    bad = tmp_path / "wandb" / "offline-run-1" / "run-1.wandb"
    bad.parent.mkdir(parents=True)
    bad.write_bytes(b"not wandb")
    assert wandb_offline.main([f"run={tmp_path}"]) == 2
    assert "is not a wandb run file" in capsys.readouterr().err
    assert wandb_offline.main([str(tmp_path)]) == 2  # the old positional style
    assert "takes key=value arguments (run, json), e.g. run=" in capsys.readouterr().err
