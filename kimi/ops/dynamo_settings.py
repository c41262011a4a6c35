"""torch._dynamo.config values for the calls of a compiled function.

Dynamo reads such a value only while it traces (a first call, a recompile), but which call traces is not
known beforehand, so the value is set around every call, on a hot path: each sublayer and depth mix of every
micro-batch. torch._dynamo.config.patch takes about 23 us a call on this project's CPU, this about 7.
"""

from __future__ import annotations

import sys


class dynamo_settings:  # noqa: N801 - used as a context manager, as torch's own config.patch is
    """with dynamo_settings(name=value, ...): those torch._dynamo.config values inside, the old ones after."""

    __slots__ = ("values", "old")

    def __init__(self, **values):
        self.values = values

    def __enter__(self):
        config = _config()
        self.old = {name: getattr(config, name) for name in self.values}
        for name, value in self.values.items():
            setattr(config, name, value)

    def __exit__(self, *exc):
        config = _config()
        for name, value in self.old.items():
            setattr(config, name, value)


def _config():
    # without importing dynamo into a process that never compiles (kimi.model imports this module)
    config = sys.modules.get("torch._dynamo.config")
    if config is None:
        import torch._dynamo.config as config
    return config
