"""A run of stages in one command (kimi/run/stages.py, docs/stages.md) on a tiny model: boundaries
checkpointed, one lr curve over the stages, the sequence length changed at a boundary, the stage of every
step recorded; a run stopped mid-stage and at a boundary and resumed equals the uninterrupted one; a bad
stage is one line naming it before any step."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import corpus_overrides, run_cfg

from kimi import checkpoint
from kimi.config import ConfigError, to_config
from kimi.errors import DataError
from kimi.optim.schedules import lr_multiplier
from kimi.run.metrics import read_metrics
from kimi.run.stages import run_stages, stage_configs, validate_stages
from kimi.trainer import Trainer

pytestmark = pytest.mark.e2e

# 3 + 2 + 2 steps: the decay stage starts WSD's decay, the long stage doubles the sequence (nested form)
STAGES = ("stages=[{name:short,steps:3},{name:decay,steps:2,decay:true},"
          "{name:long,steps:2,overrides:{trainer:{seq_len:64},data:{varlen:true}}}]")
RUN = ("optim.schedule=wsd", "trainer.checkpoint_every=0", "trainer.keep_checkpoints=5", STAGES)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return corpus_overrides(tmp_path_factory)


def stages_run(run: Path, data: list, *overrides: str):
    return run_stages(to_config(run_cfg(run, data, *RUN, *overrides)), Trainer)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("stages") / "run"
    assert stages_run(run, data)["finished"]
    return run


def losses(run: Path) -> list:
    return [r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def test_stages_run_in_one_command_on_one_lr_curve(uninterrupted):
    ckpts = {c.step: c.path for c in checkpoint.store.list_checkpoints(uninterrupted / "checkpoints")}
    assert sorted(ckpts) == [3, 5, 7]  # every boundary, and the end
    configs = {s: checkpoint.read_trainer_state(p)["config"] for s, p in ckpts.items()}
    assert [configs[s]["trainer"]["seq_len"] for s in (3, 5, 7)] == [32, 32, 64]
    assert all(c["trainer"]["max_steps"] == 7 for c in configs.values())

    rows = [r for r in read_metrics(uninterrupted / "metrics.jsonl") if "loss" in r]
    assert [r["step"] for r in rows] == list(range(1, 8))
    assert [r["stage"] for r in rows] == ["short"] * 3 + ["decay"] * 2 + ["long"] * 2
    # one schedule over all 7 steps, its decay starting at the decay stage's first step (step 4)
    optim = dataclasses.replace(to_config(configs[7]).optim)
    assert optim.decay_fraction == pytest.approx(4 / 7)
    want = [optim.lr * lr_multiplier(r["step"] - 1, optim, 7) for r in rows]
    assert [r["lr"] for r in rows] == pytest.approx(want, rel=1e-12)
    assert rows[3]["lr"] == optim.lr > rows[4]["lr"] > rows[5]["lr"] > rows[6]["lr"]
    # tokens add up over the stages, each at its own tokens per step (4 x 32, then 4 x 64)
    assert rows[-1]["tokens"] == 5 * 4 * 32 + 2 * 4 * 64

    text = (uninterrupted / "metrics.jsonl").read_text().splitlines()
    starts = [r for r in map(json.loads, text) if r.get("event") == "start"]
    assert [(r["step"], r["stage"]) for r in starts] == [(0, "short"), (3, "decay"), (5, "long")]
    log = (uninterrupted / "train.log").read_text()
    assert "stage boundary: stage 3/3 (long) starts at step 6 with a data stream of its own" in log
    assert "stage boundary: stage 2/3 (decay) starts at step 4 with the data stream where" in log
    assert "setting(s) differ from the checkpoint" not in log  # a boundary is not a user's change
    assert "of its training tokens come from documents >= 64 tokens" in log


def test_stopped_mid_stage_and_at_a_boundary_then_resumed_equals_uninterrupted(tmp_path, data, uninterrupted):
    run = tmp_path / "run"
    first = stages_run(run, data, "trainer.stop_at_step=2")  # inside the first stage
    assert (first["finished"], first["step"]) == (False, 2)
    second = stages_run(run, data, "trainer.stop_at_step=5")  # at the boundary of the last stage
    assert (second["finished"], second["step"]) == (False, 5)
    assert stages_run(run, data)["finished"]
    assert losses(run) == pytest.approx(losses(uninterrupted), rel=1e-6)
    assert len(losses(run)) == 7
    again = stages_run(run, data)  # the same command once more: nothing left to train
    assert (again["finished"], again["step"]) == (True, 7)
    # over again: the first stage moves the old run aside, the later ones continue the new run
    assert stages_run(run, data, "trainer.resume=false", "trainer.overwrite=true")["finished"]
    assert losses(run) == pytest.approx(losses(uninterrupted), rel=1e-6)
    assert len(list((run / "previous").iterdir())) == 1


@pytest.mark.parametrize("override, world, message", [
    ("+stages.1.overrides.trainer={seq_lem:64}", 1,
     "stage 2/3 (decay): trainer.seq_lem is not a config key: did you mean trainer.seq_len?"),
    ("+stages.2.overrides.model={d_model:64}", 1,
     "stage 3/3 (long): model.d_model cannot change between stages (the weights carry over"),
    ("+stages.2.overrides.parallel={cp:2}", 1,
     "stage 3/3 (long): parallel.dp_replicate*dp_shard*cp*tp*pp = 1*1*2*1*1 = 2 but 1 process(es)"),
    ("+stages.2.overrides.parallel={cp:2} stages.2.overrides.trainer.seq_len=33", 2,
     "stage 3/3 (long): trainer.seq_len=33 does not split into parallel.cp=2 equal shards"),
    ("stages.0.decay=true", 1, "stages: decay=true is set on ['short', 'decay']"),
    ("data.streaming=true", 1, "data.streaming=true does not work with stages yet"),
])
def test_a_bad_stage_is_one_line_naming_it_before_any_step(tmp_path, data, override, world, message):
    cfg = to_config(run_cfg(tmp_path / "run", data, *RUN, *override.split()))
    with pytest.raises(ConfigError) as e:
        validate_stages(stage_configs(cfg, world), world)
    assert message in str(e.value) and "\n" not in str(e.value)
    if world == 1:  # the command itself: refused before the first stage trains
        with pytest.raises(ConfigError, match="stage"):
            run_stages(cfg, Trainer)
        assert not (tmp_path / "run" / "metrics.jsonl").exists()
        assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_stage_out_of_reach_of_this_command_is_checked_when_reached(tmp_path, data):
    """trainer.stop_at_step before a stage that cannot run here (cp=2 on one process): the stages before it
    run; the stage's one line says how to launch it."""
    cp = ("+stages.2.overrides.parallel={cp:2}",)
    result = stages_run(tmp_path / "run", data, *cp, "trainer.stop_at_step=5")
    assert (result["finished"], result["step"]) == (False, 5)
    with pytest.raises(ConfigError, match=r"stage 3/3 \(long\): .*launch torchrun --nproc_per_node 2 .*"
                                          r"trainer.stop_at_step=5$"):
        stages_run(tmp_path / "run", data, *cp)


