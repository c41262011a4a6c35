"""The released Kimi Linear checkpoint layout, both ways, against transformers and mlx-lm (two independent
readers of it), and from-hf's one-line errors on bad input.

The release (Moonshot's own modeling code) names the dense first block's MLP model.layers.0.mlp.*, keeps
KDA's settings in linear_attn_config with 1-based layer numbers and the MoE ones under their own names;
transformers reads that, and its save_pretrained writes the dense MLP back as block_sparse_moe.*. The tiny
release directory here is save_pretrained's output with those names and that config.json written out by
hand, so it is not derived from the code under test."""

import json
import shutil

import pytest
import torch

from test_hf_interop import TOKENS, file_tensors, hf_model, random_hf, small_hf_config

pytestmark = pytest.mark.unit

# rms_norm_eps 1e-6: transformers keeps MLA's latent norm at 1e-6, mlx-lm uses rms_norm_eps there
EPS = 1e-6
RELEASE_CONFIG = dict(
    architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", vocab_size=96, hidden_size=32,
    num_hidden_layers=4, intermediate_size=48, num_attention_heads=2, num_key_value_heads=2, head_dim=72,
    kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    mla_use_nope=True, linear_attn_config=dict(full_attn_layers=[2, 4], kda_layers=[1, 3], num_heads=2,
                                               head_dim=16, short_conv_kernel_size=4),
    num_experts=8, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1,
    first_k_dense_replace=1, moe_layer_freq=1, moe_renormalize=True, moe_router_activation_func="sigmoid",
    num_expert_group=4, topk_group=2, use_grouped_topk=True, routed_scaling_factor=2.446, rms_norm_eps=EPS,
    rope_theta=10000.0, model_max_length=1048576, tie_word_embeddings=False, hidden_act="silu",
    initializer_range=0.02, dtype="float32", use_cache=True,
    bos_token_id=None, eos_token_id=None, pad_token_id=None)  # the release's are beyond this vocabulary


