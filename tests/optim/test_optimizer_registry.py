"""An optimizer added as one class and one registry line (kimi/optim/registry.py) is a full citizen:
optim.name accepts its name, the trainer builds and steps it, the diagnostics measure its family, and
kimi.summary, the size check and the planner cost its state by its own state model. A name nobody registered
is refused in one line."""

import math

import pytest
import torch
from helpers import train_run

from kimi.config import ConfigError, OptimConfig
from kimi.run.metrics import read_metrics
from kimi.model.footprint import estimate_params
from kimi.optim.memory import check_training_fits
from kimi.optim.registry import OPTIMIZERS, OptimizerKind, StateModel, optimizer_class
from kimi.optim.rules import validate_optim
from kimi.summary import compose_config, report, summarize

pytestmark = pytest.mark.e2e  # it runs the trainer


class SGDKind(OptimizerKind):
    """torch's SGD with momentum: one fp32 momentum buffer per parameter."""

    FAMILIES = {"sgd": StateModel("SGD", "momentum", 1)}

    def build(self, model, named, process_group=None, fragments=None):
        return torch.optim.SGD([p for _, p in named], lr=self.cfg.lr, momentum=self.cfg.momentum)


@pytest.fixture
def sgd():
    OPTIMIZERS["sgd"] = SGDKind
    yield
    del OPTIMIZERS["sgd"]


def test_a_registered_optimizer_trains(sgd, tmp_path, data):
    trainer = train_run(tmp_path / "run", data, "optim.name=sgd", "trainer.max_steps=3",
                        "trainer.diag_every=1")
    opt = trainer.engine.optimizer
    assert type(opt) is torch.optim.SGD
    params = [p for p in trainer.engine.model.parameters() if p.requires_grad]
    assert all(opt.state[p]["momentum_buffer"].shape == p.shape for p in params)  # it stepped every one
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    # the per-family diagnostics measure its one family, by its name, not as AdamW's
    for r in records:
        assert r["optim/grad_norm/sgd"] == pytest.approx(r["grad_norm"], rel=1e-5)
        assert not any(k.endswith(("/adamw", "/muon")) for k in r)


def test_a_registered_optimizer_is_costed_by_its_state_model(sgd):
    s = summarize(compose_config(["model=tiny", "optim.name=sgd"]))
    n = s.model.num_params()
    h = s.heaviest
    # fp32 weights, fp32 gradients and one fp32 momentum per parameter: 12 bytes, not AdamW's 16
    assert h.bytes["SGD momentum (fp32, 1 per param)"] == 4 * n
    assert h.persistent_bytes == 12 * n
    assert "SGD momentum (fp32, 1 per param)" in report(s)
    cfg = compose_config(["model=tiny", "optim.name=sgd"])
    assert check_training_fits(cfg, "cpu") == 12 * estimate_params(cfg.model, cfg.data.tokenizer.vocab_size)


def test_a_registered_optimizer_is_planned_by_its_state_model(sgd):
    """kimi.plan sizes its state by the same model: one fp32 per parameter, as many bytes as the fp32
    weights (AdamW's would be twice), and no Newton-Schulz time."""
    from kimi.plan import cli

    _, plan, _ = cli.plan(["model=tiny", "optim.name=sgd", "cluster.gpus=1", "top=1"], progress=False)
    best = plan["layouts"][0]
    assert best["memory_bytes"]["optimizer"] == best["memory_bytes"]["weights"] > 0
    assert best["muon_s"] == 0 and "optim.name=sgd" in best["overrides"]


def test_an_unregistered_optimizer_is_refused():
    validate_optim(OptimConfig(name="muonclip"))
    with pytest.raises(ConfigError) as e:
        validate_optim(OptimConfig(name="sgd"))
    assert str(e.value) == "optim.name='sgd' is invalid: choose one of adamw|muonclip"
    with pytest.raises(ConfigError, match="optim.name='sgd' is invalid"):
        optimizer_class("sgd")


def test_an_optimizer_without_a_state_model_is_refused():
    OPTIMIZERS["stateless"] = OptimizerKind
    try:
        with pytest.raises(TypeError, match="declares no FAMILIES"):
            optimizer_class("stateless")
    finally:
        del OPTIMIZERS["stateless"]
