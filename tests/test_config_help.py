"""The training commands' --help (kimi.cli.config_help): every key of the schema, described by its own comment
in kimi/config.py, with its choices and the value the overrides give."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from kimi.config import Config, _schema_keys, one_of
import kimi.optim.registry  # noqa: F401 (fills optim.name's choices, as the commands import it)
from kimi.cli.config_help import _comments, composed, keys_help

pytestmark = pytest.mark.unit


@dataclass
class Example:
    """An example section."""

    # KDA
    plain: int = 1
    # the first line of a comment above,
    # and its second
    both: int = 2  # and one beside
    beside: str = one_of(("x", "y"), "x")  # one of two


def test_a_field_is_described_by_its_comments_above_and_beside():
    docs, doc = _comments(Example)
    assert doc == "An example section."
    assert docs == {"plain": "", "both": "the first line of a comment above, and its second and one beside",
                    "beside": "one of two"}


def test_every_key_is_listed_with_the_value_the_overrides_give():
    text = keys_help(composed(["model=small", "trainer.max_steps=7"]))
    listed = {line.split()[0] for line in text.splitlines() if line[:2] == "  " and line[2:3] != " "}
    every = _schema_keys(Config)
    leaves = {k for k in every if not any(other.startswith(k + ".") for other in every)}
    assert leaves - listed == set()
    rows = text.replace("\n" + " " * 30, " ").splitlines()  # each key's row on one line
    assert any(r.split()[:1] == ["trainer.max_steps"] and r.endswith("(now 7)") for r in rows), text
    small = composed(["model=small"])["model"]["d_model"]
    assert any(r.split()[:1] == ["model.d_model"] and r.endswith(f"(now {small})") for r in rows)
    assert any(r.split()[:1] == ["optim.name"] and "one of adamw|muonclip;" in r for r in rows)
