"""The training commands' --help (kimi.cli.config_help): every key of the schema, described by its own comment
in the section's config beside its owner (kimi/<package>/config.py, kimi/schema/run.py), with its choices and
the value the overrides give."""

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


# a key of each section and words of the comment above or beside its field, in the module that declares it
OWNED = [("model.kda.head_dim", "kimi/model/config.py", "dk = dv"),
         ("data.shard_mb", "kimi/data/config.py", "size of one token shard"),
         ("optim.ns_steps", "kimi/optim/config.py", "Newton-Schulz iterations"),
         ("parallel.ep", "kimi/parallel/config.py", "expert parallelism: the routed experts"),
         ("precision.keep_end_blocks", "kimi/precision/config.py", "blocks at each end of the model"),
         ("trainer.eval_every", "kimi/schema/run.py", "0 disables periodic validation")]


@pytest.mark.parametrize("key, where, words", OWNED)
def test_a_key_is_described_by_its_comment_beside_the_owner(key, where, words):
    import inspect
    from pathlib import Path

    section = getattr(Config(), key.split(".")[0])
    assert Path(inspect.getsourcefile(type(section))).as_posix().endswith(where)
    rows = keys_help(None, only=[key.split(".")[0]]).replace("\n" + " " * 30, " ").splitlines()
    row = next(r for r in rows if r.split()[:1] == [key])
    assert words in row, row

