"""The fused LM head + cross-entropy (kimi/ops/linear_ce.py) against an fp64 definition and the plain loss,
and the model's loss path (KimiModel(ids, labels=...)) against lm_loss of its logits."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kimi.model import KimiModel, lm_loss
from kimi.config import ConfigError
from kimi.ops.linear_ce import CHUNK_MIB, chunk_tokens, linear_cross_entropy
from kimi.parallel.activation_checkpointing import apply_activation_checkpointing
from kimi.summary import compose_config
from kimi.run.validation import validate

pytestmark = pytest.mark.unit


def reference(h: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean over labels != -100 of logsumexp(h w^T) - (h w^T)[label], in fp64."""
    logits = h.double().reshape(-1, h.shape[-1]) @ w.double().T
    y = y.reshape(-1)
    keep = y != -100
    picked = logits.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
    return ((logits.logsumexp(-1) - picked) * keep).sum() / keep.sum()


def plain(h, w, y):
    """The plain way: every logit, then lm_loss (fp32 cross-entropy)."""
    return lm_loss(F.linear(h, w), y)


def grads(loss_fn, h, w, y, scale=1.0):
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    loss = loss_fn(h, w, y)
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk,chunk_bytes", [(0, CHUNK_MIB << 20), (1, 0), (7, 0), (64, 0), (1000, 0),
                                               (0, 4 * 100 * 8), (0, 4 * 100 * 8 - 1)])
