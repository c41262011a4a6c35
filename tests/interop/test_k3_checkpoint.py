"""Kimi K3's checkpoint layout both ways (kimi.interop.k3, `kimi.convert to-hf ... layout=k3` / from-hf),
against mlx-lm's kimi_k3 model: an independent reader of that layout, written from Moonshot's modeling code.

A random `k3_tiny` (every K3 part: safe-gate full-rank-gate KDA, gated MLA with q-LoRA, SiTU-GLU, latent MoE,
Block AttnRes of 2 decoder layers with key-norm weights) is written by to-hf in K3's layout; mlx-lm reads it
and its logits equal ours; our from-hf reads it back to the same tensors; and a directory written by mlx-lm
(its own weights, saved under K3's names) reads into our model with equal logits."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from helpers import fill_randomly
from kimi.config import ModelConfig
from kimi.convert import load_hf, save_hf
from kimi.interop.k3 import k3_config
from kimi.interop.hf import NotExpressible
from kimi.model import KimiModel

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 96
TOKENS = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(0))


def k3_tiny(**overrides) -> ModelConfig:
    fields = OmegaConf.to_container(OmegaConf.load(ROOT / "conf/model/k3_tiny.yaml"))
    fields.pop("name")
    # A section given as a dict adds to the preset's: attnres=dict(key_weight=False) keeps its block_size
    merged = {k: {**fields.get(k, {}), **v} if isinstance(v, dict) else v for k, v in overrides.items()}
    return ModelConfig(**{**fields, "vocab_size": VOCAB, **merged})


def random_k3(**overrides) -> KimiModel:
    """k3_tiny with every weight drawn anew (gates, caps and depth mixes all acting), the router biases and
    KDA's A_log included, in eval mode."""
    model = fill_randomly(KimiModel(k3_tiny(**overrides)), std=0.1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_key_weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith("A_log"):
                p.uniform_(1, 16).log_()
        for name, b in model.named_buffers():
            if name.endswith("expert_bias"):
                b.normal_(0, 0.1)
    return model.eval()


@pytest.fixture
def mlx_lm():
    """mlx-lm's loader, compiling nothing (mlx's CPU compile builds C++ on first use: tens of seconds)."""
    mx = pytest.importorskip("mlx.core", reason="mlx (dev extra: mlx[cpu]) not installed")
    utils = pytest.importorskip("mlx_lm.utils", reason="mlx-lm (dev extra) not installed")
    mx.disable_compile()
    yield lambda directory: utils.load_model(Path(directory))[0]
    mx.enable_compile()


def mlx_logits(model, tokens: torch.Tensor) -> np.ndarray:
    import mlx.core as mx

    return np.array(model(mx.array(tokens.numpy())).astype(mx.float32))


@pytest.mark.unit
def test_to_hf_in_k3_layout_reads_in_mlx_lm_and_back(tmp_path, mlx_lm):
    ours = random_k3()
    with torch.no_grad():
        logits = ours(TOKENS)
    out = save_hf(ours, tmp_path / "k3", layout="k3")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kimi_k3" and config["text_config"]["attn_res_block_size"] == 2
    assert config["text_config"]["linear_attn_config"]["kda_layers"] == [1, 2, 3]  # 1-based, as released
    theirs = mlx_logits(mlx_lm(out), TOKENS)
    assert np.abs(theirs - logits.numpy()).max() < 1e-4
    back = load_hf(out)
    assert back.cfg == ours.cfg
    mine = ours.state_dict()
    assert back.state_dict().keys() == mine.keys()
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, mine[name]), name


@pytest.mark.unit
def test_a_model_without_key_weights_exports_as_weights_of_one(tmp_path, mlx_lm):
    """Block AttnRes without key weights (our default) writes K3's norms as ones: the same function; from-hf
    reads it as a model with key weights of 1."""
    ours = random_k3(attnres=dict(key_weight=False))
    with torch.no_grad():
        logits = ours(TOKENS)
    out = save_hf(ours, tmp_path / "plain", layout="k3")
    assert np.abs(mlx_logits(mlx_lm(out), TOKENS) - logits.numpy()).max() < 1e-4
    back = load_hf(out)
    assert back.cfg.attnres.key_weight and torch.all(back.final_key_weight == 1)
    with torch.no_grad():
        torch.testing.assert_close(back(TOKENS), logits, rtol=0, atol=1e-5)


