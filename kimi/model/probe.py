"""What a layer shows a diagnostic pass (kimi/diagnostics): values its forward computes but no module returns.

KDA reports its per-channel log decay g and beta, MLA its per-head max scaled logits, a MoE layer its
experts' choices, each through ``if PROBE.on: PROBE.record(self, name=value, ...)``. Only a diagnostic pass
turns the flag on (and says where the values go); with it off a forward runs exactly the ops it ran
without the probe, so training numerics do not depend on it. One module-level object, so torch.compile
guards on one boolean (one graph per value) and never breaks the graph while it is off; ``record`` itself
runs eagerly.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

Sink = Callable[..., None]  # sink(module, **values)


class Probe:
    def __init__(self) -> None:
        self.on = False
        self._sink: Sink | None = None

    def start(self, sink: Sink) -> None:
        if self.on:
            raise RuntimeError("a diagnostic pass is already recording")
        self._sink, self.on = sink, True

    def stop(self) -> None:
        self._sink, self.on = None, False

    @torch.compiler.disable
    def record(self, module: nn.Module, **values: torch.Tensor) -> None:
        self._sink(module, **{k: v.detach() for k, v in values.items()})


PROBE = Probe()
