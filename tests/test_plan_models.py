"""The planner's memory and communication models (kimi/plan/memory.py, kimi/plan/comm.py) against what a
step really holds and sends: in-process, the activations and the optimizer's working memory measured by
torch's MemTracker; under torchrun, two layouts of bench/plan_check.py (peak memory within 10%, every
collective kind's calls and bytes equal to bench/comm_count.py's counts)."""

import sys

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from helpers import ROOT

sys.path.append(str(ROOT / "bench"))  # appended: a bench script must not shadow an installed package
import plan_check  # noqa: E402

from kimi.config import register_configs  # noqa: E402

# tiers per test (in-process checks are unit, the torchrun comparison dist), as in test_conv_mixer.py
SHORT = ["model=tiny", "data.tokenizer.vocab_size=384", "trainer.seq_len=64", "trainer.micro_batch_size=2",
         "trainer.device=cpu", "trainer.run_dir=unused"]


def config(*overrides: str):
    from kimi.summary import vocab_note

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = OmegaConf.to_object(compose("config", overrides=[*SHORT, *overrides]))
    vocab_note(cfg)  # model.vocab_size from the tokenizer's, as the trainer sets it
    return cfg


def tracker():
    from torch.distributed._tools.mem_tracker import MemTracker

    return MemTracker()


def snapshot(mem) -> dict:
    """MemTracker's split at the peak, by category name (ACT, TEMP, OPT, ...)."""
    peak = mem.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {str(k).rsplit(".", 1)[-1]: v for k, v in peak.items()}


@pytest.mark.unit
@pytest.mark.parametrize("ac", ["none", "full"])
def test_activations_match_a_measured_forward_and_backward(ac):
    from kimi.model import KimiModel
    from kimi.parallel.activation_checkpointing import apply_activation_checkpointing
    from kimi.plan.activations import trace
    from kimi.plan.memory import activations

    cfg = config(f"parallel.activation_checkpointing={ac}")
    want = activations(cfg, trace(cfg.model, ac), 0, list(range(cfg.model.num_layers)), True, True)
    torch.manual_seed(0)
    model = KimiModel(cfg.model)
    apply_activation_checkpointing(model, ac)
    for p in model.parameters():  # gradients are memory.py's other part: dropped as they arrive
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ids = torch.randint(0, cfg.model.vocab_size, (2, 65))
    mem = tracker()
    mem.track_external(model)
    with mem:
        model(ids[:, :-1], labels=ids[:, 1:]).backward()
    peak = snapshot(mem)
    got = peak["ACT"] + peak["TEMP"]
    assert 0.9 <= want / got <= 1.1, (want, got)


@pytest.mark.unit
def test_the_optimizer_steps_working_memory_matches_a_real_step():
    from kimi.model import KimiModel
    from kimi.optim import build_optimizer
    from kimi.plan.optimizer_step import step_bytes_per_param

    cfg = config()
    model = KimiModel(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    params = list(model.parameters())
    for _ in range(2):  # the first step makes the state; the second is measured
        for p in params:
            p.grad = torch.randn_like(p)
        if _ == 0:
            optimizer.step()
    mem = tracker()
    mem.track_external(model, optimizer)
    with mem:
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
    peak = snapshot(mem)
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                if isinstance(t, torch.Tensor))
    want = step_bytes_per_param(cfg) * sum(p.numel() for p in params)
    assert 0.9 <= want / (peak["OPT"] - state) <= 1.1


@pytest.mark.unit
def test_sharding_divides_what_each_layout_shards():
    from kimi.plan.comm import collectives_per_step
    from kimi.plan.memory import PARTS, rank_parts

    def parts(*overrides):
        return rank_parts(config(*overrides))[0]

    one, fsdp = parts(), parts("parallel.dp_shard=2")
    assert set(one) == set(PARTS) and all(isinstance(v, int) and v >= 0 for v in one.values())
    assert fsdp["weights"] * 2 == pytest.approx(one["weights"], rel=0.01)
    assert fsdp["fsdp_gathered"] > 0 == one["fsdp_gathered"]
    zero = {s: parts("parallel.engine=deepspeed", "parallel.dp_shard=2", f"parallel.deepspeed.zero_stage={s}")
            for s in (1, 2, 3)}
    assert zero[3]["weights"] < zero[2]["weights"] == zero[1]["weights"]
    assert zero[2]["optimizer"] == zero[1]["optimizer"] < one["optimizer"]
    assert collectives_per_step(config()) == []  # one process: nothing to communicate


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A folder with the generated corpus and its token cache, shared by the layouts."""
    path = tmp_path_factory.mktemp("plan_check")
    return path, plan_check.corpus(path / "corpus")


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tiny/fsdp2/selective", "tiny/tp2_sp/full"])
def test_the_models_match_a_measured_step(layout, work):
    path, data = work
    measured = plan_check.measure(layout, data, path)
    assert measured is not None, (path / (layout.replace("/", "_") + ".log")).read_text()[-3000:]
    row = plan_check.compare(layout, measured, plan_check.predict(layout, data))
    assert 0.9 <= row["ratio"] <= 1.1, row
    for kind in row["comm"]:
        assert (kind["predicted_calls"], kind["predicted_bytes"]) == (kind["calls"], kind["bytes"]), kind
