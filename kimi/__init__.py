"""kimi: pretraining Kimi-style hybrid linear-attention models."""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Callable, Dict

__version__ = "0.1.0"


def lazy_getattr(package: str, where: Dict[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` (PEP 562) of a package or module of ours: each name of `where` imported from
    its module `where[name]` (a module of the package, or a full dotted name) on first use, so that importing
    one light module of the package (a torch-free config) does not import every other. The name is then set on
    the package, so later uses (`from kimi.model import KimiModel` inside a function the planner calls some
    300,000 times) find it without this call."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = where[name]
        value = getattr(import_module(module if "." in module else f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
