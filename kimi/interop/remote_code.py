"""The Python files of an export with its own modeling code (trust_remote_code), made from our own modules.

Starting from kimi.interop.modeling_kimi and configuration_kimi, every kimi module they import, at module
level or inside a function, is copied into the export directory as one flat sibling file, with its
``from kimi.x import ...`` lines rewritten to relative imports (``from .x import ...``): transformers'
dynamic-module loader copies a modeling file's relative imports (and theirs) into its module cache, and
imports only the modeling file's absolute ones itself. So the files run with torch and transformers alone:

* the Triton kernels are left out: each import of one (always inside the function that launches it) becomes
  an ImportError naming triton, which kimi.ops.dispatch takes for a Triton failure, so with the backends at
  auto the ops run their PyTorch paths (on CPU they never ask for Triton);
* a module that imports anything else at module level (kimi.config: omegaconf, the parallel engines) is cut
  to the definitions the exported modules import from it and what those use;
* kimi.model's sublayers keep their bare names (kda.py, mla.py, ...), as kimi/model/registry.py imports
  them by name beside itself; every other kimi module is its dotted name after ``kimi.``, ``_``-joined.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import kimi

ROOTS = ("kimi.interop.modeling_kimi", "kimi.interop.configuration_kimi")
# what an exported module may import at module level besides each other
_LIBRARIES = {"torch", "transformers"} | set(sys.stdlib_module_names)
_SOURCE = Path(kimi.__file__).parent


def flat_name(module: str) -> str:
    """The file name (without .py) kimi module `module` has in an export."""
    package, _, last = module.rpartition(".")
    return last if package in ("kimi.model", "kimi.interop") else module.removeprefix("kimi.").replace(".",
                                                                                                       "_")


def _path(module: str) -> Path:
    base = _SOURCE.parent / module.replace(".", "/")
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _is_module(module: str) -> bool:
    return module.startswith("kimi") and _path(module).is_file()


def _target(module: str, node: ast.ImportFrom) -> str:
    """The absolute module a ``from ... import`` in `module` reads from."""
    if not node.level:
        return node.module or ""
    package = module if _path(module).name == "__init__.py" else module.rpartition(".")[0]
    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(parts + ([node.module] if node.module else []))


def _dropped(module: str) -> bool:
    """Modules left out of an export: the Triton kernels."""
    return ".triton" in module


def _kimi_imports(module: str, tree: ast.Module):
    """(node, the kimi module it reads, the names it takes) of every kimi import in `module`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "kimi" for a in node.names):
            raise ValueError(f"{module}: `import kimi...` cannot be made relative; write `from kimi.x "
                             "import y`")
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "kimi"):
            target = _target(module, node)
            if any(_is_module(f"{target}.{a.name}") and not _dropped(f"{target}.{a.name}")
                   for a in node.names):
                raise ValueError(f"{module}: `from {target} import <module>` cannot be made relative; import "
                                 "names from the module itself")
            yield node, target, [a.name for a in node.names]


def _registry_classes() -> dict[str, str]:
    """kimi.model module -> a class of it, for the sublayers kimi/model/registry.py imports by name (not by
    an import statement)."""
    from kimi.model.registry import MIXERS, MLPS

    refs = (ref.partition(":") for ref in (*MIXERS.values(), *MLPS.values()))
    return {f"kimi.model.{module}": name for module, _, name in refs}


def _needs_cut(tree: ast.Module) -> bool:
    """Whether a module imports, at module level, something an export does not carry."""
    top = {(a.name if isinstance(s, ast.Import) else s.module or "").split(".")[0]
           for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom)) and not getattr(s, "level", 0)
           for a in s.names}
    return bool(top - _LIBRARIES - {"kimi"})


def _source(module: str, keep: set[str]) -> str:
    """`module`'s source as an export holds it, before its imports are rewritten: whole, or cut to `keep`."""
    source = _path(module).read_text()
    tree = ast.parse(source)
    return _cut(module, source, tree, keep) if _needs_cut(tree) else source