def test_fused_equals_fp64_definition(chunk, chunk_bytes):
    torch.manual_seed(0)
    h, w = torch.randn(3, 37, 16, dtype=torch.float64), torch.randn(100, 16, dtype=torch.float64)
    y = torch.randint(0, 100, (3, 37))
    y[0, :5] = -100  # ignored, as F.cross_entropy's default ignore_index
    want = grads(reference, h, w, y, scale=2.5)
    got = grads(lambda *a: linear_cross_entropy(*a, chunk=chunk, chunk_bytes=chunk_bytes), h, w, y, scale=2.5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_fused_equals_plain_loss_fp32():
    torch.manual_seed(1)
    h, w, y = torch.randn(2, 50, 32), torch.randn(300, 32), torch.randint(0, 300, (2, 50))
    for a, b in zip(grads(linear_cross_entropy, h, w, y), grads(plain, h, w, y)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_equals_liger_kernels_fused_linear_cross_entropy():
    """Liger-Kernel's fused linear cross-entropy (its Triton kernels, interpreted here) is the field's version
    of the same fusion: the loss and both gradients agree in fp32, ignored labels included."""
    from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

    def liger(h, w, y):
        out = LigerFusedLinearCrossEntropyFunction.apply(h.reshape(-1, h.shape[-1]), w, y.reshape(-1))
        return out[0] if isinstance(out, tuple) else out

    torch.manual_seed(5)
    h, w, y = torch.randn(2, 40, 32), torch.randn(300, 32), torch.randint(0, 300, (2, 40))
    y[0, :7] = y[1, 30:] = -100
    for a, b in zip(grads(lambda *a: linear_cross_entropy(*a, chunk=16), h, w, y), grads(liger, h, w, y)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fused_under_bf16_autocast_matches_the_plain_path():
    """Same rounding points as autocast's linear: the loss and hidden gradient equal; the weight gradient
    within bf16's rounding of its per-chunk sums."""
    torch.manual_seed(2)
    h, w, y = torch.randn(2, 64, 32), torch.randn(200, 32), torch.randint(0, 200, (2, 64))

    def under_autocast(fn):
        def run(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(*args)
        return run

    got = grads(under_autocast(lambda *a: linear_cross_entropy(*a, chunk=16)), h, w, y)
    want = grads(under_autocast(plain), h, w, y)
    assert got[1].dtype == want[1].dtype and got[2].dtype == want[2].dtype == torch.float32
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-2, atol=1e-4)
    torch.testing.assert_close(got[2], want[2], rtol=2e-2, atol=2e-3)


def test_without_gradients_only_the_loss():
    torch.manual_seed(3)
    h, w, y = torch.randn(40, 8), torch.randn(50, 8), torch.randint(0, 50, (40,))
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(h, w, y, chunk=9), F.cross_entropy(h @ w.T, y))


def test_the_backward_hands_on_the_forwards_gradients_without_a_copy():
    """The gradients made in the forward are scaled in place and become .grad: no second fp32 [vocab, d]
    tensor at the step's peak. A second backward through the same graph fails loudly rather than scaling
    them twice."""
    torch.manual_seed(4)
    h, w = torch.randn(40, 16, requires_grad=True), torch.randn(100, 16, requires_grad=True)
    y = torch.randint(0, 100, (40,))
    loss = linear_cross_entropy(h, w, y)
    saved_h, saved_w = loss.grad_fn.saved_tensors
    ptrs = saved_h.data_ptr(), saved_w.data_ptr()
    del saved_h, saved_w
    (loss * 2.5).backward()
    assert (h.grad.data_ptr(), w.grad.data_ptr()) == ptrs
    loss = linear_cross_entropy(h, w, y)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


PRESETS = Path(__file__).resolve().parents[2] / "conf" / "model"


@pytest.mark.parametrize("preset", sorted(p.stem for p in PRESETS.glob("*.yaml")))
def test_chunks_are_sized_by_bytes_for_the_presets(preset):
    """The default chunk of every preset's vocabulary is the largest power of two of tokens whose fp32 logits
    fit model.loss_chunk_mib, and it stops growing with the sequence: the loss's peak is a constant per
    step, not a cost per token (presets without a vocabulary take the tokenizer's: 32k as `small`'s). The
    160k-vocabulary presets take 512 MiB: each chunk is a pass over the head's weight gradient, which 64
    tokens a chunk would repeat 64 times at 4,096 tokens."""
    m = compose_config([f"model={preset}"]).model
    vocab, budget = m.vocab_size or 32768, m.loss_chunk_mib << 20
    assert budget == (512 << 20 if vocab >= 100_000 else CHUNK_MIB << 20)
    c = chunk_tokens(1 << 20, vocab, budget)
    assert c >= 512, c
    assert c & (c - 1) == 0 and c * 4 * vocab <= budget < 2 * c * 4 * vocab
    assert chunk_tokens(2048, vocab, budget) == chunk_tokens(1 << 16, vocab, budget) == c
    assert chunk_tokens(c // 2 + 1, vocab, budget) == c  # a sequence within one chunk is one chunk


def test_chunk_rule():
    assert chunk_tokens(16384, 32768) == 512  # small and 1b: 64 MiB of fp32 logits per chunk
    assert chunk_tokens(262144, 163840) == 64  # Kimi's vocabulary: 102 tokens fit, a power of two below
    assert chunk_tokens(262144, 163840, 512 << 20) == 512
    assert chunk_tokens(100, 32) == 128  # everything in one chunk
    assert chunk_tokens(4096, 1 << 25, 1 << 20) == 1  # a budget below one token's logits: one token


def test_loss_chunk_mib_reaches_the_head_and_is_validated():
    cfg = compose_config(["model=small", "model.vocab_size=32768", "model.loss_chunk_mib=8"])
    assert cfg.model.loss_chunk_mib == 8
    with torch.device("meta"):
        assert KimiModel(cfg.model).lm_head.chunk_bytes == 8 << 20
    cfg.model.loss_chunk_mib = 0
    with pytest.raises(ConfigError, match=r"model\.loss_chunk_mib"):
        validate(cfg)


@pytest.mark.parametrize("residual", ["attnres_block", "attnres_full", "standard"])
@pytest.mark.parametrize("ac", ["none", "full", "selective"])
def test_model_loss_path_equals_lm_loss_of_logits(residual, ac):
    """KimiModel(ids, labels=...) (chunked loss, depth mixes inside the checkpointed sublayers) gives the
    loss and every gradient of the cross-entropy of KimiModel(ids)'s logits without checkpointing, in fp64."""
    cfg = compose_config(["model=tiny", "model.vocab_size=256", f"model.residual={residual}",
                          "model.loss_chunk=16"])
    torch.manual_seed(0)
    model = KimiModel(cfg.model).double()
    ids, y = torch.randint(0, 256, (2, 40)), torch.randint(0, 256, (2, 40))
    want = F.cross_entropy(model(ids).flatten(0, 1), y.flatten())  # fp64 (lm_loss would round to fp32)
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    other = copy.deepcopy(model)
    other.zero_grad(set_to_none=True)
    apply_activation_checkpointing(other, ac)
    got = other(ids, labels=y)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    grads_of = {n: p.grad for n, p in other.named_parameters() if p.grad is not None}
    assert grads_of.keys() == ref.keys()
    for n, g in grads_of.items():
        torch.testing.assert_close(g, ref[n], rtol=1e-9, atol=1e-12, msg=n)


def test_plain_loss_switch():
    cfg = compose_config(["model=tiny", "model.vocab_size=256", "model.loss_chunk=-1"])
    torch.manual_seed(0)
    model = KimiModel(cfg.model)
    ids, y = torch.randint(0, 256, (1, 24)), torch.randint(0, 256, (1, 24))
    torch.testing.assert_close(model(ids, labels=y), lm_loss(model(ids), y), rtol=0, atol=0)
