"""The LM head and cross-entropy fused: the mean next-token loss from the final hidden states, chunk by chunk,
so the whole sequence's logits never exist at once.

The plain way (kimi.model.lm_loss on the logits, the reference) materialises [N, vocab] logits, their fp32
copy and the fp32 gradient: 10 bytes per token per vocabulary entry under bf16 autocast, 330 KB per token at a
32k vocabulary, more than the rest of a checkpointed model keeps. Here each chunk's logits are made,
reduced to the loss and turned into the chunk's gradients at once (Liger-Kernel's fused linear
cross-entropy does the same): the backward only scales the gradients kept from the forward, so the
head's matmuls are not recomputed, and what stays per token is the hidden state's gradient ([N, d], in
the hidden states' dtype) plus one [vocab, d] fp32 gradient of the weight.

Numerics follow the plain path under autocast: the matmul runs in the autocast dtype (its output rounded
there, as autocast's linear rounds the logits), softmax and loss in fp32, the logits' gradient rounded
back to the matmul dtype before the two gradient matmuls. Labels equal to `ignore_index` (-100, as
F.cross_entropy) do not count; the mean is over the rest.
"""

from __future__ import annotations

import contextlib

import torch

from kimi.ops import autocast_dtype

IGNORE_INDEX = -100


# The default of model.loss_chunk_mib: MiB of fp32 logits a chunk may hold (512 tokens at a 32k vocabulary, 64
# at a 160k one: powers of two). A chunk's peak is about 1.5 times that (its logits are made in the matmul
# dtype and copied to fp32, its fp32 gradient copied back), a constant once the sequence is longer than one
# chunk. Each chunk costs a pass over the [vocab, d] fp32 weight gradient (about 12 vocab d bytes with the
# product's copy); at an H200's datasheet peaks the head's matmuls (6 tokens d vocab FLOPs) outlast it from
# about 400 tokens per chunk, so a large vocabulary wants a larger budget where memory allows.
CHUNK_MIB = 64


def chunk_tokens(tokens: int, vocab: int, budget_bytes: int = CHUNK_MIB << 20) -> int:
    """Tokens per chunk: the most whose fp32 logits fit in `budget_bytes`, rounded down to a power of two (at
    least 1), and at most the next power of two above `tokens` (a short sequence is one chunk)."""
    fit = max(1, budget_bytes // (4 * vocab))
    return min(1 << (fit.bit_length() - 1), _pow2(tokens))


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return autocast_dtype(hidden.device.type) or torch.promote_types(hidden.dtype, weight.dtype)


def _chunks(hidden, weight, labels, chunk, grads: bool):
    """Yield, per chunk, (rows, its summed loss, its logits' gradient of the summed loss or None)."""
    valid = labels != IGNORE_INDEX
    safe = labels.clamp(min=0)
    for s in range(0, hidden.shape[0], chunk):
        rows = slice(s, s + chunk)
        logits = hidden[rows] @ weight.T
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        lse = logits.logsumexp(-1)
        keep = valid[rows]
        target = logits.gather(1, safe[rows, None]).squeeze(1)
        loss = torch.where(keep, lse - target, 0.0).sum()
        grad = None
        if grads:
            grad = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            grad.scatter_add_(1, safe[rows, None], torch.full_like(grad[:, :1], -1.0))
            grad.mul_(keep[:, None])
        yield rows, loss, grad
        del logits, grad  # before the next chunk's logits exist: one chunk's at a time


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk: int):
        dtype = _compute_dtype(hidden, weight)
        device = hidden.device.type
        with torch.autocast(device, enabled=False) if autocast_dtype(device) else contextlib.nullcontext():
            h, w = hidden.to(dtype), weight.to(dtype)
            acc = torch.promote_types(torch.float32, dtype)  # the loss's and the weight gradient's dtype
            count = (labels != IGNORE_INDEX).sum().clamp(min=1)  # a tensor: no host sync
            want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
            grad_h = torch.empty_like(hidden) if want_h else None
            grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
            total = torch.zeros((), dtype=acc, device=hidden.device)
            for rows, loss, grad in _chunks(h, w, labels, chunk, grads=want_h or want_w):
                total += loss
                grad = grad.div_(count).to(dtype)
                if want_h:
                    grad_h[rows] = grad @ w
                if want_w:
                    grad_w += grad.T @ h[rows]
                del grad
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        # Scaled in place: a product would be a second [vocab, d] fp32 tensor beside the saved one at the
        # step's peak (256 MiB for `1b`). Same bits; a second backward through this graph fails on the saved
        # tensors' version check instead of scaling twice.
        grad_h, grad_w = ctx.saved_tensors
        gh = None if grad_h is None else grad_h.mul_(grad_out.to(grad_h.dtype))
        gw = None if grad_w is None else grad_w.mul_(grad_out).to(ctx.weight_dtype)
        return gh, gw, None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         chunk: int = 0, chunk_bytes: int = CHUNK_MIB << 20) -> torch.Tensor:
    """Mean cross-entropy of F.linear(hidden, weight) against labels, chunk tokens at a time (0: as many as
    chunk_bytes of fp32 logits hold, chunk_tokens).

    hidden [..., d], weight [vocab, d], labels [...] with hidden's leading shape."""
    h, y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if h.shape[0] != y.shape[0]:
        raise ValueError(f"linear_cross_entropy: {h.shape[0]} hidden states for {y.shape[0]} labels")
    chunk = chunk or chunk_tokens(h.shape[0], weight.shape[0], chunk_bytes)
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, y, chunk)
    dtype = _compute_dtype(hidden, weight)
    h, w = h.to(dtype), weight.to(dtype)
    total = sum(loss for _, loss, _ in _chunks(h, w, y, chunk, grads=False))
    return total / (y != IGNORE_INDEX).sum().clamp(min=1)
