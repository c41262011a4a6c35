"""Attention Residuals: depth-softmax weights, block bookkeeping, and the model's wiring of both."""

import math

import pytest
import torch

from helpers import tiny_model_cfg
from kimi.model import KimiModel
from kimi.model.attnres import BlockAttnResStream, depth_attention, depth_weights

pytestmark = pytest.mark.unit


tiny_cfg = tiny_model_cfg


def expected_sources(v: list, layer: int, block_size: int) -> list:
    """Sources of 1-based sublayer `layer` (layer = L + 1: the final aggregation), from the outputs
    v[0] (embedding), v[1], ... by index arithmetic: completed blocks, then the partial block if any."""
    done = layer - 1  # outputs produced before this sublayer
    full, rest = divmod(done, block_size)
    blocks = [sum(v[1 + b * block_size : 1 + (b + 1) * block_size]) for b in range(full)]
    partial = [sum(v[1 + full * block_size : 1 + done])] if rest else []
    return [v[0]] + blocks + partial


@pytest.mark.parametrize("block_size", [1, 2, 3])
def test_block_bookkeeping(block_size):
    L = 7
    v = [torch.full((1, 1, 4), float(2**i)) for i in range(L + 1)]  # powers of 2: every sum is unique
    stream = BlockAttnResStream(v[0], block_size, eps=1e-6)
    for layer in range(1, L + 2):
        got, want = stream.sources(), expected_sources(v, layer, block_size)
        assert [float(s.flatten()[0]) for s in got] == [float(s.flatten()[0]) for s in want], layer
        if layer <= L:
            stream.push(v[layer])


def test_block_bookkeeping_matches_paper_example():
    # Block 2 (S = 3), sublayer i = 3 sees [b_0, b_1] plus the partial b_2^2 = v_4 + v_5.
    v = [torch.tensor([float(2**i)]) for i in range(6)]
    assert [float(s) for s in expected_sources(v, 6, 3)] == [1.0, 2 + 4 + 8, 16 + 32]


def test_hand_computed_mix():
    v0, v1, v2 = torch.tensor([3.0, 4.0]), torch.tensor([1.0, -1.0]), torch.tensor([0.0, 2.0])
    w = torch.tensor([2.0, 0.0])
    # Keys RMS-normalised: v0 / sqrt(12.5), v1 / 1, v2 / sqrt(2); scores w . key = 6/sqrt(12.5), 2, 0.
    e = [math.exp(6 / math.sqrt(12.5)), math.exp(2.0), math.exp(0.0)]
    a = [x / sum(e) for x in e]
    want = torch.tensor([a[0] * 3 + a[1] * 1 + a[2] * 0, a[0] * 4 + a[1] * -1 + a[2] * 2],
                        dtype=torch.float64)
    sources = [s.double().view(1, 1, 2) for s in (v0, v1, v2)]
    got = depth_attention(w.double(), sources, eps=0.0)
    torch.testing.assert_close(got.view(2), want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(depth_weights(w.double(), sources, 0.0).view(3),
                               torch.tensor(a, dtype=torch.float64))


def test_zero_query_gives_uniform_weights():
    sources = [torch.randn(2, 5, 8) * scale for scale in (0.01, 1.0, 300.0)]
    weights = depth_weights(torch.zeros(8), sources, eps=1e-6)
    torch.testing.assert_close(weights, torch.full_like(weights, 1 / 3))


def test_init_zeroes_queries():
    model = KimiModel(tiny_cfg(residual="attnres_full"))
    for q in model.attnres_queries():
        q.data.normal_()
    model.init_weights()
    assert len(model.attnres_queries()) == 2 * model.cfg.num_layers  # first sublayer has none, final has one
    assert all(q.abs().max() == 0 for q in model.attnres_queries())


def _record_model(model: KimiModel, ids: torch.Tensor):
    """Run the model and return (sublayer outputs with the embedding first, sublayer inputs, final input)."""
    outputs, inputs, hooks = [], [], []
    hooks.append(model.embed.register_forward_hook(lambda m, a, out: outputs.append(out)))
    for b in model.blocks.values():
        for norm, fn in ((b.mixer_norm, b.mixer), (b.mlp_norm, b.mlp)):
            hooks.append(norm.register_forward_pre_hook(lambda m, a: inputs.append(a[0])))
            hooks.append(fn.register_forward_hook(lambda m, a, out: outputs.append(out)))
    final = []
    hooks.append(model.norm.register_forward_pre_hook(lambda m, a: final.append(a[0])))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return outputs, inputs, final[0]


@pytest.mark.parametrize("residual,block_size",
                         [("attnres_full", 1), ("attnres_block", 2), ("attnres_block", 4)])
def test_model_zero_init_inputs_are_source_means(residual, block_size):
    """With zero queries every sublayer input (and the final one) is the plain mean of the right sources."""
    model = KimiModel(tiny_cfg(residual=residual, attnres=dict(block_size=block_size))).double()
    v, inputs, final = _record_model(model, torch.randint(0, 61, (2, 9)))
    for layer, h in enumerate(inputs + [final], start=1):
        want = torch.stack(expected_sources(v, layer, block_size)).mean(0)
        torch.testing.assert_close(h, want, rtol=1e-12, atol=1e-12)


def test_block_size_one_equals_full():
    torch.manual_seed(0)
    full = KimiModel(tiny_cfg(residual="attnres_full"))
    block = KimiModel(tiny_cfg(residual="attnres_block", attnres=dict(block_size=1)))
    for q in full.attnres_queries():
        q.data.normal_()  # non-uniform depth weights, or any source ordering would pass
    block.load_state_dict(full.state_dict())
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        assert torch.equal(full(ids), block(ids))
    # ...and the mode matters: a larger block gives different logits with the same parameters.
    other = KimiModel(tiny_cfg(residual="attnres_block", attnres=dict(block_size=2)))
    other.load_state_dict(full.state_dict())
    with torch.no_grad():
        assert not torch.allclose(full(ids), other(ids))


@pytest.mark.parametrize("residual", ["attnres_full", "attnres_block"])
def test_key_weight_is_the_query_folded(residual):
    """model.attnres.key_weight (Kimi K3's key-norm weight gamma per mixing site): logits
    w . (gamma * RMSNorm(v)) are those of the query gamma * w without gamma, at every site and in fp64
    exactly; gamma starts at 1 (and the query at 0), and both train."""
    torch.manual_seed(0)
    keyed = KimiModel(tiny_cfg(residual=residual, attnres=dict(key_weight=True))).double()
    weights = [(n, p) for n, p in keyed.named_parameters() if n.endswith("_key_weight")]
    assert len(weights) == len(keyed.attnres_queries()) and all(torch.all(p == 1) for _, p in weights)
    with torch.no_grad():
        for q in keyed.attnres_queries():
            q.normal_()
        for _, p in weights:
            p.uniform_(0.5, 1.5)
    folded = KimiModel(tiny_cfg(residual=residual)).double()
    state = keyed.state_dict()
    for name, gamma in weights:
        query = name.replace("_key_weight", "_query")
        state[query] = state[query] * state.pop(name)
    folded.load_state_dict(state)
    ids = torch.randint(0, 61, (2, 12))
    out = keyed(ids)
    torch.testing.assert_close(out, folded(ids), rtol=1e-12, atol=1e-12)
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for _, p in weights)
