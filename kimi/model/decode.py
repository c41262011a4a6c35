"""Decoding a KimiModel with its cache (KDA recurrent state + short-conv tails, MLA latents): top-k sampling
with a generator, used by the trainer's end-of-run sample and by ``python -m kimi.generate``."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from kimi.model import KimiModel


def sample_next(logits: torch.Tensor, temperature: float, top_k: int,
                generator: torch.Generator | None) -> int:
    """One token id from the logits [vocab] of one position. temperature <= 0 means greedy (argmax)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: KimiModel,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue one prompt; returns only the new token ids (at most max_new_tokens).

    The prompt goes through the model in one forward (the prefill), then each sampled token alone through
    the cache, so a step costs the same whatever the length so far for KDA layers. Generation stops
    before max_new_tokens when eos_id is sampled; eos itself is not returned. top_k <= 0 keeps the whole
    vocabulary. The generator (on the model's device for CUDA) makes sampling reproducible.
    """
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("generate needs a non-empty prompt")
    cache = model.new_cache()
    logits = _whole(model(ids, cache=cache))
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = sample_next(logits[0, -1], temperature, top_k, generator)
        if token == eos_id:
            break
        out.append(token)
        if len(out) < max_new_tokens:
            logits = _whole(model(torch.tensor([[token]], device=device), cache=cache))
    return out


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel model's logits are sharded over the vocabulary: every rank gathers them all, then
    samples the same token from the same generator state."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


@torch.no_grad()
def sample_text(model: KimiModel, tokenizer, prompt: str, max_new_tokens: int, seed: int,
                temperature: float = 0.8, top_k: int = 50) -> str:
    """The text `model` continues `prompt` with, sampled from a generator seeded with `seed` on the model's
    device (the model is left in eval mode)."""
    device = next(model.parameters()).device
    g = torch.Generator(device=device).manual_seed(seed)
    model.eval()
    ids = generate(model, tokenizer.encode(prompt), max_new_tokens, temperature=temperature, top_k=top_k,
                   eos_id=tokenizer.eos_id, generator=g)
    return tokenizer.decode(list(ids))


def decode_blocker(p) -> str | None:
    """Why the training layout `p` (a ParallelConfig) cannot decode in place (the end-of-run sample,
    trainer.eval_tasks), or None: a pipeline would need a decoding schedule of its own, and one token cannot
    be split over sequence-parallel ranks. Context-parallel ranks decode the whole sequence each, as one
    process does."""
    if p.pp > 1 or p.sequence_parallel:
        return "a layout with pipeline or sequence parallelism cannot decode in place"
    return None


def final_sample(model: KimiModel, data, t, blocked: str | None, step: int, log) -> str | None:
    """The sample a finished run prints: t.sample_tokens (t: the TrainerConfig) continuing t.sample_prompt,
    or when that is null the first words of `data`'s (the run's prepared data) first validation document,
    logged with `log`; None when none is asked for or the layout cannot decode (blocked: decode_blocker's
    reason), which the log then says."""
    if t.sample_tokens <= 0:
        return None
    if blocked:
        log(f"[kimi] no sample: {blocked}; sample from the run directory with python -m kimi.generate "
            "run=<run dir>")
        return None
    # imported here: kimi.generate and kimi.eval import this module and never need the data pipeline
    from kimi.data.rank_batches import val_opening

    prompt = t.sample_prompt if t.sample_prompt is not None else val_opening(data)
    text = sample_text(model, data.tokenizer, prompt, t.sample_tokens, t.seed)
    log(f"[kimi] sample (step {step}):\n{prompt}{text}\n")
    return text