def test_k3_like_on_one_process_names_the_cp_stage_and_the_fix(tmp_path, data):
    cfg = to_config(run_cfg(tmp_path / "run", data, "recipe=k3_like"))
    with pytest.raises(ConfigError) as e:
        run_stages(cfg, Trainer)
    assert str(e.value).startswith("stage 3/3 (ctx1024): parallel.dp_replicate*dp_shard*cp*tp*pp = 1*1*2*1*1")
    fix = "launch torchrun --nproc_per_node 2 for this layout, or change parallel.cp so that the product is 1"
    assert fix in str(e.value)
    fix = "; or stop the run before this stage with trainer.stop_at_step=48"
    assert fix in str(e.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_a_later_stages_missing_data_files_are_refused_before_any_step(tmp_path, data):
    """recipe=k2_like where its anneal stage's quality files do not exist: one line naming the stage and the
    pattern before the first stage trains (not 560 steps later, when the anneal stage would read them)."""
    cfg = to_config(run_cfg(tmp_path / "run", data, "recipe=k2_like"))
    cfg.stages[2].overrides["data"]["sources"][1]["data_files"] = [str(tmp_path / "nowhere" / "*.txt")]
    with pytest.raises(DataError) as e:
        run_stages(cfg, Trainer)
    message = str(e.value)
    assert message.startswith("stage 3/4 (anneal): data.data_files: nothing matches ") and "\n" not in message
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_k2_like_runs_its_four_stages_with_the_anneal_mix(tmp_path, data):
    """recipe=k2_like shortened to 2 + 2 + 2 + 1 steps: the anneal stage reads a blend (the quality source
    pointed at the test corpus) with the first stage's tokenizer, the long stage 8x the sequence."""
    short = ("recipe=k2_like", "stages.0.steps=2", "stages.1.steps=2", "stages.2.steps=2", "stages.3.steps=1",
             "trainer.seq_len=32", "trainer.micro_batch_size=4", "stages.3.overrides.trainer.seq_len=256",
             "stages.3.overrides.trainer.micro_batch_size=1", "trainer.checkpoint_every=0",
             "trainer.keep_checkpoints=5")
    cfg = to_config(run_cfg(tmp_path / "run", data, *short))
    files = next(d for d in data if d.startswith("data.data_files="))
    cfg.stages[2].overrides["data"]["sources"][1]["data_files"] = files.split("=[", 1)[1][:-1].split(",")
    assert run_stages(cfg, Trainer)["finished"]
    rows = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [r["stage"] for r in rows] == ["stable"] * 2 + ["decay"] * 2 + ["anneal"] * 2 + ["long"]
    ckpt = tmp_path / "run" / "checkpoints" / "step_00000006"
    anneal = checkpoint.read_trainer_state(ckpt)["config"]["data"]
    assert [(s["name"], s["weight"]) for s in anneal["sources"]] == [("general", 0.3), ("quality", 0.7)]
    assert anneal["tokenizer"]["model_path"]  # the first stage's
    assert rows[2]["lr"] == rows[1]["lr"] > rows[3]["lr"]  # the decay starts with the decay stage
