"""Softmax attention (letter A, kimi/model/mha.py): a dense model of it equals transformers' Llama (an
independent definition of the same architecture), with and without grouped key/value heads; decoding through
its cache equals the full forward; QK-Clip's rows bring a head's max logit to the threshold."""

import pytest
import torch

from helpers import tiny_model_cfg
from kimi.model import KimiModel

pytestmark = pytest.mark.unit

VOCAB = 61


def dense(kv_heads: int) -> KimiModel:
    """Llama's layout: softmax attention of 4 query heads and `kv_heads` key/value heads in every block."""
    torch.manual_seed(0)
    cfg = tiny_model_cfg(vocab_size=VOCAB, layer_pattern="A", residual="standard",
                         mha=dict(num_heads=4, kv_heads=kv_heads), rope_theta=500.0)
    return KimiModel(cfg).eval()


def llama_of(model: KimiModel):
    """transformers' LlamaForCausalLM with our model's weights (names mapped one to one)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kimi.model.mha import attention_heads

    c = model.cfg
    heads, kv_heads, head_dim = attention_heads(c)
    config = LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.d_model, intermediate_size=c.mlp.hidden,
                         num_hidden_layers=c.num_layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, rms_norm_eps=c.norm_eps,
                         rope_theta=c.rope_theta, tie_word_embeddings=False, attention_bias=False,
                         mlp_bias=False)
    llama = LlamaForCausalLM(config).eval()
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "lm_head.weight": "lm_head.weight"}
    for i in range(c.num_layers):
        theirs = f"model.layers.{i}."
        names.update({f"blocks.{i}.mixer_norm.weight": theirs + "input_layernorm.weight",
                      f"blocks.{i}.mlp_norm.weight": theirs + "post_attention_layernorm.weight",
                      **{f"blocks.{i}.mixer.w{x}.weight": f"{theirs}self_attn.{x}_proj.weight"
                         for x in "qkvo"},
                      **{f"blocks.{i}.mlp.w_{x}.weight": f"{theirs}mlp.{x}_proj.weight"
                         for x in ("gate", "up", "down")}})
    state = model.state_dict()
    assert set(names) == set(state)
    llama.load_state_dict({names[k]: v for k, v in state.items()}, strict=False)
    return llama


@pytest.mark.parametrize("kv_heads", [0, 2, 1])
def test_dense_model_equals_transformers_llama(kv_heads):
    pytest.importorskip("transformers", reason="transformers (dev extra) not installed")
    model = dense(kv_heads)
    ids = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        ours, theirs = model(ids), llama_of(model)(ids).logits
    assert (ours - theirs).abs().max() < 1e-5


def test_decoding_through_the_cache_equals_the_full_forward():
    model = dense(2)
    ids = torch.randint(0, VOCAB, (2, 15))
    cache = model.new_cache()
    with torch.no_grad():
        full = model(ids)
        steps = [model(ids[:, :9], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(9, 15)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [0, 2])
def test_qk_clip_rows_bring_each_heads_max_logit_to_tau(kv_heads):
    """Scaling a head's rows as its spec says (gamma = tau / max) makes that head's max logit tau: both
    sides by sqrt(gamma) for plain heads, the queries by gamma when key heads are shared."""
    from kimi.optim.qk_clip import apply_qk_clip

    model = dense(kv_heads).double().train()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4)  # large logits
    model.record_max_logits()
    ids = torch.randint(0, VOCAB, (2, 17))
    model(ids).sum()
    spec = model.qk_clip_specs()[0]
    before = spec.max_logits()
    tau = float(before.min()) / 2
    params = dict(model.named_parameters())
    model(ids).sum()
    with torch.no_grad():
        apply_qk_clip(params, model.qk_clip_specs(), tau)
    model(ids).sum()
    after = model.qk_clip_specs()[0].max_logits()
    torch.testing.assert_close(after, torch.full_like(after, tau), rtol=1e-6, atol=0)  # gamma in fp32
