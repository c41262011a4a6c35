"""Incremental decoding through the cache reproduces a full forward; generate() samples reproducibly."""

import pytest
import torch

import kimi.model.kda as kda_module
from kimi.config import ModelConfig
from helpers import tiny_model_cfg
from kimi.model.decode import generate
from kimi.model import KimiModel

pytestmark = pytest.mark.unit

MODES = ["standard", "attnres_full", "attnres_block"]


def tiny_cfg(**kw) -> ModelConfig:
    # KDA, MLA (with RoPE and a compressed query), KDA, MLA: both caches, both positions of MLA.
    base = dict(num_layers=4, mla_layers=None, mla_every=2, mla=dict(q_lora_rank=12, qk_rope_head_dim=8,
                v_head_dim=8), conv_size=4, attnres=dict(block_size=3))
    return tiny_model_cfg(**{**base, **kw})


def decode_in_pieces(model, ids, pieces):
    cache = model.new_cache()
    logits, start = [], 0
    for n in pieces:
        logits.append(model(ids[:, start : start + n], cache=cache))
        start += n
    assert cache.seen_tokens == start == ids.shape[1]
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("residual", MODES)
def test_incremental_equals_full_forward(residual):
    torch.manual_seed(0)
    model = KimiModel(tiny_cfg(residual=residual)).double()
    ids = torch.randint(0, 61, (2, 24))
    full = model(ids)
    # Prefill of 2 (shorter than the conv's padding), a piece of 9, then one token at a time.
    got = decode_in_pieces(model, ids, [2, 9] + [1] * 13)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-10)


def test_chunked_continuation(monkeypatch):
    """Every piece but single tokens through chunk_kda with an initial state; a 66-token prefill spans
    two chunks of the chunked algorithm."""
    monkeypatch.setattr(kda_module, "_RECURRENT_MAX_T", 1)
    torch.manual_seed(1)
    model = KimiModel(tiny_cfg(residual="attnres_block")).double()
    ids = torch.randint(0, 61, (1, 70))
    got = decode_in_pieces(model, ids, [66, 2, 1, 1])
    torch.testing.assert_close(got, model(ids), rtol=1e-10, atol=1e-10)


def test_incremental_fp32():
    torch.manual_seed(2)
    model = KimiModel(tiny_cfg())
    ids = torch.randint(0, 61, (2, 16))
    torch.testing.assert_close(decode_in_pieces(model, ids, [5] + [1] * 11), model(ids), rtol=1e-5, atol=1e-5)


def test_greedy_generate_matches_full_forward_argmax():
    torch.manual_seed(3)
    model = KimiModel(tiny_cfg(init_std=0.5)).double()  # large init: confident, tie-free argmax
    prompt = [5, 17, 2, 40]
    got = generate(model, prompt, max_new_tokens=8, temperature=0.0)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(8):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert got == ids[len(prompt) :]


def test_generate_is_seeded_and_stops_at_eos():
    torch.manual_seed(4)
    model = KimiModel(tiny_cfg())

    def run(**kw):
        return generate(model, torch.tensor([3, 1, 4]), 12, temperature=1.0, top_k=20,
                        generator=torch.Generator().manual_seed(7), **kw)

    tokens = run()
    assert len(tokens) == 12 and tokens == run()
    assert tokens != generate(model, [3, 1, 4], 12, temperature=1.0,
                              generator=torch.Generator().manual_seed(8))
    eos = tokens[5]
    stop = tokens.index(eos)  # the first time it was sampled
    assert run(eos_id=eos) == tokens[:stop]