def write_release(saved, out, **reshape):
    """save_pretrained's directory `saved` as the release lays it out, in `out`; reshape: tensor name
    suffix -> the shape to store such tensors in."""
    from safetensors.torch import save_file

    tensors = {name.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): t
               for name, t in file_tensors(saved).items()}
    for suffix, shape in reshape.items():
        tensors.update({k: t.reshape(shape) for k, t in tensors.items() if k.endswith(suffix)})
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(RELEASE_CONFIG))
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A random tiny transformers Kimi Linear, its logits on TOKENS, and its save_pretrained and release
    directories. transformers routes KDA to GPU kernels when fla is importable: its PyTorch path here."""
    root = tmp_path_factory.mktemp("release")
    with pytest.MonkeyPatch.context() as mp:
        for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
            fn = getattr(hf_model, name)
            mp.setattr(hf_model, name, getattr(fn, "__wrapped__", fn))
        theirs = random_hf(small_hf_config(rms_norm_eps=EPS))
        theirs.save_pretrained(root / "saved")
        with torch.no_grad():
            logits = theirs(TOKENS).logits
        yield dict(theirs=theirs, logits=logits, root=root, saved=root / "saved",
                   release=write_release(root / "saved", root / "release"), tied=tied_dense(root / "tied"))


def tied_dense(directory):
    """Ours with tied embeddings and no MoE (num_experts 0 in the release's config.json), saved by save_hf;
    with its logits on TOKENS."""
    from helpers import tiny_model_cfg

    from kimi.convert import save_hf
    from kimi.model import KimiModel

    torch.manual_seed(0)
    model = KimiModel(tiny_model_cfg(vocab_size=96, residual="standard", kda=dict(gate_bias=False),
                                     norm_eps=EPS, mla=dict(norm_eps=EPS), tie_embeddings=True)).eval()
    with torch.no_grad():
        return save_hf(model, directory), model, model(TOKENS)


def max_diff(a, b):
    return (torch.as_tensor(a) - torch.as_tensor(b)).abs().max().item()


def test_from_hf_reads_the_release_and_save_pretrained_layouts(ckpt, capsys):
    """transformers reads the hand-made release as the model it saved; load_hf reads both layouts into the
    same weights (1-based layer numbers: MLA at blocks 1 and 3), with transformers' logits, whatever shape
    A_log and dt_bias are stored in ([H] or [1, 1, H, 1], [H*K] or [H, K]: readers differ); from-hf
    converts the release as published."""
    from transformers import AutoModelForCausalLM

    from kimi.convert import load_hf, main

    theirs = AutoModelForCausalLM.from_pretrained(ckpt["release"]).eval()
    with torch.no_grad():
        assert max_diff(theirs(TOKENS).logits, ckpt["logits"]) == 0
        release, saved = load_hf(ckpt["release"]), load_hf(ckpt["saved"])
        assert release.cfg.mla_layers == [1, 3] and release.cfg.moe.first_dense == 1
        assert max_diff(release(TOKENS), ckpt["logits"]) < 1e-4  # measured 2.2e-6 (logits ~1)
    vectors = write_release(ckpt["saved"], ckpt["root"] / "vectors", A_log=(2,), dt_bias=(2, 16))
    for other in (saved, load_hf(vectors)):
        mine = other.state_dict()
        assert all(torch.equal(t, mine[k]) for k, t in release.state_dict().items())
    assert main(["from-hf", str(ckpt["release"]), str(ckpt["root"] / "run")]) == 0
    assert "wrote" in capsys.readouterr().out


def test_a_tied_model_without_moe_converts(ckpt, tmp_path):
    """transformers' Kimi Linear never ties its head: save_hf writes lm_head.weight for a tied model too, so
    transformers reads the right head; from-hf reads it back exactly, and refuses a head that is not the
    embedding under tie_word_embeddings."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from kimi.convert import load_hf

    directory, ours, logits = ckpt["tied"]
    theirs = AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        assert max_diff(theirs(TOKENS).logits, logits) < 1e-4  # measured 5.5e-7
    back = load_hf(directory)
    assert back.lm_head.weight is back.embed.weight
    assert all(torch.equal(t, back.state_dict()[k]) for k, t in ours.state_dict().items())
    untied = shutil.copytree(directory, tmp_path / "untied")
    tensors = file_tensors(untied)
    tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1
    save_file(tensors, str(untied / "model.safetensors"))
    with pytest.raises(ValueError, match="ties the embeddings .* lm_head.weight is not model.embed_tokens"):
        load_hf(untied)


def test_to_hf_writes_the_release_layout_and_round_trips(ckpt):
    """save_hf writes the release's tensors under its names (layout save_pretrained: save_pretrained's),
    transformers loads what it writes with the same logits, and from-hf reads both back exactly."""
    from transformers import AutoModelForCausalLM

    from kimi.convert import load_hf, save_hf

    ours = load_hf(ckpt["release"])
    for layout, like in (("release", ckpt["release"]), ("save_pretrained", ckpt["saved"])):
        out = save_hf(ours, ckpt["root"] / f"out_{layout}", shard_bytes=200_000, layout=layout)
        written, expected = file_tensors(out), file_tensors(like)
        assert written.keys() == expected.keys()
        assert all(torch.equal(written[k], expected[k]) for k in written)
        back = load_hf(out).state_dict()
        assert all(torch.equal(t, back[k]) for k, t in ours.state_dict().items())
    theirs = AutoModelForCausalLM.from_pretrained(ckpt["root"] / "out_release").eval()
    with torch.no_grad():
        assert max_diff(theirs(TOKENS).logits, ckpt["logits"]) < 1e-4


@pytest.fixture
def mlx_lm(ckpt):
    """mlx-lm's model loader, compiling nothing (mlx's CPU compile builds C++ on first use: tens of
    seconds)."""
    mx = pytest.importorskip("mlx.core", reason="mlx (dev extra: mlx[cpu]) not installed")
    utils = pytest.importorskip("mlx_lm.utils", reason="mlx-lm (dev extra) not installed")
    mx.disable_compile()
    yield lambda directory: utils.load_model(directory)[0]
    mx.enable_compile()


def test_mlx_lm_reads_the_release_and_what_to_hf_writes(ckpt, mlx_lm):
    """mlx-lm's kimi_linear on the release and on save_hf's output (and a tied model without MoE):
    transformers' logits in fp32, and greedy
    decoding through each side's cache (mlx-lm's, ours, transformers' generate) picks the same tokens."""
    import mlx.core as mx
    import numpy as np

    from kimi.convert import load_hf, save_hf

    ours = load_hf(ckpt["release"])
    mlx_models = [mlx_lm(ckpt["release"]), mlx_lm(save_hf(ours, ckpt["root"] / "for_mlx"))]
    for model in mlx_models:
        assert max_diff(np.array(model(mx.array(TOKENS.numpy()))), ckpt["logits"]) < 1e-4  # measured 2.2e-6
    tied, _, logits = ckpt["tied"]
    assert max_diff(np.array(mlx_lm(tied)(mx.array(TOKENS.numpy()))), logits) < 1e-4  # measured 3.3e-7
    prompt, steps = TOKENS[:1, :37], 6
    with torch.no_grad():
        out = ckpt["theirs"].generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=steps,
                                      do_sample=False, use_cache=True, pad_token_id=0)
        expected = out[0, prompt.shape[1]:].tolist()
        cache = ours.new_cache()
        logits, tokens = ours(prompt, cache=cache)[0, -1], []
        for _ in range(steps):
            tokens.append(int(logits.argmax()))
            logits = ours(torch.tensor([[tokens[-1]]]), cache=cache)[0, -1]
    assert tokens == expected
    for model in mlx_models:
        cache = model.make_cache()
        logits, picked = model(mx.array(prompt.numpy()), cache=cache)[0, -1], []
        for _ in range(steps):
            picked.append(int(mx.argmax(logits).item()))
            logits = model(mx.array([[picked[-1]]]), cache=cache)[0, -1]
        assert picked == expected


