"""The model section (model.*): its schema, the size bounds that refuse a typo before anything is built,
the per-block helpers read from it (which mixer, which blocks are MoE) and the vocabulary size against the
tokenizer's.

Torch-free, like every section's config (kimi/schema/__init__.py): kimi/config.py assembles the root config
from it, and train.py refuses a misspelt key or an absurd size before importing torch. The section's other
rules are kimi/model/rules.py's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields, is_dataclass, replace
from typing import Any, List, Optional

from kimi.errors import ConfigError
from kimi.model.sections import (ALIASES, ATTENTION_BACKENDS, ATTNRES_BACKENDS, KDA_BACKENDS,  # noqa: F401
                                 MLP_ACTIVATIONS, MOE_BALANCE, MOE_IMPLS, AttentionConfig,
                                 AttnResConfig, KdaConfig, MhaConfig, MlaConfig, MlpConfig, MoeConfig,
                                 MtpConfig)
from kimi.schema.vocabulary import RootConfig, check, one_of, require, value_at

RESIDUAL_MODES = ("standard", "attnres_full", "attnres_block")


def _with_aliases(cls: type) -> type:
    """The old flat keys (sections.ALIASES) as fields of the dataclass about to be made from `cls`: null
    unless an old config, preset or override sets one, which resolve_aliases then moves to its section. Their
    metadata names the new key; the help, the key suggestions and the stored config leave them out."""
    for old, new in ALIASES.items():
        cls.__annotations__[old] = "Optional[Any]"
        setattr(cls, old, field(default=None, repr=False, compare=False, metadata={"alias_of": new}))
    return cls


@dataclass
@_with_aliases
class ModelConfig:
    name: str = "tiny"
    # None: take the tokenizer's vocabulary size (rounded up to `pad_vocab_multiple`).
    vocab_size: Optional[int] = None
    pad_vocab_multiple: int = 64
    d_model: int = 256
    num_layers: int = 4  # transformer blocks; each is a token mixer (KDA or MLA) and an MLP
    # Each block's token mixer as a letter of kimi/model/registry.py (K = KDA, M = MLA), e.g. "KKKM"; a
    # shorter pattern repeats (its length must divide num_layers). null: from mla_every / mla_layers.
    layer_pattern: Optional[str] = None
    # Every `mla_every`-th block (1-based) uses MLA, the rest KDA: 4 gives Kimi Linear's 3:1.
    # 0 means no MLA at all, 1 means MLA everywhere. `mla_layers` (0-based) overrides it.
    mla_every: int = 4
    mla_layers: Optional[List[int]] = None
    conv_size: int = 4  # the short convolutions' width (KDA's q/k/v, the C mixer)
    rope_theta: float = 10000.0  # RoPE's base (MLA's rotated key dims, softmax attention)
    tie_embeddings: bool = False
    # Residuals: standard pre-norm, or Attention Residuals over every layer / over blocks of layers.
    residual: str = one_of(RESIDUAL_MODES, "attnres_block")
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # The training loss from the final hidden states, this many tokens at a time (kimi/ops/linear_ce.py), so
    # the sequence's logits never exist whole: 0 takes as many as loss_chunk_mib holds, -1 the plain way
    # (every logit, then the cross-entropy). Vocabulary-parallel heads (tensor parallelism) and pipeline
    # schedules always take the plain way.
    loss_chunk: int = 0
    # MiB of fp32 logits one loss chunk may hold when loss_chunk is 0: the chunk is the largest power of two
    # of tokens within it (kimi.ops.linear_ce.chunk_tokens; 64: 512 tokens at a 32k vocabulary). Its peak,
    # about 1.5 times this, does not grow with the sequence; a smaller budget makes more passes over the
    # head's fp32 weight gradient (one per chunk).
    loss_chunk_mib: int = 64
    # Each component's own keys (kimi/model/sections.py)
    kda: KdaConfig = field(default_factory=KdaConfig)
    mla: MlaConfig = field(default_factory=MlaConfig)
    mha: MhaConfig = field(default_factory=MhaConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    mlp: MlpConfig = field(default_factory=MlpConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    attnres: AttnResConfig = field(default_factory=AttnResConfig)
    mtp: MtpConfig = field(default_factory=MtpConfig)

    def __post_init__(self) -> None:
        for f in fields(self):  # ModelConfig(**stored): a section as its dict
            if isinstance(getattr(self, f.name), dict):
                setattr(self, f.name, f.default_factory(**getattr(self, f.name)))
        resolve_aliases(self)  # ModelConfig(kda_num_heads=8), dataclasses.replace, OmegaConf.to_object


# ---- the old flat keys -------------------------------------------------------------------------------------
def _get(node: Any, key: str) -> Any:
    return node.get(key) if isinstance(node, dict) else getattr(node, key, None)


def resolve_aliases(m: Any) -> List[str]:
    """Move every old flat key that is set (not null) in model section `m` (a ModelConfig, its DictConfig or
    a plain dict) to its section's key, and clear it; the old keys found, in order. The old key wins over the
    new one: an old command's override (model=kimi_linear_48b_a3b model.moe_num_experts=16) changes a
    preset written with the new keys, as it did before."""
    found = []
    for old, new in ALIASES.items():
        value = _get(m, old)
        if value is None:
            continue
        section, name = new.split(".")
        if isinstance(m, dict):
            m.setdefault(section, {})[name] = value
            del m[old]
        elif is_dataclass(m):  # a copy: dataclasses.replace hands the new config the old one's sections
            setattr(m, section, replace(getattr(m, section), **{name: value}))
            setattr(m, old, None)
        else:  # a DictConfig
            m[section][name] = value
            m[old] = None
        found.append(old)
    return found


_ANNOUNCED: set = set()


def announce_aliases(found: List[str]) -> None:
    """One line on stderr naming the old keys a config used and their new names: once per process for a
    given set (a run composes its config more than once), by rank 0 alone."""
    import os
    import sys

    if not found or tuple(found) in _ANNOUNCED or os.environ.get("RANK", "0") != "0":
        return
    _ANNOUNCED.add(tuple(found))
    pairs = ", ".join(f"model.{old} -> model.{ALIASES[old]}" for old in found)
    print(f"[config] renamed keys, the old names still read for now: {pairs}", file=sys.stderr, flush=True)


def schema_fields(cls: type) -> list:
    """The fields of dataclass `cls` a user is shown (help, key suggestions): not the old flat keys."""
    return [f for f in fields(cls) if "alias_of" not in f.metadata]


def model_dict(m: ModelConfig) -> dict:
    """The model section as plain containers, its sections nested, without the old keys (what an export
    stores; ModelConfig(**it) gives `m` back)."""
    return {k: v for k, v in asdict(m).items() if k not in ALIASES}


# ---- sizes -------------------------------------------------------------------------------------------------
# Upper bounds of the model's sizes, far past any real model, so that a typo (d_model=1048576, a million
# layers) is one line instead of an allocator's traceback or minutes of building: key -> (bound, what the
# largest released model, Kimi K3 (conf/model/kimi_k3.yaml), or the widest preset has); each leaves 8x or
# more. Here, not with the model's other rules (kimi/model/rules.py, whose validate_model runs them first),
# because this module does not import torch: train.py refuses such a typo before the seconds of importing it.
SIZE_BOUNDS = {
    "d_model": (65536, "Kimi K3 has 7168"),
    "num_layers": (1024, "Kimi K3 has 93"),
    "vocab_size": (2**21, "Kimi K3 has 163840"),
    "kda.num_heads": (1024, "Kimi K3 has 96"),
    "mla.num_heads": (1024, "Kimi K3 has 96"),
    "mha.num_heads": (1024, "Kimi K3's attention has 96"),
    "mha.kv_heads": (1024, "Kimi K3's attention has 96"),
    "kda.head_dim": (1024, "Kimi K3 has 128"),
    "mla.qk_nope_head_dim": (1024, "Kimi K3 has 128"),
    "mla.qk_rope_head_dim": (1024, "Kimi K3 has 64"),
    "mla.v_head_dim": (1024, "Kimi K3 has 128"),
    "mha.head_dim": (1024, "Kimi K3's attention has 128"),
    "mla.q_lora_rank": (65536, "Kimi K3 has 1536"),
    "mla.kv_lora_rank": (65536, "Kimi K3 has 512"),
    "moe.latent_dim": (65536, "Kimi K3 has 3584"),
    "mlp.hidden": (2**21, "Kimi K3 has 33792, the dense 48b_dense preset 247808"),
    "moe.hidden": (2**21, "Kimi K3 has 3072"),
    "moe.num_experts": (8192, "Kimi K3 has 896"),
    "moe.shared_experts": (8192, "Kimi K3 has 2"),
    "mtp.layers": (64, "Kimi K3 has 1"),
    "pad_vocab_multiple": (2**21, "64 is usual; Kimi K3's whole vocabulary is 163840"),
}


def check_sizes(m: Any) -> None:
    """Every size of model section `m` (a ModelConfig, or its DictConfig) at most its bound (SIZE_BOUNDS)."""
    for key, (bound, largest) in SIZE_BOUNDS.items():
        value = value_at(m, key)
        check(value is None or value <= bound, f"model.{key}", value,
              f"must be <= {bound}, far past any real model ({largest}): is it a typo?")


def moe_layer_indices(m: ModelConfig) -> List[int]:
    """0-based indices of the blocks whose MLP is a mixture of experts."""
    return list(range(m.moe.first_dense, m.num_layers)) if m.moe.num_experts else []


def mixer_pattern(m: ModelConfig) -> str:
    """One letter per block naming its token mixer (kimi/model/registry.py): model.layer_pattern repeated to
    model.num_layers, or K (KDA) and M (MLA) from model.mla_layers / model.mla_every."""
    if m.layer_pattern:
        return m.layer_pattern * max(1, m.num_layers // len(m.layer_pattern))
    if m.mla_layers is not None:
        mla = {int(i) for i in m.mla_layers}
    else:
        mla = {i for i in range(m.num_layers) if m.mla_every > 0 and (i + 1) % m.mla_every == 0}
    return "".join("M" if i in mla else "K" for i in range(m.num_layers))


def mla_layer_indices(m: ModelConfig) -> List[int]:
    """0-based indices of the blocks whose token mixer is MLA."""
    return [i for i, letter in enumerate(mixer_pattern(m)) if letter == "M"]


# ---- the vocabulary against the tokenizer ------------------------------------------------------------------
def check_vocab(cfg: RootConfig) -> None:
    """A set model.vocab_size must hold the tokenizer's ids; a trained tokenizer has exactly
    data.tokenizer.vocab_size (a given data.tokenizer.model_path is only known after loading it)."""
    m, tok = cfg.model, cfg.data.tokenizer
    if m.vocab_size is not None and tok.model_path is None:
        require(m.vocab_size >= tok.vocab_size,
                f"model.vocab_size={m.vocab_size} is invalid: the tokenizer trained with "
                f"data.tokenizer.vocab_size={tok.vocab_size} has that many tokens; set model.vocab_size >= "
                f"{tok.vocab_size}, or null to follow the tokenizer")


def resolve_vocab(m: ModelConfig, tokenizer_vocab: int) -> None:
    """Set model.vocab_size from the tokenizer when it is null (padded to model.pad_vocab_multiple); refuse
    one too small for the tokenizer."""
    if m.vocab_size is None:
        mult = m.pad_vocab_multiple
        m.vocab_size = (tokenizer_vocab + mult - 1) // mult * mult
    elif m.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size={m.vocab_size} is invalid: the tokenizer has {tokenizer_vocab} "
                          "tokens; set model.vocab_size >= that, or null to follow the tokenizer")
