"""trainer.profile: a run records exactly the asked training steps into a trace and an ops table, and a run
cut short before the last of them writes nothing and leaves no profiler running."""

import json

import pytest
import torch
from helpers import train_run

pytestmark = pytest.mark.e2e


def _step_ranges(trace: dict) -> list:
    return sorted(e["name"] for e in trace["traceEvents"] if str(e.get("name", "")).startswith("step "))


def test_profile_records_the_asked_steps(tmp_path, data, capsys):
    run = tmp_path / "run"
    train_run(run, data, "trainer.max_steps=4", "trainer.profile.steps=[2,3]", "trainer.profile.top=7")
    trace = json.loads((run / "profile" / "trace_rank0.json").read_text())
    assert _step_ranges(trace) == ["step 2", "step 3"]  # not the first step's warm-up, not the fourth
    ops = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "cpu_op"}
    assert {"aten::mm", "aten::bmm"} & ops and any("backward" in op.lower() for op in ops)
    table = (run / "profile" / "ops_rank0.txt").read_text().splitlines()
    assert "Self CPU" in table[1] and sum(line.startswith("aten::") for line in table) <= 7
    assert not (run / "profile" / "memory_rank0.pickle").exists()  # a CUDA allocator's snapshot only
    assert "[kimi] profile of steps 2-3:" in capsys.readouterr().out
    assert torch.autograd.profiler._is_profiler_enabled is False


def test_a_run_stopped_inside_the_profiled_steps_writes_none(tmp_path, data):
    run = tmp_path / "run"
    train_run(run, data, "trainer.max_steps=4", "trainer.stop_at_step=2", "trainer.profile.steps=[2,3]")
    assert not (run / "profile").exists()
    assert torch.autograd.profiler._is_profiler_enabled is False