def closure() -> dict[str, set[str]]:
    """Every kimi module an export needs -> the names the other exported modules import from it."""
    needed: dict[str, set[str]] = {module: set() for module in (*ROOTS, *_registry_classes())}
    while True:  # a cut module imports more as more of it is needed: until nothing grows
        before = {module: len(names) for module, names in needed.items()}
        for module in list(needed):
            for _, target, names in _kimi_imports(module, ast.parse(_source(module, needed[module]))):
                if not _dropped(target):
                    needed.setdefault(target, set()).update(names)
        if before == {module: len(names) for module, names in needed.items()}:
            return needed


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
    return {n.id for t in targets if t is not None for n in ast.walk(t) if isinstance(n, ast.Name)}


def _cut(module: str, source: str, tree: ast.Module, keep: set[str]) -> str:
    """`module`'s source cut to the top-level definitions of `keep` and what they use, imports included."""
    statements = [s for s in tree.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    where = {name: s for s in statements for name in _bound_names(s)}
    missing = sorted(keep - where.keys())
    if missing:
        raise ValueError(f"{module} defines no {', '.join(missing)} at module level")
    used, todo = set(), list(keep)
    while todo:
        name = todo.pop()
        if name in used or name not in where:
            continue
        used.add(name)
        todo += [n.id for n in ast.walk(where[name]) if isinstance(n, ast.Name)]
    lines = source.splitlines()
    out = []
    for s in statements:
        start = min([s.lineno, *(d.lineno for d in getattr(s, "decorator_list", ()))])
        text = "\n".join(lines[start - 1:s.end_lineno])
        if isinstance(s, ast.ImportFrom) and s.module == "__future__":
            out.append(text)
        elif isinstance(s, (ast.Import, ast.ImportFrom)):
            names = [a for a in s.names if (a.asname or a.name).split(".")[0] in used]
            if names:
                s.names = names
                out.append(ast.unparse(s))
        elif _bound_names(s) & used:
            out.append(text)
    return "\n\n".join(out) + "\n"


def _rewrite(module: str, source: str, flat: dict[str, str]) -> str:
    """`module`'s source with each kimi import relative to the export's flat files (see the module doc)."""
    tree = ast.parse(source)
    lines = source.splitlines()
    edits = []
    for node, target, names in _kimi_imports(module, tree):
        indent = " " * node.col_offset
        if _dropped(target):
            if node.col_offset == 0:
                raise ValueError(f"{module} imports {target} at module level: the Triton kernels are left "
                                 "out of an export, so import them inside the function that launches them")
            text = (f"{indent}raise ImportError('{target}: the Triton kernels are not part of this export; "
                    "the PyTorch path runs instead', name='triton')")
        else:
            aliases = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in node.names)
            text = f"{indent}from .{flat[target]} import {aliases}"
        edits.append((node.lineno, node.end_lineno, text))
    for start, end, text in sorted(edits, reverse=True):
        lines[start - 1:end] = [text]
    return "\n".join(lines) + "\n"


def write_sources(directory: Path) -> list[str]:
    """Write the export's Python files into `directory`; returns their names."""
    needed = closure()
    flat = {module: flat_name(module) for module in needed}
    if len(set(flat.values())) != len(flat):
        raise ValueError(f"two kimi modules would share a file name in an export: {sorted(flat.values())}")
    written = []
    for module in sorted(needed):
        source = _source(module, needed[module])
        text = _rewrite(module, source, flat)
        if module == ROOTS[0]:  # transformers copies only what an import statement names
            text += ("\n# kimi/model/registry.py imports these by name: named here so that transformers "
                     "copies them\n" + "".join(f"from .{flat[m]} import {name}  # noqa: F401\n"
                                        for m, name in sorted(_registry_classes().items())))
        compile(text, flat[module], "exec")
        origin = _path(module).relative_to(_SOURCE.parent)
        cut = ", cut to what the other files use" if source != _path(module).read_text() else ""
        header = f"# kimi's {origin}{cut}, its imports made relative (kimi.interop.remote_code)\n"
        (directory / f"{flat[module]}.py").write_text(header + text)
        written.append(f"{flat[module]}.py")
    return written
