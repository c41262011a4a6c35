"""Parameters a layer reads through an explicit view, so parallelism can change what the layer computes with
while the layer's code stays single-device.

On one device ``module.param(name)`` is the parameter itself. Tensor parallelism registers views with
``set_param_view``: a parameter stored whole-shaped but sharded by heads reads as this rank's local block,
and a replicated weight that a rank applies to its own heads or tokens reads through an identity whose
backward sums the gradient over the ranks. Parameter names, state dicts and optimizer routing are unchanged.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

View = Callable[[torch.Tensor], torch.Tensor]


class ParamViews:
    """Mixin for nn.Modules whose forward reads some parameters through :meth:`param`."""

    def param(self, name: str) -> Optional[torch.Tensor]:
        """The parameter `name` as this module computes with it (None stays None)."""
        p = getattr(self, name)
        view = self.__dict__.get("_param_views", {}).get(name)
        return p if view is None or p is None else view(p)

    def set_param_view(self, name: str, view: View) -> None:
        """Read parameter `name` as view(parameter) from now on."""
        self.__dict__.setdefault("_param_views", {})[name] = view
