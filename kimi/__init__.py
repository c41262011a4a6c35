"""kimi: pretraining Kimi-style hybrid linear-attention models."""

from __future__ import annotations

from importlib import import_module
from typing import Callable, Dict

__version__ = "0.1.0"


def lazy_getattr(package: str, where: Dict[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` (PEP 562) of a package of ours: each name of `where` imported from its
    module `where[name]` on first use, so that importing one light module of the package (a torch-free
    config) does not import every other."""

    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f"{package}.{where[name]}"), name)

    return __getattr__