@pytest.mark.unit
def test_from_hf_reads_what_mlx_lm_writes(tmp_path, mlx_lm):
    """mlx-lm's own K3 model, its weights drawn by mlx and saved under the release's names (its sanitize run
    backwards: fused q/k/v and convs split, the kv_b_proj rebuilt), reads into ours with equal logits."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from safetensors.numpy import save_file

    template = save_hf(random_k3(), tmp_path / "template", layout="k3")
    model = mlx_lm(template)
    mx.random.seed(1)
    flat = dict(tree_flatten(model.parameters()))
    redrawn = {k: (mx.random.uniform(0.5, 1.5, v.shape) if "norm" in k else 0.1 * mx.random.normal(v.shape))
               for k, v in flat.items() if "A_log" not in k and "e_score_correction_bias" not in k}
    model.load_weights(list(redrawn.items()), strict=False)
    theirs = mlx_logits(model, TOKENS)
    weights = {k: np.array(v.astype(mx.float32)) for k, v in tree_flatten(model.parameters())}
    file = {}
    prefix = "language_model.model.layers."
    for key, value in weights.items():
        if ".switch_mlp." in key:
            layer, rest = key.split(".mlp.switch_mlp.")
            name = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[rest.split(".")[0]]
            for e in range(value.shape[0]):
                file[f"{layer}.block_sparse_moe.experts.{e}.{name}.weight"] = value[e]
        elif ".self_attn.qkv_proj." in key or ".self_attn.qkv_conv." in key:
            conv = "qkv_conv" in key
            for part, chunk in zip("qkv", np.split(value, 3, axis=0)):
                file[key.replace("qkv_conv.conv.weight" if conv else "qkv_proj",
                                 f"{part}_conv1d.weight" if conv else f"{part}_proj")] = \
                    np.moveaxis(chunk, 1, 2) if conv else chunk
        elif ".self_attn.embed_q." in key or ".self_attn.unembed_out." in key:
            continue  # rebuilt as kv_b_proj below
        elif key.endswith(".mlp.e_score_correction_bias"):
            file[key.replace(".mlp.", ".block_sparse_moe.gate.")] = value
        else:
            file[key.replace(".mlp.", ".block_sparse_moe.") if ".mlp." in key and _sparse(key)
                 else key] = value
    cfg = json.loads((template / "config.json").read_text())["text_config"]
    heads, nope, v_dim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    for key in [k for k in weights if k.endswith(".self_attn.embed_q.weight")]:
        wk = weights[key].swapaxes(-1, -2)  # [H, nope, latent]
        wv = weights[key.replace("embed_q", "unembed_out")]  # [H, v, latent]
        file[key.replace("embed_q.weight", "kv_b_proj.weight")] = \
            np.concatenate([wk, wv], axis=1).reshape(heads * (nope + v_dim), -1)
    assert all(k.startswith("language_model.") for k in file), prefix
    directory = tmp_path / "from_mlx"
    directory.mkdir()
    save_file({k: np.ascontiguousarray(v) for k, v in file.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text((template / "config.json").read_text())
    ours = load_hf(directory)
    with torch.no_grad():
        assert (ours(TOKENS) - torch.from_numpy(theirs)).abs().max() < 1e-4


def _sparse(key: str) -> bool:
    return not key.startswith("language_model.model.layers.0.")


@pytest.mark.unit
@pytest.mark.parametrize("override,named", [
    (dict(mlp=dict(activation="swiglu")), "mlp.activation=swiglu"),
    (dict(attnres=dict(block_size=3)), "attnres.block_size=3"),
    (dict(residual="attnres_full"), "attnres_full"),
])
def test_k3_layout_refuses_what_it_cannot_hold(override, named):
    with pytest.raises(NotExpressible, match=named):
        k3_config(k3_tiny(**override))


@pytest.mark.unit
def test_mxfp4_experts_in_k3_layout(tmp_path):
    """mxfp4_experts=true in K3's layout: each routed expert's w1/w2/w3 as the release packs them (uint8
    weight_packed [out, in/2], weight_scale [out, in/32]), read back dequantised."""
    from safetensors import safe_open

    from kimi.precision.mxfp4 import fake_quantize

    ours = random_k3()
    out = save_hf(ours, tmp_path / "mxfp4", layout="k3", mxfp4_experts=True)
    with safe_open(out / "model.safetensors", framework="pt") as f:
        packed = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed")
        scale = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_scale")
    hidden, latent = ours.cfg.moe.hidden, ours.cfg.moe.latent_dim
    assert packed.dtype == scale.dtype == torch.uint8
    assert list(packed.shape) == [hidden, latent // 2] and list(scale.shape) == [hidden, latent // 32]
    back = load_hf(out).state_dict()
    for name, tensor in ours.state_dict().items():
        want = fake_quantize(tensor) if ".experts.w_" in name else tensor
        assert torch.equal(back[name], want), name


@pytest.mark.e2e
def test_to_hf_command_writes_a_trained_run_in_k3_layout(tmp_path, data, capsys):
    """`python -m kimi.convert to-hf run=RUN out=OUT layout=k3` on a run trained with K3's parts (at the
    test trainer's size), then from-hf's reader: the checkpoint's weights bit for bit; a missing or unknown
    key is one line, exit code 2, nothing written; the positional form writes the same bytes."""
    from helpers import train_run

    from kimi.convert import main
    from kimi.generate import load_from_checkpoint

    run, out = tmp_path / "run", tmp_path / "k3_out"
    train_run(run, data, "trainer.max_steps=2", "model.mlp.activation=situ", "model.kda.gate_bias=false",
              "model.kda.gate_lower_bound=-5", "model.kda.full_rank_gate=true", "model.mla.output_gate=true",
              "model.attnres.key_weight=true")
    assert main(["to-hf", f"out={out}", "layout=k3"]) == 2
    assert "give run=..." in capsys.readouterr().err
    assert main(["to-hf", f"run={run}", f"out={out}", "layout=k4"]) == 2
    assert "layout=k4 is invalid: must be one of" in capsys.readouterr().err and not out.exists()
    assert main(["to-hf", f"run={run}", f"out={out}", "layout=k3"]) == 0
    assert "in Kimi K3's layout" in capsys.readouterr().out
    trained, _, _ = load_from_checkpoint(str(run))
    back = load_hf(out).state_dict()
    for name, tensor in trained.state_dict().items():
        assert torch.equal(back[name], tensor.float()), name
    # the positional form (deprecated) still writes the same files, with one stderr line naming its key=value
    old = tmp_path / "old_form"
    assert main(["to-hf", str(run), str(old), "--layout", "k3"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "warning: the positional form of kimi.convert is deprecated; write python -m kimi.convert to-hf "
        f"run={run} out={old} layout=k3"]
    assert {f.name: f.read_bytes() for f in old.iterdir()} == {f.name: f.read_bytes() for f in out.iterdir()}
