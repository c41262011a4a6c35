"""The issue's done-when for stages (docs/stages.md): recipe=k3_like at tiny scale runs its stages in one
command under torchrun (2 gloo ranks), context parallelism growing from 1 to 2 at the last stage; and a run
stopped in its first stage on one process and resumed on 2 ranks equals the uninterrupted run."""

from __future__ import annotations

import pytest
from helpers import TINY_TRAINER, corpus_overrides, run_cfg
from layout_runs import torchrun

from kimi import checkpoint
from kimi.config import to_config
from kimi.run.metrics import read_metrics
from kimi.run.stages import run_stages
from kimi.trainer import Trainer

pytestmark = pytest.mark.dist

# 3 + 2 + 2 steps of 64, 256 and 1024 tokens; 1,024 tokens per step on 2 ranks (8 x 64 x 2 data ranks,
# 2 x 256 x 2, then 1 x 1024 split over cp=2)
K3 = ["recipe=k3_like", "stages.0.steps=3", "stages.1.steps=2", "stages.2.steps=2", "trainer.eval_every=0",
      "trainer.keep_checkpoints=5", "trainer.seq_len=64", "trainer.micro_batch_size=8"]  # the recipe's, over
# TINY_TRAINER's


def steps_of(run):
    return [(r["step"], r["stage"], r["loss"]) for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


@pytest.mark.slow  # two torchrun launches of 2 ranks and a one-process run: 50-90 s on 2 cores
def test_k3_like_grows_cp_in_one_command_and_resumes_on_another_number_of_ranks(tmp_path_factory):
    data = corpus_overrides(tmp_path_factory)
    ref, run = tmp_path_factory.mktemp("ref") / "run", tmp_path_factory.mktemp("resumed") / "run"
    args = [*TINY_TRAINER, *data, *K3]
    torchrun(2, ref, args)
    want = steps_of(ref)
    assert [(s, stage) for s, stage, _ in want] == [(1, "ctx64"), (2, "ctx64"), (3, "ctx64"), (4, "ctx256"),
                                                    (5, "ctx256"), (6, "ctx1024"), (7, "ctx1024")]
    configs = {c.step: checkpoint.read_trainer_state(c.path)["config"]
               for c in checkpoint.store.list_checkpoints(ref / "checkpoints")}
    assert {s: (c["parallel"]["dp_shard"], c["parallel"]["cp"], c["trainer"]["seq_len"])
            for s, c in configs.items()} == {3: (2, 1, 64), 5: (2, 1, 256), 7: (1, 2, 1024)}

    # one process, the first stage's 16 windows per step in one micro-batch, stopped inside the stage ...
    stopped = run_stages(to_config(run_cfg(run, data, *K3, "trainer.micro_batch_size=16",
                                           "trainer.stop_at_step=2")), Trainer)
    assert (stopped["finished"], stopped["step"]) == (False, 2)
    # ... then the same command on 2 ranks: the rest of stage 1 and the others, cp=2 in the last
    torchrun(2, run, args)
    got = steps_of(run)
    assert [(s, stage) for s, stage, _ in got] == [(s, stage) for s, stage, _ in want]
    assert [loss for *_, loss in got] == pytest.approx([loss for *_, loss in want], rel=1e-6)
