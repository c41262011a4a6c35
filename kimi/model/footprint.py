"""A model's size from its config, before anything is built: its parameter count by arithmetic over block
kinds (one meta-device block of each kind, times how many there are: a million-layer typo costs no more
than a small model), and the refusal of a model whose weights (and, training, gradients and optimizer
state: kimi/optim/memory.py) cannot fit the memory of the device it would be allocated on.

The estimate is a lower bound on what the allocation needs (activations, buffers and allocator slack come
on top), so a model it refuses cannot fit; one it lets through may still run out. The check is skipped with
``trainer.skip_size_check=true`` (training) or ``KIMI_SKIP_SIZE_CHECK=1`` in the environment (every
command), e.g. for a machine whose swap or unified memory the check cannot see.
"""

from __future__ import annotations

import os
from collections import Counter

import torch

from kimi.errors import ConfigError
from kimi.model.config import ModelConfig, check_sizes


GIB = 1024**3
SKIP_ENV = "KIMI_SKIP_SIZE_CHECK"


def estimate_params(m: ModelConfig, vocab_size: int | None = None) -> int:
    """The parameter count of KimiModel(m) (a tied LM head counted once), without building it: one block of
    each (token mixer, MLP) kind on the meta device, times its count, plus the ends. vocab_size: the
    vocabulary when m.vocab_size is null (the tokenizer's)."""
    from .mtp import MTPLayer
    from .transformer import Block, block_classes, mtp_block

    check_sizes(m)  # the bounds first: below them one block of each kind is quick to build on meta
    d, vocab = m.d_model, m.vocab_size or vocab_size or 0
    kinds = block_classes(m)
    counts = Counter(kinds[1:])
    with torch.device("meta"):
        total = _numel(Block(m, *kinds[0], first=True))  # the first block has no pseudo-query of its mixer
        total += sum(n * _numel(Block(m, *kind, first=False)) for kind, n in counts.items())
        if m.mtp.layers:
            total += m.mtp.layers * _numel(MTPLayer(d, m.norm_eps, mtp_block(m)))
    attnres = m.residual != "standard"
    ends = d * vocab * (1 if m.tie_embeddings else 2) + d  # embedding, LM head, final norm
    ends += d * attnres * (1 + m.attnres.key_weight)  # final pseudo-query and its key weight
    return total + ends


def _numel(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def device_memory(device: torch.device | str) -> tuple[int, str]:
    """(bytes the device can hold, how that was measured): a GPU's total memory, or the CPU's available
    RAM plus free swap (/proc/meminfo; total RAM where that file does not exist)."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.get_device_properties(index).total_memory, f"the memory of GPU {index}"
    try:
        info = dict(line.split(":", 1) for line in open("/proc/meminfo").read().splitlines() if ":" in line)
        kib = int(info["MemAvailable"].split()[0]) + int(info.get("SwapFree", "0 kB").split()[0])
        return kib * 1024, "the available RAM and swap"
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "the RAM"


def check_fits(m: ModelConfig, bytes_per_param: int, device: torch.device | str, what: str, fix: str,
               shards: int = 1, vocab_size: int | None = None, skip: bool = False,
               skip_with: str = f"{SKIP_ENV}=1") -> int:
    """Refuse, in one ConfigError line, a model whose `bytes_per_param` per parameter (split evenly over
    `shards` ranks: the most a layout could divide it) cannot fit `device`; returns the estimated bytes per
    rank. what: what the bytes are ("fp32 weights"); fix: how to get past it besides a smaller model;
    skip_with: the switch that skips the check, named in the message."""
    params = estimate_params(m, vocab_size)
    need = params * bytes_per_param // max(1, shards)
    if skip or os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return need
    have, where = device_memory(device)
    if need > have:
        per = f" per rank (split over {shards} ranks)" if shards > 1 else ""
        raise ConfigError(f"the model does not fit: {params:,} parameters need at least "
                          f"{need / GIB:,.1f} GiB for {what}{per}, more than {where} "
                          f"({have / GIB:,.1f} GiB); "
                          f"choose a smaller model, {fix}, or skip this check with {skip_with}")
    return need
