"""A run moves between data-parallel sizes and gradient-accumulation splits mid-run and trains what one
uninterrupted process trains: the loader's position is global (windows consumed over all ranks), so with the
same windows per step (ranks x micro-batch x accumulation steps = 4) every later step reads the same windows.
Checked end to end through the checkpoint: step 1 on one layout, steps 2-3 on another, against the reference
run's per-step losses, validation losses and final weights (tests/layout_runs.py)."""

import pytest

from layout_runs import assert_same_run, overrides, single_process, torchrun

pytestmark = pytest.mark.dist


def _train(run, data, layout, *extra):
    ranks, micro, accum = layout
    settings = [f"trainer.micro_batch_size={micro}", f"trainer.grad_accum_steps={accum}", *extra]
    if ranks == 1:
        single_process(run, data, "adamw", *settings)
    else:
        torchrun(ranks, run, overrides(data, "adamw", f"parallel.dp_shard={ranks}", *settings))


@pytest.mark.parametrize("first,second", [((2, 2, 1), (1, 2, 2)), ((1, 4, 1), (2, 1, 2))],
                         ids=["2ranks-to-1rank-accum2", "1rank-to-2ranks-accum2"])
def test_resume_on_another_layout_trains_the_uninterrupted_run(tmp_path, data, references, first, second):
    run = tmp_path / "run"
    _train(run, data, first, "trainer.stop_at_step=1")
    _train(run, data, second)
    assert_same_run(run, references("adamw"), tmp_path)
