"""The ablation study (kimi/ablate/, conf/experiment/ablate_*.yaml, conf/ablate/): each experiment varies
one factor; the runner trains an experiment end to end, resumes (a rerun skips finished runs), runs the lr
sweep before the seeds; Hydra's multirun names the runs as the runner does; the report's statistics and
files."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ROOT, TINY_TRAINER

from kimi import ablate, checkpoint
from kimi.run.metrics import read_metrics

# What each arm must set, and which keys an arm may change at all (everything else equal to the baseline).
ARMS = {
    "ablate_optimizer": ({"adamw": {"optim.name": "adamw", "optim.qk_clip_tau": 0.0},
                          "adamw_qkclip": {"optim.name": "adamw", "optim.qk_clip_tau": 100.0},
                          "muonclip": {"optim.name": "muonclip", "optim.qk_clip_tau": 100.0}}, ("optim.",)),
    "ablate_mixer": ({"all_mla": {"model.mla_every": 1}, "hybrid_3to1": {"model.mla_every": 4},
                      "all_kda": {"model.mla_every": 0}}, ("model.mla_every",)),
    "ablate_residual": ({a: {"model.residual": a} for a in ("standard", "attnres_block", "attnres_full")},
                        ("model.residual",)),
    "ablate_qk_clip": ({"off": {"optim.qk_clip_tau": 0.0}, "tau100": {"optim.qk_clip_tau": 100.0},
                        "tau2": {"optim.qk_clip_tau": 2.0}}, ("optim.qk_clip_tau",)),
    "ablate_muon_split": ({"whole": {"optim.muon_split_fused": False},
                           "split": {"optim.muon_split_fused": True}}, ("optim.muon_split_fused",)),
    **{f"ablate_depth{n}": ({a: {"model.residual": a, "model.num_layers": n, "model.d_model": 64}
                             for a in ("standard", "attnres_block")}, ("model.residual",)) for n in (8, 16)},
    "ablate_k3_balance": ({a: {"model.moe.balance": a, "model.moe.groups": 1} for a in ("sign", "quantile")},
                          ("model.moe.balance",)),
    "ablate_k3_moe": ({"plain": {"model.moe.latent_dim": 0, "model.mlp.activation": "swiglu"},
                       "latent_situ": {"model.moe.latent_dim": 64, "model.mlp.activation": "situ"}},
                      ("model.moe.latent", "model.mlp.activation")),
    "ablate_k3_mla_gate": ({"ungated": {"model.mla.output_gate": False},
                            "gated": {"model.mla.output_gate": True}}, ("model.mla.output_gate",)),
    "ablate_k3_kda_gate": ({"unbounded": {"model.kda.gate_lower_bound": None},
                            "safe": {"model.kda.gate_lower_bound": -5.0}}, ("model.kda.gate_lower_bound",)),
    "ablate_k3_muon_heads": ({"per_matrix": {"optim.muon_per_head": False},
                              "per_head": {"optim.muon_per_head": True}}, ("optim.muon_per_head",)),
}


def _compose(*overrides: str):
    from hydra import compose, initialize_config_dir

    from kimi.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["trainer.run_dir=unused", *overrides])


@pytest.mark.slow
@pytest.mark.unit
def test_each_experiment_varies_one_factor():
    from omegaconf import OmegaConf

    assert ablate.experiment_names() == list(ablate.ORDER)
    for name, (arms, allowed) in ARMS.items():
        exp = ablate.load_experiment(name)  # also checks hydra.sweep.subdir against the runner's names
        assert exp.arms == list(arms) and exp.seeds == [1, 2, 3], name
        configs = {a: checkpoint.flatten(OmegaConf.to_container(_compose(f"+experiment={name}",
                                                                         f"+ablate/{name}={a}")))
                   for a in exp.arms}
        base = configs[exp.baseline]
        scale = (base["trainer.max_steps"], base["trainer.eval_every"], base["model.name"])
        assert scale == (600, 50,
                         "moe_tiny" if name in ("ablate_k3_balance", "ablate_k3_moe") else "tiny"), name
        for arm, expect in arms.items():
            cfg = configs[arm]
            assert {k: cfg[k] for k in expect} == expect, (name, arm)
            changed = {k for k in set(cfg) | set(base) if cfg.get(k) != base.get(k)}
            assert all(k.startswith(allowed) for k in changed), (name, arm, changed)
    assert ablate.load_experiment("ablate_optimizer").sweep == [("optim.lr", ["0.001", "0.003", "0.01"])]


@pytest.mark.unit
def test_run_names_parse_back():
    exp = ablate.load_experiment("ablate_optimizer")
    for arm in exp.arms:
        for values in exp.grid():
            name = exp.run_name(arm, values, 3)
            assert exp.parse_name(name) == (arm, values, 3), name
    assert exp.run_name("adamw_qkclip", {"optim.lr": "0.003"}, 1) == "adamw_qkclip_lr0.003_seed1"
    assert exp.parse_name("adamw_seedx") is None and exp.parse_name("sgd_lr0.1_seed1") is None


@pytest.mark.slow
@pytest.mark.unit
def test_overrides_that_erase_the_factor_are_refused(tmp_path):
    """An override after -- applies to every arm: one that sets the swept key or makes two arms equal would
    waste the study, so nothing runs."""
    with pytest.raises(ablate.AblateError, match="sweeps optim.lr"):
        ablate.run_study(["ablate_optimizer"], tmp_path, tmp_path, [1], ["optim.lr=0.01"], dry_run=True,
                         log=print)
    with pytest.raises(ablate.AblateError, match="arms all_mla and hybrid_3to1 are the same config"):
        ablate.run_study(["ablate_mixer"], tmp_path, tmp_path, [1], ["model.mla_every=2"], dry_run=True,
                         log=print)
    assert not any(tmp_path.iterdir())


def _run(argv, timeout=240):
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.mark.e2e
def test_runner_end_to_end_then_report_then_resume(tmp_path, data, capsys):
    """Two arms x one seed, 2 steps of the tiny test model; a rerun trains nothing; the report's JSON, PNGs
    and results section, also into a page (--docs). (The rerun and the report run in this process: the same
    main() as the command.)"""
    from omegaconf import OmegaConf

    root, out = tmp_path / "runs", tmp_path / "results"
    cmd = [sys.executable, "-m", "kimi.ablate", "ablate_muon_split", "--seeds", "1", "--steps", "2", "--root",
           str(root), "--out", str(out), "--quiet", "--", *TINY_TRAINER, *data, "trainer.eval_every=1"]
    first = _run(cmd)
    assert "2 trained" in first.splitlines()[-1], first
    runs = {arm: root / "ablate_muon_split" / f"{arm}_seed1" for arm in ("whole", "split")}
    for arm, run in runs.items():
        assert ablate.status(run, 2) == "done"
        cfg = OmegaConf.load(run / "config.yaml")
        assert cfg.optim.muon_split_fused == (arm == "split") and cfg.trainer.seed == 1
        assert cfg.logging.wandb.name == f"ablate_muon_split/{arm}_seed1"
        if "group" in cfg.logging.wandb:  # the config has wandb grouping: the runner sets it
            assert cfg.logging.wandb.group == "ablate_muon_split"
            assert list(cfg.logging.wandb.tags) == [arm, "seed=1"]
    stamps = {p: p.stat().st_mtime_ns for p in root.rglob("metrics.jsonl")}

    capsys.readouterr()
    assert ablate.main(cmd[3:]) == 0
    second = capsys.readouterr().out
    assert second.splitlines()[-1].startswith("[ablate] 2 done;"), second
    assert {p: p.stat().st_mtime_ns for p in root.rglob("metrics.jsonl")} == stamps  # nothing trained again

    assert ablate.main(["report", "ablate_muon_split", "--root", str(root), "--out", str(out)]) == 0
    report = capsys.readouterr().out
    result = json.loads((out / "ablate_muon_split.json").read_text())
    assert result["baseline"] == "whole" and [a["arm"] for a in result["arms"]] == ["whole", "split"]
    for a in result["arms"]:
        vals = [r["val_loss"] for r in read_metrics(runs[a["arm"]] / "metrics.jsonl") if r.get("step") == 2
                and "val_loss" in r]
        assert a["seeds"] == [1] and a["final_val_loss"] == [vals[-1]] and math.isfinite(a["mean"])
        assert a["params"] > 40_000 and a["flops_per_token"] > 6 * a["params"] * 0.5
        assert a["train_flops"] == pytest.approx(a["flops_per_token"] * 2 * 4 * 32)
        assert a["tokens_per_s"] > 0 and [p["step"] for p in a["curve"]] == [0, 1, 2]
    assert result["arms"][1]["verdict"] == "no verdict (one seed)"
    section = (out / "README_section.md").read_text()
    assert "| `whole` |" in section and "| `split` |" in section and ablate.RULE in section
    assert section.strip() in report
    import matplotlib.image

    for png in ("ablate_muon_split.png", "cost_vs_loss.png"):
        h, w = matplotlib.image.imread(out / png).shape[:2]
        assert w > 1000 and h > 400, (png, w, h)

    # each run left a record in <out>/runs: without the run dirs (a fresh clone of a committed study) the
    # runs are still finished and the report is the same
    recs = {r["run"]: r for r in ablate.records.of_experiment(out, "ablate_muon_split")}
    assert set(recs) == {"whole_seed1", "split_seed1"} and recs["whole_seed1"]["status"] == "done"
    assert recs["whole_seed1"]["fingerprint"] != recs["split_seed1"]["fingerprint"]
    # the machine's rate, recovered from the logged MFU: the one the run printed
    for arm, run in runs.items():
        said = re.search(r"MFU against ([\d.]+) ([TGM])FLOP/s", (run / "train.log").read_text())
        unit = {"T": 1e12, "G": 1e9, "M": 1e6}[said.group(2)]
        assert recs[f"{arm}_seed1"]["peak_flops"] == pytest.approx(float(said.group(1)) * unit,
                                                                   abs=0.051 * unit)
    assert "Machine: one kind for every run" in section
    import shutil

    shutil.rmtree(root)
    assert ablate.main(cmd[3:]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("[ablate] 2 done;")
    assert not root.exists() or not any(root.rglob("metrics.jsonl"))  # nothing trained
    again = ablate.report(["ablate_muon_split"], root, out, log=lambda _: None)[0]
    assert [a["final_val_loss"] for a in again["arms"]] == [a["final_val_loss"] for a in result["arms"]]
    # --docs puts the section between the page's markers, its plots linked from the page's directory, and
    # leaves the rest of the page (and README_section.md) alone
    from kimi.ablate.report import SECTION_BEGIN, SECTION_END

    page = tmp_path / "docs" / "ablations.md"
    page.parent.mkdir()
    page.write_text(f"# title\n{SECTION_BEGIN}\nold\n{SECTION_END}\ntail\n")
    assert ablate.main(["report", "ablate_muon_split", "--root", str(root), "--out", str(out), "--docs",
                        str(page)]) == 0
    text = page.read_text()
    assert text.startswith("# title\n") and text.endswith(f"{SECTION_END}\ntail\n")
    assert "old" not in text and (out / "README_section.md").read_text() == section
    plots = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(plots) == ["../results/ablate_muon_split.png", "../results/cost_vs_loss.png"], plots
    assert all((page.parent / p).is_file() for p in plots)
    linked_from_root = re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", lambda m: f"![{m[1]}](LINK)", section)
    assert re.sub(r"!\[([^\]]*)\]\(([^)]+)\)", lambda m: f"![{m[1]}](LINK)", text).count(
        linked_from_root.strip()) == 1  # the same section but for its links
    page.write_text("no markers\n")
    assert ablate.main(["report", "--root", str(root), "--out", str(out), "--docs", str(page)]) == 2
    assert "has no place for the results" in capsys.readouterr().err
    # a study of another scale in the same --out is refused, not answered with these records
    longer = cmd[3:]
    longer[longer.index("--steps") + 1] = "3"
    assert ablate.main(longer) == 2
    assert "records a run of another config" in capsys.readouterr().err


@pytest.mark.e2e
def test_hydra_multirun_names_runs_like_the_runner(tmp_path, data):
    """train.py -m +experiment=ablate_residual: one run dir per arm, named as kimi.ablate names them."""
    from omegaconf import OmegaConf

    sweep = tmp_path / "multirun"
    _run([sys.executable, "train.py", "-m", "+experiment=ablate_residual", "trainer.seed=1", *TINY_TRAINER,
          *data, "trainer.max_steps=2", "trainer.eval_every=0", f"hydra.sweep.dir={sweep}"])
    exp = ablate.load_experiment("ablate_residual")
    assert {p.name for p in sweep.iterdir() if p.is_dir()} == {exp.run_name(a, {}, 1) for a in exp.arms}
    for arm in exp.arms:
        run = sweep / exp.run_name(arm, {}, 1)
        assert ablate.status(run, 2) == "done"
        assert OmegaConf.load(run / "config.yaml").model.residual == arm


_CONFIGS: dict = {}


def _fake_run(run: Path, arm: str, lr: str | None, seed: int, final: float | None, steps: int = 600,
              experiment: str = "ablate_optimizer") -> None:
    """A finished run dir without training: config.yaml as train.py writes it, a linear validation curve from
    7.0 to `final`, the COMPLETE marker (final None: a run that diverged and exited with 1)."""
    from omegaconf import OmegaConf

    if (experiment, arm) not in _CONFIGS:
        _CONFIGS[experiment, arm] = _compose(f"+experiment={experiment}", f"+ablate/{experiment}={arm}",
                                             "model.vocab_size=2048")
    cfg = _CONFIGS[experiment, arm].copy()
    cfg.trainer.seed = seed
    if lr is not None:
        cfg.optim.lr = float(lr)
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    records = [{"event": "start", "step": 0}]
    for step in range(0, steps + 1, 100):
        if step:
            records.append({"step": step, "loss": 5.0, "lr": 1e-3, "tokens": step * 2048,
                            "tokens_per_s": 5000.0})
        if final is not None:
            records.append({"step": step, "val_loss": 7.0 - (7.0 - final) * step / steps})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if final is None:
        (run / "exit_code").write_text("1\n")
    else:
        (run / "checkpoints" / f"step_{steps:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"step_{steps:08d}" / "COMPLETE").write_text("{}")


# seed-1 final losses of the sweep: adamw best at 0.003, adamw_qkclip's 0.01 diverged, muonclip's best at the
# grid's edge
SWEEP = {"adamw": {"0.001": 4.3, "0.003": 4.0, "0.01": 4.2}, "adamw_qkclip": {"0.001": 4.01, "0.003": 4.05,
                                                                              "0.01": None},
         "muonclip": {"0.001": 4.1, "0.003": 3.9, "0.01": 3.8}}


@pytest.mark.slow
@pytest.mark.unit
def test_sweep_then_seeds_and_statistics(tmp_path):
    """The lr sweep decides which runs the other seeds get; the report's means, verdicts and compute
    multipliers on runs with known curves."""
    root = tmp_path / "runs"
    exp = ablate.load_experiment("ablate_optimizer")
    for arm, losses in SWEEP.items():
        for lr, final in losses.items():
            _fake_run(root / exp.name / exp.run_name(arm, {"optim.lr": lr}, 1), arm, lr, 1, final)
    lines: list = []
    out = tmp_path / "out"
    counts = ablate.run_study([exp.name], root, out, [1, 2], [], dry_run=True, log=lines.append)
    assert counts["done"] == 8 and counts["skipped"] == 1 and counts["planned"] == 3, lines
    planned = sorted(line.split()[1].rstrip(":") for line in lines if "would run" in line)
    assert planned == ["adamw_lr0.003_seed2", "adamw_qkclip_lr0.001_seed2", "muonclip_lr0.01_seed2"]
    retried = ablate.run_study([exp.name], root, out, [1, 2], [], dry_run=True, retry_failed=True,
                               log=lambda _: None)
    assert retried["planned"] == 4
    with pytest.raises(ablate.AblateError, match="started with trainer.max_steps=600, this study runs 300"):
        ablate.run_study([exp.name], root, out, [1, 2], ["trainer.max_steps=300"], dry_run=True,
                         log=lambda _: None)

    # the seeds' runs, then the report: adamw 4.0/4.02 (baseline), adamw_qkclip 4.01/4.03 (a tie), muonclip
    # 3.8/3.82 (a win)
    for arm, lr, final in (("adamw", "0.003", 4.02), ("adamw_qkclip", "0.001", 4.03),
                           ("muonclip", "0.01", 3.82)):
        _fake_run(root / exp.name / exp.run_name(arm, {"optim.lr": lr}, 2), arm, lr, 2, final)
    results = ablate.report([exp.name], root, tmp_path / "out", log=lambda _: None)
    arms = {a["arm"]: a for a in results[0]["arms"]}
    assert {a: r["chosen"] for a, r in results[0]["sweep"].items()} == {
        "adamw": {"optim.lr": "0.003"}, "adamw_qkclip": {"optim.lr": "0.001"},
        "muonclip": {"optim.lr": "0.01"}}
    sweep = results[0]["sweep"]
    assert sweep["muonclip"]["at_grid_edge"] and not sweep["adamw"]["at_grid_edge"]
    assert arms["adamw"]["mean"] == pytest.approx(4.01)
    assert arms["adamw"]["std"] == pytest.approx(0.02 / 2**0.5)
    assert [arms[a]["verdict"] for a in SWEEP] == ["baseline", "tie", "win"]
    # linear curves from 7.0: muonclip's mean (3.81) reaches 4.01 at 600 * 2.99 / 3.19 steps
    assert arms["muonclip"]["tokens_to_baseline"] == pytest.approx(600 * 2048 * 2.99 / 3.19)
    assert arms["muonclip"]["compute_multiplier"] == pytest.approx(3.19 / 2.99)
    assert arms["adamw"]["compute_multiplier"] == pytest.approx(1.0)
    assert arms["adamw_qkclip"]["tokens_to_baseline"] is None  # its mean (4.02) never reaches 4.01
    section = (tmp_path / "out" / "README_section.md").read_text()
    assert "Moonlight" in section and "0.01 (grid edge)" in section and "diverged" not in section
    assert "| `adamw_qkclip` | 4.0100 | 4.0500 | failed |" in section
    assert ("compute multiplier of 1.07x); verdict on the final loss: win; this agrees with the paper."
            in section)


@pytest.mark.slow
@pytest.mark.unit
def test_the_same_run_in_two_experiments_is_trained_once(tmp_path):
    """The default config is an arm of four experiments: its fingerprint is the same in each (and no other
    arm's is), and once one of them has finished, the others reuse its record instead of training."""
    def fp(name, arm, seed=1, values=None):
        exp = ablate.load_experiment(name)
        return ablate.study.run_fingerprint(ablate.study.plan_run(exp, tmp_path, arm, values or {}, seed), [])

    default = fp("ablate_qk_clip", "tau100")
    assert fp("ablate_mixer", "hybrid_3to1") == fp("ablate_residual", "attnres_block") == default
    assert fp("ablate_optimizer", "muonclip", values={"optim.lr": "0.003"}) == default
    others = [fp("ablate_mixer", "all_mla"), fp("ablate_residual", "standard"), fp("ablate_qk_clip", "off"),
              fp("ablate_muon_split", "split"), fp("ablate_qk_clip", "tau100", seed=2),
              fp("ablate_optimizer", "muonclip", values={"optim.lr": "0.01"}),
              fp("ablate_optimizer", "adamw_qkclip", values={"optim.lr": "0.003"})]
    assert default not in others and len(set(others)) == len(others)

    root, out = tmp_path / "runs", tmp_path / "out"
    _fake_run(root / "ablate_qk_clip" / "tau100_seed1", "tau100", None, 1, 3.9, experiment="ablate_qk_clip")
    quiet = lambda _: None  # noqa: E731
    # a run dir finished before records were kept gets one (nothing is trained: it is done)
    counts = ablate.run_study(["ablate_qk_clip"], root, out, [1], [], arms=["tau100"], log=quiet)
    assert counts["done"] == 1 and counts["trained"] == 0
    original = ablate.records.read(out, "ablate_qk_clip", "tau100_seed1")
    assert original["fingerprint"] == default and original["final_val_loss"] == pytest.approx(3.9)

    lines: list = []
    counts = ablate.run_study(["ablate_residual"], root, out, [1, 2], [], arms=["attnres_block"],
                              dry_run=True, log=lines.append)
    assert counts["shared"] == 1 and counts["planned"] == 1, lines  # seed 2 has no twin
    assert not (out / "runs" / "ablate_residual").exists()  # a dry run writes nothing
    counts = ablate.run_study(["ablate_residual"], root, out, [1], [], arms=["attnres_block"], log=quiet)
    assert counts["shared"] == 1 and counts["trained"] == 0
    twin = ablate.records.read(out, "ablate_residual", "attnres_block_seed1")
    assert twin["same_as"] == "ablate_qk_clip/tau100_seed1" and twin["arm"] == "attnres_block"
    assert twin["evals"] == original["evals"]
    again = ablate.run_study(["ablate_residual"], root, out, [1], [], arms=["attnres_block"], log=quiet)
    assert again["done"] == 1 and again["shared"] == 0
    result = ablate.report(["ablate_residual"], root, out, log=quiet)[0]
    assert result["arms"][0]["final_val_loss"] == [pytest.approx(3.9)]
    section = (out / "README_section.md").read_text()
    assert "`attnres_block_seed1` is `ablate_qk_clip/tau100_seed1`" in section
    assert "verdict on the final loss: no verdict; no verdict yet to set beside the paper" in section


@pytest.mark.unit
def test_the_report_says_whether_each_paper_is_borne_out():
    """The section's sentence beside each paper follows the verdict on the paper's arm: a tie does not
    confirm a claimed gain, and 'at least as good' (Kimi Linear) is borne out by a tie."""
    from kimi.ablate.report import PAPERS, paper_agreement

    _, arm, agreeing = PAPERS["ablate_residual"]
    assert arm == "attnres_block"
    assert paper_agreement("win", agreeing) == "this agrees with the paper"
    assert "not seen at this scale" in paper_agreement("tie", agreeing)
    assert "disagrees with the paper" in paper_agreement("loss", agreeing)
    assert paper_agreement("tie", PAPERS["ablate_mixer"][2]) == "this agrees with the paper"
    assert "disagrees" in paper_agreement("loss", PAPERS["ablate_mixer"][2])


@pytest.mark.unit
def test_the_report_names_the_machines_behind_its_tokens_per_s():
    """Runs are told apart by the peak their MFU divided by: within 15% is one kind of machine; records
    without it (older ones) are counted, so a table's tokens/s never silently mix machines."""
    from kimi.ablate.report import machines_note

    one = machines_note([{"arm": "a", "peak_flops": [370e9, 380e9]}, {"arm": "b", "peak_flops": [375e9]}])
    assert one == "Machine: one kind for every run (the peak MFU divides by: 375 GFLOP/s (3 runs))."
    two = machines_note([{"arm": "a", "peak_flops": [64e9, 66e9]}, {"arm": "b", "peak_flops": [375e9, None]}])
    assert "65 GFLOP/s (2 runs), 375 GFLOP/s (1 run), and 1 run whose record predates it" in two
    assert two.endswith("tokens/s compare only between runs of one machine.")
    assert "predate" in machines_note([{"arm": "a", "peak_flops": [None, None]}])


@pytest.mark.unit
def test_the_docs_page_holds_the_report_of_the_committed_records(tmp_path):
    """docs/ablations.md shows, between its markers, exactly what `python -m kimi.ablate report --docs` writes
    from the committed records (bench/results/ablations/runs/), its plots linked from docs/ and present."""
    from kimi.ablate.report import DOCS_PAGE, SECTION_BEGIN, SECTION_END, markdown

    out = ablate.DEFAULT_OUT
    names = [n for n in ablate.experiment_names() if (out / "runs" / n).is_dir()]
    assert names, "no committed ablation records"
    results = []
    for name in names:  # as report() does, reading nothing but the records (tmp_path: no run dirs)
        result = ablate.analyse(ablate.load_experiment(name), tmp_path, out)
        if result is not None:
            result["sweep_keys"] = ablate.load_experiment(name).sweep
            results.append(result)
    text = DOCS_PAGE.read_text()
    assert text.count(SECTION_BEGIN) == 1 and text.count(SECTION_END) == 1
    shown = text[text.index(SECTION_BEGIN) + len(SECTION_BEGIN):text.index(SECTION_END)].strip()
    assert shown == markdown(results, out, links_from=DOCS_PAGE.parent).strip(), (
        "docs/ablations.md's results differ from the committed records' report: run "
        "python -m kimi.ablate report --docs")
    plots = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", shown)
    assert len(plots) == len(results) + 1 and all((DOCS_PAGE.parent / p).is_file() for p in plots), plots


@pytest.mark.unit
def test_key_value_options_are_the_flags():
    """kimi.ablate's key=value options (every kimi command's style) mean the --flags they stand for."""
    from kimi.ablate import as_flags

    words = ["ablate_mixer", "seeds=[1,2]", "steps=300", "arms=[all_mla,hybrid_3to1]", "dry_run=true",
             "quiet=false", "out=bench/x"]
    assert as_flags(words) == ["ablate_mixer", "--seeds", "1", "2", "--steps", "300", "--arms", "all_mla",
                               "hybrid_3to1", "--dry-run", "--out", "bench/x"]
    assert as_flags(["report", "docs=true"]) == ["report", "--docs"]
    assert as_flags(["report", "docs=page.md"]) == ["report", "--docs", "page.md"]
    assert as_flags(["list", "--seeds", "1"]) == ["list", "--seeds", "1"]  # the older flags still read
    with pytest.raises(ablate.AblateError, match="seed=1: kimi.ablate's options are"):
        as_flags(["all", "seed=1"])
    with pytest.raises(ablate.AblateError, match="dry_run is true or false"):
        as_flags(["all", "dry_run=maybe"])


@pytest.mark.unit
def test_a_record_survives_config_keys_added_after_it():
    """A record keeps its run's training config; a key the schema gained since counts as the same run at its
    default and is named otherwise, as is every changed or removed key (the first committed record predates
    more than 40 of today's keys, among them model.layer_pattern and model.loss_chunk)."""
    from kimi.ablate import records

    cfg = ablate.study.arm_config(ablate.load_experiment("ablate_qk_clip"), "tau100", [], ["trainer.seed=1"])
    rec = {"config": records.training_config(cfg)}
    assert records.mismatch(rec, cfg) == []
    assert "logging.wandb.mode" not in rec["config"] and "trainer.threads" not in rec["config"]
    assert records.mismatch(rec, {**cfg, "logging": {"wandb": {"mode": "online"}}}) == []
    older = {"config": {k: v for k, v in rec["config"].items() if k != "model.rope_theta"}}
    assert records.mismatch(older, cfg) == []  # a key added at its default
    newer = json.loads(json.dumps(cfg))
    newer["model"]["rope_theta"] = 1234.0
    assert records.mismatch(older, newer) == [
        f"model.rope_theta=1234.0 (a key added since the record, not at its default "
        f"{records.schema_defaults()['model.rope_theta']!r})"]
    assert records.mismatch(rec, newer) == [
        f"model.rope_theta: recorded {rec['config']['model.rope_theta']!r}, now 1234.0"]
    gone = {"config": {**rec["config"], "model.retired_switch": True}}
    assert records.mismatch(gone, cfg) == ["model.retired_switch (recorded True) is no longer a config key"]
    # the fingerprint names what defines the run: the same with the added key at its default
    assert records.fingerprint(cfg) == ablate.study.run_fingerprint(
        ablate.study.plan_run(ablate.load_experiment("ablate_mixer"), Path("x"), "hybrid_3to1", {}, 1), [])
    assert records.fingerprint(newer) != records.fingerprint(cfg)


@pytest.mark.slow
@pytest.mark.e2e
def test_a_fresh_clone_plans_and_reports_the_committed_study(tmp_path):
    """`python -m kimi.ablate all dry_run=true` and `report` against the committed records (a copy, so the
    report's files land in tmp_path): every committed run counts as done, nothing is planned, and the report
    is the committed one but for where its plots are."""
    import shutil

    committed = ablate.DEFAULT_OUT
    out, root = tmp_path / "ablations", tmp_path / "runs"
    shutil.copytree(committed / "runs", out / "runs")
    n = len(list((out / "runs").glob("*/*.json")))
    plan = _run([sys.executable, "-m", "kimi.ablate", "all", "dry_run=true", f"out={out}", f"root={root}"],
                timeout=1200)  # 90 configs composed: half a minute, minutes on a loaded machine
    assert plan.splitlines()[-1].startswith(f"[ablate] {n} done; report: python -m kimi.ablate report "), plan
    assert "would run" not in plan and not root.exists()
    _run([sys.executable, "-m", "kimi.ablate", "report", f"out={out}", f"root={root}"])
    mine = (out / "README_section.md").read_text().replace(f"{out}/", "")
    assert mine == (committed / "README_section.md").read_text().replace("bench/results/ablations/", "")
