"""Multi-token prediction (model.mtp.layers, kimi/model/mtp.py): the training loss against a by-hand fp64
computation of DeepSeek-V3's definition, evaluation untouched, the layouts it refuses, and export dropping
it."""

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_model_cfg
from kimi.config import ConfigError
from kimi.model import KimiModel
from kimi.model.norm import rms_norm

pytestmark = pytest.mark.unit

VOCAB = 61


def by_hand(model: KimiModel, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """L + w * mean_k L_k from the modules' weights: depth k reads the trunk's final mix (depth 0) or depth
    k-1's output at t and the embedding of token t+k (labels[:, t+k-1]), predicts labels[:, t+k]; each depth
    a plain pre-norm residual block. Only positions with a target are computed (all are causal)."""
    trunk = []
    handle = model.norm.register_forward_pre_hook(lambda m, args: trunk.append(args[0]))
    logits = model(ids)
    handle.remove()
    T = ids.shape[1]
    main = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    hidden, losses = trunk[0], []
    for k, layer in enumerate(model.mtp, start=1):
        n = T - k  # positions whose token t+k+1 exists
        e = model.embed(labels[:, k - 1:k - 1 + n])
        h = hidden[:, :n]

        def norm(x, w):
            return rms_norm(x, model.cfg.norm_eps) * w

        x = (torch.cat([norm(e, layer.embed_norm.weight), norm(h, layer.hidden_norm.weight)], -1)
             @ layer.proj.weight.T)
        block = layer.block
        x = x + block.mixer(norm(x, block.mixer_norm.weight))
        x = x + block.mlp(norm(x, block.mlp_norm.weight))
        out = norm(x, layer.norm.weight) @ model.lm_head.weight.T
        losses.append(F.cross_entropy(out.flatten(0, 1), labels[:, k:k + n].flatten()))
        hidden = x
    return main + model.cfg.mtp.loss_weight * sum(losses) / len(losses)


@pytest.mark.parametrize("depths,residual", [(1, "attnres_block"), (2, "standard"), (1, "attnres_full")])
def test_training_loss_is_deepseek_v3s_definition(depths, residual):
    torch.manual_seed(0)
    model = KimiModel(tiny_model_cfg(vocab_size=VOCAB, mtp=dict(layers=depths, loss_weight=0.7),
                                     residual=residual)).double()
    with torch.no_grad():
        for q in model.attnres_queries():
            q.normal_()  # non-uniform depth mixes: the trunk state MTP reads is the final mix, not a mean
    ids, labels = (torch.randint(0, VOCAB, (2, 13)) for _ in range(2))
    with torch.no_grad():
        want = by_hand(model, ids, labels)
        got = model.train()(ids, labels=labels)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert model.train()(ids, labels=labels).backward() is None
    assert all(p.grad is not None for n, p in model.named_parameters() if n.startswith("mtp."))


def test_evaluation_and_logits_do_not_run_it():
    torch.manual_seed(0)
    with_mtp = KimiModel(tiny_model_cfg(vocab_size=VOCAB, mtp=dict(layers=1)))
    plain = KimiModel(tiny_model_cfg(vocab_size=VOCAB))
    plain.load_state_dict({k: v for k, v in with_mtp.state_dict().items() if not k.startswith("mtp.")})
    ids, labels = (torch.randint(0, VOCAB, (2, 9)) for _ in range(2))
    with torch.no_grad():
        assert torch.equal(with_mtp.eval()(ids, labels=labels), plain.eval()(ids, labels=labels))
        assert torch.equal(with_mtp(ids), plain(ids))
        assert not torch.equal(with_mtp.train()(ids, labels=labels), plain.train()(ids, labels=labels))


@pytest.mark.parametrize("layout", ["parallel.tp=2", "parallel.pp=2", "parallel.cp=2", "parallel.ep=2"])
def test_layouts_it_does_not_support_are_refused_in_one_line(layout):
    from hydra import compose, initialize_config_dir

    from helpers import ROOT
    from kimi.config import register_configs, to_config
    from kimi.model.rules import check_mtp

    register_configs()
    moe = ["model.moe.num_experts=4", "model.moe.top_k=2"] if "ep" in layout else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = to_config(compose("config", overrides=["trainer.run_dir=unused", "model.mtp.layers=1", layout,
                                                     *moe]))
    with pytest.raises(ConfigError, match=f"model.mtp.layers=1 does not run with {layout}") as e:
        check_mtp(cfg)
    assert "\n" not in str(e.value)


def test_export_drops_it(tmp_path):
    """to-hf writes no MTP tensor (K3's release has none); what it writes gives the same logits."""
    from safetensors import safe_open

    from kimi.convert import load_hf, save_hf

    torch.manual_seed(0)
    model = KimiModel(tiny_model_cfg(vocab_size=VOCAB, residual="standard", kda=dict(gate_bias=False),
                                     mla=dict(norm_eps=1e-6), mtp=dict(layers=1))).eval()
    out = save_hf(model, tmp_path / "hf")
    with safe_open(out / "model.safetensors", framework="pt") as f:
        assert not any("mtp" in k for k in f.keys())
    ids = torch.randint(0, VOCAB, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(load_hf(out)(ids), model(ids), rtol=0, atol=1e-5)
