"""key=value command-line arguments for the tools whose arguments are not a training config (kimi.dashboard,
kimi.wandb_offline): the style of every kimi command, whose others take Hydra overrides (training,
kimi.summary, kimi.data.prepare) or key=value of their own (kimi.generate). A list is written as Hydra
writes one, `runs=[a,b]`; a value is split from its key at the first '='."""

from __future__ import annotations

import difflib
import textwrap
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

from kimi.config import ConfigError


def parse(argv: Sequence[str], keys: Dict[str, Callable[[str], Any]], command: str) -> Dict[str, Any]:
    """{key: parsed value} of `argv`; keys maps each key to the function that parses its value. Anything
    else (a bare word, a --flag, an unknown key, a value its function refuses) is one ConfigError line."""
    out: Dict[str, Any] = {}
    known = ", ".join(keys)
    for arg in argv:
        key, eq, value = arg.partition("=")
        flag = key.lstrip("-").replace("-", "_")
        if key.startswith("-") and flag in keys:
            raise ConfigError(f"{arg}: {command} takes key=value arguments; write {flag}={value or '...'}")
        if not eq:
            first = next(iter(keys))
            raise ConfigError(f"{arg!r}: {command} takes key=value arguments ({known}), e.g. {first}={arg}")
        if key not in keys:
            close = difflib.get_close_matches(key, keys, n=1)
            guess = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(f"{key}: not an argument of {command}; {guess}its keys: {known}")
        try:
            out[key] = keys[key](value)
        except ValueError as e:
            raise ConfigError(f"{arg} is invalid: {e}") from None
    return out


def paths(text: str) -> List[Path]:
    """`[a,b]` (Hydra's list) or one path."""
    inner = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    found = [Path(p.strip()) for p in inner.split(",") if p.strip()]
    if not found:
        raise ValueError("give at least one path, e.g. [runs/a,runs/b]")
    return found


def _positive(cast: Callable[[str], Any], what: str, ok: Callable[[Any], bool]) -> Callable[[str], Any]:
    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise ValueError(f"must be {what}")
        return value
    return parse


positive_int = _positive(int, "an integer >= 1", lambda v: v >= 1)


def boolean(text: str) -> bool:
    """true/false (also 1/0, yes/no), as Hydra reads them."""
    value = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}.get(text.lower())
    if value is None:
        raise ValueError("must be true or false")
    return value


positive_float = _positive(float, "a number > 0", lambda v: v > 0)


def one_of(*choices: str) -> Callable[[str], str]:
    def pick(text: str) -> str:
        if text not in choices:
            raise ValueError(f"must be one of {', '.join(choices)}")
        return text
    return pick


def table(rows: Sequence[Tuple[str, str]], width: int = 16, line: int = 110) -> str:
    """The keys of a command's --help, as kimi.generate's lists them: two spaces, the key padded to `width`,
    its description wrapped beside it; a longer key has its description on the next line."""
    out = []
    indent = " " * (2 + width)
    for key, text in rows:
        lines = textwrap.wrap(text, line - len(indent), break_long_words=False,
                              break_on_hyphens=False) or [""]
        if len(key) + 2 > width:
            out.append(f"  {key}".rstrip())
        else:
            out.append(f"  {key:<{width}}{lines.pop(0)}".rstrip())
        out += [indent + rest for rest in lines]
    return "\n".join(out)
