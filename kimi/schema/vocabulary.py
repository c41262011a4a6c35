"""The vocabulary every section's config and rules are written in (torch-free, imported by each owner's
config module and rules, kimi/<package>/config.py and rules.py).

Keys that take one of a fixed set of values: the installed OmegaConf (2.3) rejects typing.Literal in
structured configs ("Unexpected type annotation: Literal[...]"), and an Enum annotation would hand the code
Enum members instead of plain strings and make a bad value a composition-time ValidationError instead of a
ConfigError listing the choices. So these keys stay `str`, each declared with one_of(TUPLE, default): the
field's metadata holds its one tuple (or registry table) of allowed values, and check_choices derives the
check (and its message) from it for every such field.
"""

from __future__ import annotations

import math
from dataclasses import field, fields, is_dataclass
from typing import Any, Optional, Tuple

from kimi.errors import ConfigError

# The root config (kimi.config.Config) as the floors below kimi.config name it in annotations: they read its
# sections (cfg.model, cfg.parallel, ...), but cannot import the module that assembles them from theirs.
RootConfig = Any


def registered(entry: Any, package: str) -> type:
    """A registry table's entry (DATA_SOURCES, OPTIMIZERS): the class itself, or "module:Class" of a module
    in `package`, imported when first asked for (a registry's built-ins import the registry for its base
    class, so the table names them rather than importing them)."""
    if isinstance(entry, str):
        import importlib

        module, _, cls = entry.partition(":")
        entry = getattr(importlib.import_module(f".{module}", package), cls)
    return entry


def one_of(choices: Tuple[str, ...], default: Optional[str]) -> Any:
    """A string field taking one of `choices` (or null, when the default is null); validate() checks it."""
    return field(default=default, metadata={"choices": choices, "nullable": default is None})


def value_at(node: Any, key: str) -> Any:
    """The value of dotted `key` ("kda.num_heads") under section `node`."""
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check(ok: bool, key: str, value: Any, allowed: str) -> None:
    """A value of one key: `key=value is invalid: allowed`."""
    if not ok:
        raise ConfigError(f"{key}={value!r} is invalid: {allowed}")


def require(ok: bool, message: str) -> None:
    """A rule over several keys, with its own message (naming the keys and the fix)."""
    if not ok:
        raise ConfigError(message)


def check_choices(node: Any, prefix: str) -> None:
    """Every one_of() field of the dataclass `node` (and of the dataclasses nested in it) holds an allowed
    value; its allowed values come from the field's metadata, so no such key is left unchecked."""
    for f in fields(node):
        key, value = f"{prefix}.{f.name}", getattr(node, f.name)
        choices = f.metadata.get("choices")
        if choices is not None:
            nullable = f.metadata["nullable"]
            check(value in choices or (nullable and value is None), key, value,
                  f"choose one of {'|'.join(choices)}" + (" or null" if nullable else ""))
        elif is_dataclass(value):
            check_choices(value, key)


def check_finite(node: Any, prefix: str) -> None:
    """Every float of the dataclass `node` (and of those nested in it) is finite: OmegaConf accepts nan and
    inf for a float key, and inf passes every `> 0` rule."""
    for f in fields(node):
        key, value = f"{prefix}.{f.name}", getattr(node, f.name)
        if isinstance(value, float):
            check(math.isfinite(value), key, value, "must be a finite number")
        elif is_dataclass(value):
            check_finite(value, key)


def check_positive(node: Any, prefix: str, keys: Tuple[str, ...]) -> None:
    for key in keys:
        check(value_at(node, key) > 0, f"{prefix}.{key}", value_at(node, key), "must be a positive integer")
