"""The sublayer contract: what every token mixer and every MLP declares about itself, as plain data beside
its code, so that parallelism, the optimizer, diagnostics, FLOP counts, the summary, the banner and the
converters read the declarations instead of keeping a table per layer type.

A sublayer is an ``nn.Module`` built by ``build(cfg)`` from the model config. Its forward takes the normed
residual input x [B, T, d] and returns [B, T, d]; a mixer also takes ``cu_seqlens`` (packed documents),
``cache`` (decoding) and ``context`` (its shard of a sequence under context parallelism), an MLP ``rows``
(the batch rows of a packed input). What it declares:

  init_rules()       how each of its parameters starts, by name (kimi/model/init.py), given the model's
                     init std and the smaller one of output projections
  LABEL, FAMILY      its name in the banner ("KDA") and its parameter family in kimi.summary ("KDA mixers");
                     FAMILY_OF re-files the parameters under a prefix (a MoE's "experts" are "routed experts")
  tp_plan()          tensor parallelism by parameter name (a :class:`TPPlan`: no torch.distributed here);
                     TP_DIVIDES: the config keys that must divide by parallel.tp under that plan
  flops_per_token()  training FLOPs (forward + backward) per token beyond 6 per active parameter (the
                     sequence-length terms: attention scores, KDA's chunked state); inactive_params()
  new_cache()        its decoding state (None: nothing to keep between calls)
  qk_clip_spec(), muon_splits(), set_record_max_logits()
                     what QK-Clip and Muon may act on (rows of its weights), and the switch that makes it
                     record the max logits QK-Clip reads (MAX_LOGITS: it has softmax logits to record);
                     RECORDS: the attributes a training forward writes besides its output (a pipeline's
                     shape inference undoes them)
  PROBES             the values it hands a diagnostic pass (kimi/model/probe.py) under these names
  HF_NAMES           each parameter's name in a Hugging Face Kimi Linear checkpoint, relative to
                     ``model.layers.<i>.`` (see :func:`hf_entries`)
  EP_SPLIT           submodules whose parameters expert parallelism splits along dim 0 (a MoE's experts)
  ZERO3_LEAF         whether DeepSpeed ZeRO-3 must gather its parameters as one unit (its forward reads a
                     submodule's weight without calling the submodule)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Dict, List, Optional, Tuple, Union

from torch import nn

from .layouts import QKClipSpec, RowSplit

# A Hugging Face name, or (name, the file tensor's shape with -1 for our tensor's numel), or a name with
# "{e}" for one file tensor per index of our tensor's first dim (a MoE's experts).
HFName = Union[str, Tuple[str, Tuple[int, ...]]]


@dataclass(frozen=True)
class TPPlan:
    """Tensor parallelism of one sublayer, by name relative to it (Megatron's column/row scheme).

    colwise   nn.Linear submodules split by output rows (their heads or width)
    rowwise   nn.Linear submodules split by input columns (the output projection: the ranks' sum)
    by_heads  parameters the layer uses directly, split along dim 0 (stored as Shard(0) DTensors)
    sum_grads replicated parameters applied to this rank's heads only (their gradient is a partial sum)
    replicate the whole sublayer stays whole on every tp rank and computes alike (a MoE: experts are split
              by expert parallelism instead)
    """

    colwise: Tuple[str, ...] = ()
    rowwise: Tuple[str, ...] = ()
    by_heads: Tuple[str, ...] = ()
    sum_grads: Tuple[str, ...] = ()
    replicate: bool = False

    def split_dim(self, name: str) -> Optional[int]:
        """The dimension tp splits parameter `name` (relative to the sublayer) along; None: replicated."""
        owner, _, leaf = name.rpartition(".")
        if self.replicate or name in self.sum_grads:
            return None
        if name in self.by_heads or owner in self.colwise:
            return 0
        if owner in self.rowwise:
            return 1 if leaf == "weight" else None  # a row-parallel bias is added once, after the sum
        return None


class Sublayer:
    """Mixin of every token mixer and MLP (before nn.Module in the bases); the defaults declare nothing. Each
    sublayer defines ``init_rules`` itself (there is no default way to start a parameter)."""

    LABEL: ClassVar[str] = ""
    FAMILY: ClassVar[str] = ""
    FAMILY_OF: ClassVar[Dict[str, str]] = {}
    TP_DIVIDES: ClassVar[Tuple[str, ...]] = ()
    MAX_LOGITS: ClassVar[bool] = False
    RECORDS: ClassVar[Tuple[str, ...]] = ()
    PROBES: ClassVar[Tuple[str, ...]] = ()
    HF_NAMES: ClassVar[Dict[str, HFName]] = {}
    EP_SPLIT: ClassVar[Tuple[str, ...]] = ()
    ZERO3_LEAF: ClassVar[bool] = False

    @classmethod
    def build(cls, cfg) -> nn.Module:
        return cls(cfg)

    def tp_plan(self) -> TPPlan:
        return TPPlan()

    def flops_per_token(self, seq_len: int) -> float:
        return 0.0

    def inactive_params(self) -> int:
        return 0

    def new_cache(self) -> Any:
        return None

    def qk_clip_spec(self, prefix: str) -> Optional[QKClipSpec]:
        return None

    def muon_splits(self, prefix: str, per_head: bool = False) -> Dict[str, RowSplit]:
        return {}

    def set_record_max_logits(self, enabled: bool) -> None:
        pass

    def family(self, name: str) -> str:
        """The kimi.summary family of parameter `name` (relative to this sublayer)."""
        for prefix, fam in self.FAMILY_OF.items():
            if name.startswith(prefix + "."):
                return fam
        return self.FAMILY


def hf_entries(sublayer: nn.Module, hf_prefix: str, prefix: str) -> List[Tuple[str, str, Optional[int],
                                                                              Optional[Tuple[int, ...]]]]:
    """(file tensor name, our tensor name, index into our tensor's first dim or None, the file tensor's shape
    when it differs from ours or None) for every parameter and persistent buffer of `sublayer`, from its
    HF_NAMES; prefix: the sublayer's qualified name in our model, hf_prefix: ``model.layers.<i>.``."""
    names = sublayer.HF_NAMES
    out = []
    for name, tensor in sublayer.state_dict(keep_vars=True).items():  # parameters and saved buffers
        if name not in names:
            raise ValueError(f"{type(sublayer).__name__} declares no Hugging Face name for {name}: add it to "
                             "its HF_NAMES")
        theirs = names[name]
        theirs, shape = theirs if isinstance(theirs, tuple) else (theirs, None)
        if shape is not None:
            shape = tuple(tensor.numel() if s == -1 else s for s in shape)
        if "{e}" in theirs:
            out += [(hf_prefix + theirs.format(e=e), f"{prefix}.{name}", e, shape)
                    for e in range(tensor.shape[0])]
        else:
            out.append((hf_prefix + theirs, f"{prefix}.{name}", None, shape))
    return out
