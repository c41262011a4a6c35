"""Token mixers by their letter in ``model.layer_pattern`` and MLPs by kind: adding a sublayer is one file
(its class, following kimi/model/sublayer.py's contract) and one line here.

Entries name ``module:Class`` inside kimi.model and are imported when first asked for, so this table is
the only place a new sublayer is mentioned.
"""

from __future__ import annotations

import importlib
from functools import lru_cache
from typing import Dict, List

from kimi.errors import ConfigError
from kimi.model.config import ModelConfig, mixer_pattern, moe_layer_indices

MIXERS: Dict[str, str] = {
    "K": "kda:KDA",
    "M": "mla:MLA",
    "C": "conv:ConvMixer",
    "A": "mha:MHA",
}
MLPS: Dict[str, str] = {
    "dense": "mlp:SwiGLU",
    "moe": "moe:MoE",
}


@lru_cache(maxsize=None)
def _load(ref: str) -> type:
    module, _, name = ref.partition(":")
    # relative: an export with its own modeling code (kimi.interop.remote_code) holds these files elsewhere
    return getattr(importlib.import_module(f".{module}", __package__), name)


def mixer_class(letter: str) -> type:
    if letter not in MIXERS:
        raise ConfigError(f"model.layer_pattern: {letter!r} names no token mixer; the letters are "
                          f"{', '.join(f'{k} ({mixer_label(k)})' for k in MIXERS)}")
    return _load(MIXERS[letter])


def mixer_label(letter: str) -> str:
    return _load(MIXERS[letter]).LABEL


def mlp_class(kind: str) -> type:
    return _load(MLPS[kind])


def mixer_classes(cfg: ModelConfig) -> List[type]:
    """Each block's token-mixer class, in order (checks every letter of the pattern)."""
    return [mixer_class(letter) for letter in mixer_pattern(cfg)]


def mlp_kinds(cfg: ModelConfig) -> List[str]:
    """Each block's MLP kind: "moe" from model.moe.first_dense on in a mixture-of-experts model."""
    moe = set(moe_layer_indices(cfg))
    return ["moe" if i in moe else "dense" for i in range(cfg.num_layers)]


def legend(cfg: ModelConfig) -> str:
    """'K=KDA, M=MLA' for the letters the pattern uses, in order of first use."""
    return ", ".join(f"{k}={mixer_label(k)}" for k in dict.fromkeys(mixer_pattern(cfg)))
