"""Optimizers by their optim.name: adding one is a class following :class:`OptimizerKind` and one line in
``OPTIMIZERS``, whose names are optim.name's allowed values (kimi.optim.config.OPTIMIZERS).

An entry is ``module:Class`` inside kimi.optim, imported when first asked for (the built-in optimizers live in
kimi/optim/optimizers.py, which imports this module for the base class), or the class itself. Callers ask
:func:`optimizer_for` for the configured optimizer and never compare optim.name with a name.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Dict, Optional, Tuple, Union

from kimi.optim.config import OPTIMIZERS as _TABLE
from kimi.optim.config import OptimConfig
from kimi.schema.vocabulary import check, registered

# The table is kimi.optim.config.OPTIMIZERS itself, the values validate() allows for optim.name: the config
# is imported first and cannot import this module, so the entries are made here.
OPTIMIZERS: Dict[str, Union[str, type]] = _TABLE
OPTIMIZERS.update({
    "adamw": "optimizers:AdamWKind",
    "muonclip": "optimizers:MuonClipKind",
})


@dataclass(frozen=True)
class StateModel:
    """What an optimizer keeps for each parameter of one of its families: `tensors` fp32 tensors of the
    parameter's shape (kimi.summary's memory per rank, the size check's lower bound)."""

    title: str  # the family in kimi.summary's rows ("Muon", "AdamW")
    state: str  # what the tensors are ("momentum", "moments")
    tensors: int

    @property
    def bytes_per_param(self) -> int:
        return 4 * self.tensors


class OptimizerKind(ABC):
    """One kind of optim.name, built from the optim config. A subclass sets ``FAMILIES`` and defines
    ``build``; ``family`` has a default:

      FAMILIES              each family of update rule by its name, with its state model, in routing order.
                            The names are the metrics' (optim/grad_norm/<family>, optim/update_rms/<family>);
                            an optimizer of several families tags each of its param groups with "family".
      build(model, named, process_group, fragments)
                            the torch optimizer over the (name, tensor) pairs `named` (kimi.optim's
                            build_optimizer documents the arguments)
      family(name, param)   which family updates this parameter (default: the only one); `param` may be on
                            the meta device
    """

    FAMILIES: ClassVar[Dict[str, StateModel]] = {}

    def __init__(self, cfg: OptimConfig):
        self.cfg = cfg

    @abstractmethod  # an optimizer kind without it cannot be built
    def build(self, model: Any, named: list, process_group: Any = None, fragments: Any = None) -> Any:
        """The torch optimizer over `named` (kimi.optim's build_optimizer documents the arguments)."""

    def family(self, name: str, param: Any) -> str:
        if len(self.FAMILIES) != 1:
            raise NotImplementedError(f"optim.name={self.cfg.name} has several families: define family()")
        return next(iter(self.FAMILIES))

    def min_state_bytes(self) -> int:
        """The fewest optimizer-state bytes any parameter keeps (the size check's lower bound)."""
        return min(m.bytes_per_param for m in self.FAMILIES.values())


def optimizer_class(name: str) -> type:
    check(name in OPTIMIZERS, "optim.name", name, f"choose one of {'|'.join(OPTIMIZERS)}")
    entry = registered(OPTIMIZERS[name], __package__)
    if not entry.FAMILIES:  # memory estimates read it: an optimizer is never costed by a guess
        raise TypeError(f"optim.name={name}: {entry.__name__} declares no FAMILIES (its state model)")
    return entry


def optimizer_for(cfg: OptimConfig) -> OptimizerKind:
    """The configured optimizer (optim.name's class, built from ``cfg``)."""
    return optimizer_class(cfg.name)(cfg)


# The families of each optimizer build_optimizer made, for the per-family statistics
# (kimi/parallel/family_stats.py), which see only the torch optimizer.
_BUILT: "weakref.WeakKeyDictionary[Any, Tuple[str, ...]]" = weakref.WeakKeyDictionary()


def built(optimizer: Any, kind: OptimizerKind) -> Any:
    """`optimizer`, which `kind` built, with its families remembered (kimi.optim.build_optimizer)."""
    _BUILT[optimizer] = tuple(kind.FAMILIES)
    return optimizer


def families_of(optimizer: Any) -> Optional[Tuple[str, ...]]:
    """The families of an optimizer kimi.optim.build_optimizer made (None for any other)."""
    return _BUILT.get(optimizer)