def _missing(ckpt, d):
    return d / "nowhere", ["nowhere: no such directory", "download"]


def _truncated(ckpt, d):
    shutil.copytree(ckpt["release"], d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    return d, ["model.safetensors is not a readable safetensors file", "truncated"]


def _wrong_shape(ckpt, d):
    from safetensors.torch import save_file

    shutil.copytree(ckpt["release"], d)
    tensors = file_tensors(d)
    tensors["model.layers.1.self_attn.kv_b_proj.weight"] = torch.zeros(64, 12)
    save_file(tensors, str(d / "model.safetensors"))
    return d, ["tensor model.layers.1.self_attn.kv_b_proj.weight has shape [64, 12]", "makes it [64, 16]"]


def _transposed(ckpt, d):
    """The same number of elements, laid out otherwise: refused, not reshaped."""
    return write_release(ckpt["saved"], d, **{"layers.0.self_attn.f_a_proj.weight": (32, 16)}), [
        "tensor model.layers.0.self_attn.f_a_proj.weight has shape [32, 16]", "makes it [16, 32]"]


def _config_lacks_keys(ckpt, d):
    shutil.copytree(ckpt["release"], d)
    config = {k: v for k, v in RELEASE_CONFIG.items() if k not in ("kv_lora_rank", "linear_attn_config")}
    (d / "config.json").write_text(json.dumps(config))
    return d, ["config.json: no layer_types (or linear_attn_config.kda_layers",
               "linear_head_dim (or linear_attn_config.head_dim)", "kv_lora_rank"]


def _zero_based_layers(ckpt, d):
    shutil.copytree(ckpt["release"], d)
    linear = dict(RELEASE_CONFIG["linear_attn_config"], kda_layers=[0, 2], full_attn_layers=[1, 3])
    (d / "config.json").write_text(json.dumps(dict(RELEASE_CONFIG, linear_attn_config=linear)))
    return d, ["kda_layers and full_attn_layers must number each of the 4 layers once, from 1"]


BROKEN = [_missing, _truncated, _wrong_shape, _transposed, _config_lacks_keys, _zero_based_layers]


@pytest.mark.parametrize("make", BROKEN, ids=lambda f: f.__name__.strip("_"))
def test_from_hf_names_what_is_wrong_in_one_line(ckpt, tmp_path, capsys, make):
    """Each bad directory: exit code 2 and one line on stderr naming the problem, no traceback, no run."""
    from kimi.convert import main

    directory, expected = make(ckpt, tmp_path / "hf")
    capsys.readouterr()
    code = main(["from-hf", f"hf={directory}", f"run={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert all(e in err for e in expected), err
    assert not (tmp_path / "run").exists()
