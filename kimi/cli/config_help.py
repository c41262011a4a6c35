"""The training keys' --help (kimi-train, kimi-summary, kimi-prepare), written from the schema's source
itself: each key's description is the comment of its field in the dataclass that declares it (the section's
config beside its owner, kimi/<package>/config.py, or kimi/schema/run.py; the lines right above the field and
the one beside it), its choices the field's metadata (kimi.schema.vocabulary.one_of), its value the composed
config's. So the help cannot drift from the schema, and a key documented there is documented here."""

from __future__ import annotations

import ast
import inspect
import io
import textwrap
import tokenize
from dataclasses import MISSING, is_dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kimi.cli import keyvalue
from kimi.config import Config, schema_fields


def _comments(cls: type) -> Tuple[Dict[str, str], str]:
    """({field: its comment}, the class's docstring) from the source of dataclass `cls`."""
    text = textwrap.dedent("".join(inspect.getsourcelines(cls)[0]))
    comment: Dict[int, str] = {}
    code = set()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comment[tok.start[0]] = tok.string.lstrip("#").strip()
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                              tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    node = ast.parse(text).body[0]
    out: Dict[str, str] = {}
    for item in node.body:
        if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name):
            continue
        above, line = [], item.lineno - 1
        while line in comment and line not in code:
            above.insert(0, comment[line])
            line -= 1
        if len(above) == 1 and len(above[0].split()) <= 2 and ":" not in above[0]:
            above = []  # a heading over several fields ("# KDA"), not this field's description
        beside = [comment[n] for n in range(item.lineno, item.end_lineno + 1) if n in comment and n in code]
        out[item.target.id] = " ".join(above + beside)
    return out, ast.get_docstring(node) or ""


def sections(schema: type = Config, prefix: str = "") -> List[Tuple[str, str, List[Tuple[str, Any, str]]]]:
    """[(section, its docstring, [(dotted key, field, description)])] of the schema, nested sections after
    their parent's own keys."""
    docs, doc = _comments(schema)
    own, nested = [], []
    instance = schema()
    for f in schema_fields(schema):  # not the model section's old flat keys, read for now
        key = prefix + f.name
        if is_dataclass(getattr(instance, f.name)):
            nested += sections(type(getattr(instance, f.name)), key + ".")
        else:
            own.append((key, f, docs.get(f.name, "")))
    return ([(prefix.rstrip("."), doc, own)] if own else []) + nested


def _show(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_show(v) for v in value) + "]"
    return "''" if value == "" else str(value)


def _value(values: Optional[Dict[str, Any]], key: str, f) -> Any:
    """The key's value in the composed config, else the schema's default."""
    node: Any = values
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return f.default if f.default is not MISSING else f.default_factory()
        node = node[part]
    return node


def keys_help(values: Optional[Dict[str, Any]], only: Sequence[str] = ()) -> str:
    """The keys of the sections named in `only` (all when empty) as a key=value table; values: the composed
    config as nested dicts (what each key is now), None for the schema's defaults."""
    # data.source, optim.name, parallel.engine and trainer.precision list the choices of their sections'
    # tables, which their registries fill when imported: the command imports those of its sections (a
    # registry lies above this package)
    blocks = []
    for section, doc, rows in sections():
        if only and section.split(".")[0] not in only:
            continue
        table = []
        for key, f, text in rows:
            value = _value(values, key, f)
            choices = f.metadata.get("choices")
            extra = f"one of {'|'.join(choices)}; " if choices else ""
            table.append((key, f"{text} ({extra}now {_show(value)})".lstrip()))
        head = f"{section}:" + (f" {' '.join(doc.split())}" if doc else "")
        blocks.append("\n".join(textwrap.wrap(head, 110, subsequent_indent="  ")) + "\n"
                      + keyvalue.table(table, width=28))
    return "\n\n".join(blocks)


def presets() -> str:
    """The preset groups of conf/ (model=small, ...), each with its choices."""
    from kimi.cli.conf_dir import conf_dir

    lines = []
    for group in sorted(p for p in conf_dir().iterdir() if p.is_dir() and not p.name.startswith("_")):
        names = sorted(f.stem for f in group.glob("*.yaml"))
        if names and group.name != "ablate":  # conf/ablate/: the studies' arms, read by +experiment=
            prefix = "+" if group.name == "experiment" else ""
            lines.append((f"{prefix}{group.name}=", " | ".join(names)))
    return keyvalue.table(lines, width=14)


def composed(argv: Sequence[str]) -> Optional[Dict[str, Any]]:
    """The config these overrides compose to, as nested dicts (unresolved); None when they do not compose
    (the help still prints, with the schema's defaults)."""
    from omegaconf import OmegaConf

    from kimi.cli.conf_dir import compose

    try:
        return OmegaConf.to_container(compose([a for a in argv if not a.startswith(("-", "hydra."))]),
                                      resolve=False)
    except Exception:  # noqa: BLE001 (a bad override is reported when the command runs, not in its help)
        return None


def config_help(usage: str, argv: Sequence[str] = (), only: Sequence[str] = ()) -> str:
    """The --help of a command that takes the training config's overrides: usage, the presets, the keys."""
    return (f"{usage.strip()}\n\nPresets (a YAML file of conf/<group>/ each):\n{presets()}\n\n"
            "Keys (key=value, e.g. trainer.max_steps=300; described by their comments in the schema, "
            "kimi/<package>/config.py), "
            f"with the values\nthese overrides give:\n\n{keys_help(composed(argv), only)}")
