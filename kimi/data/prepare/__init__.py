"""Preparing data: :func:`prepare` (kimi.data.pack) and its command, ``python -m kimi.data.prepare``
(``__main__.py``). ``kimi.data.prepare`` the package attribute is the function: kimi/data/__init__.py binds
it after this package is imported."""

from kimi.data.pack import PreparedData, prepare

__all__ = ["PreparedData", "prepare"]
