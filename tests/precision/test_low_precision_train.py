"""The trainer with trainer.precision=fp8 (both recipe families) and mxfp8, emulated on CPU, a few steps each
against the same run in bf16; and an MXFP4-QAT MoE run exported with `kimi.convert to-hf --mxfp4-experts`,
whose dequantised forward is the trained model's."""

from __future__ import annotations

import pytest
import torch
from helpers import run_cfg
from torch import nn

from kimi.config import to_config
from kimi.convert import load_hf
from kimi.convert import main as convert
from kimi.generate import load_from_checkpoint
from kimi.precision import apply_low_precision
from kimi.precision.linear import Fp8Linear, MXFP8Linear
from kimi.trainer import Trainer

pytestmark = pytest.mark.e2e

# every projection of the 2-block test model that is wide enough: its MLPs and the 32-wide attention ones
CONVERT_ALL = ["precision.keep_end_blocks=0", "precision.min_features=32", "trainer.max_steps=4",
               "trainer.eval_every=0", "trainer.checkpoint_every=0"]


def _losses(trainer: Trainer) -> list[float]:
    return [trainer.train_step()["loss"] for _ in range(trainer.cfg.trainer.max_steps)]


@pytest.fixture(scope="module")
def bf16_losses(tmp_path_factory, data):
    run = tmp_path_factory.mktemp("bf16")
    return _losses(Trainer(run_cfg(run, data, "trainer.precision=bf16", *CONVERT_ALL)))


@pytest.mark.parametrize("precision, cls", [("fp8 precision.fp8.recipe=tensorwise", Fp8Linear),
                                            ("fp8 precision.fp8.recipe=rowwise", Fp8Linear),
                                            ("mxfp8", MXFP8Linear)])
def test_emulated_low_precision_trains_like_bf16(tmp_path, data, bf16_losses, precision, cls):
    overrides = [f"trainer.precision={precision.split()[0]}", *precision.split()[1:], *CONVERT_ALL]
    trainer = Trainer(run_cfg(tmp_path / "run", data, *overrides))
    names = trainer.engine.low_precision
    assert "blocks.0.mlp.w_down" in names and "blocks.1.mixer.wo" in names
    assert all(isinstance(trainer.model.get_submodule(n), cls) for n in names)
    losses = _losses(trainer)
    # a few steps of the same data and initial weights: the quantisation error (a few % per matmul) moves
    # the loss by far less than the steps do
    assert losses[-1] < losses[0] - 0.1, losses
    assert max(abs(a - b) for a, b in zip(losses, bf16_losses)) < 0.05, (losses, bf16_losses)
    # the masters: plain fp32 parameters, what the optimizer steps and checkpoints hold
    assert all(type(p) is nn.Parameter and p.dtype == torch.float32 for p in trainer.model.parameters())


def test_mxfp4_qat_run_exports_the_forward_it_trained(tmp_path, data):
    run = tmp_path / "run"
    # what transformers' layout expresses (its MLA latent norm has eps 1e-6); d_model 32, expert width 32
    model = ["model.residual=standard", "model.kda.gate_bias=false", "model.mla.norm_eps=1e-6",
             "model.moe.num_experts=4", "model.moe.top_k=2", "model.moe.hidden=32", "model.moe.first_dense=1"]
    cfg = run_cfg(run, data, "precision.qat=mxfp4_experts", "trainer.max_steps=3", *model)
    assert Trainer(cfg).fit()["finished"]
    assert convert(["to-hf", str(run), str(tmp_path / "hf"), "--mxfp4-experts"]) == 0
    trained, _, step = load_from_checkpoint(str(run))
    assert step == 3
    apply_low_precision(trained, to_config(cfg), torch.device("cpu"))  # the run's forward: QAT's experts
    ids = torch.randint(0, trained.cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(tmp_path / "hf")(ids), trained(ids), rtol=0, atol=0)
