"""A run moves between data-parallel sizes and gradient-accumulation splits mid-run and trains what one
uninterrupted process trains: the loader's position is global (windows consumed over all ranks), so with the
same windows per step (ranks x micro-batch x accumulation steps = 4) every later step reads the same windows.
Checked end to end through the checkpoint: step 1 on one layout, steps 2-3 on another, against the reference
run's per-step losses, validation losses and final weights (tests/layout_runs.py). The legs on 2 ranks share
one torchrun launch, between the one-process first legs and the one-process second legs."""

import pytest

from layout_runs import assert_same_run, dist_train, overrides, resumed_at, single_process

pytestmark = pytest.mark.dist

# name: (ranks, micro-batch, accumulation steps) of step 1, then of steps 2-3
MOVES = {"2ranks-to-1rank-accum2": ((2, 2, 1), (1, 2, 2)), "1rank-to-2ranks-accum2": ((1, 4, 1), (2, 1, 2))}


@pytest.fixture(scope="module")
def moved(tmp_path_factory, data):
    """The run dir of every move, trained to its end."""
    out = tmp_path_factory.mktemp("moved")
    runs = {name: out / name for name in MOVES}

    def settings(layout, *extra):
        ranks, micro, accum = layout
        dp = [f"parallel.dp_shard={ranks}"] if ranks > 1 else []
        return [*dp, f"trainer.micro_batch_size={micro}", f"trainer.grad_accum_steps={accum}", *extra]

    def alone(legs):
        for name, layout, extra in legs:
            if layout[0] == 1:
                single_process(runs[name], data, "adamw", *settings(layout, *extra))

    firsts = [(name, first, ["trainer.stop_at_step=1"]) for name, (first, _) in MOVES.items()]
    seconds = [(name, second, []) for name, (_, second) in MOVES.items()]
    alone(firsts)
    dist_train(2, [(runs[name], overrides(data, "adamw", *settings(layout, *extra)))
                   for name, layout, extra in firsts + seconds if layout[0] == 2], out / "runs.pkl")
    alone(seconds)
    return runs


@pytest.mark.parametrize("name", list(MOVES))
def test_resume_on_another_layout_trains_the_uninterrupted_run(tmp_path, moved, references, name):
    assert resumed_at(moved[name]) == [1]
    assert_same_run(moved[name], references("adamw"), tmp_path)
