"""The package's shape: no import cycles, libraries below applications, the engine seam a type, a short
trainer, the root config above the sections it assembles.

Imports are read with ast from every module of kimi/, those inside functions (lazy ones) and under
TYPE_CHECKING too, relative ones resolved; ``from pkg import name`` counts as an import of the submodule
pkg.name when there is one, else of pkg itself (its __init__.py).
"""

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
KIMI = ROOT / "kimi"
# The command-line applications: modules below them (the libraries) never import them.
APPS = ("kimi.generate", "kimi.ablate", "kimi.dashboard", "kimi.convert", "kimi.summary", "kimi.train",
        "kimi.eval.cli", "kimi.eval.__main__", "kimi.plan")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(KIMI.rglob("*.py"))}


def _resolve(name: str) -> str | None:
    """The kimi module `name` is, or lies in (a class or function of it); None outside kimi."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(name: str, path: Path) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_resolve(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else _resolve(base))
    return {m for m in found if m is not None and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycle() -> list[str] | None:
    """One import cycle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in GRAPH:
        if start in state:
            continue
        path, stack = [start], [iter(sorted(GRAPH[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(GRAPH[nxt])))
    return None


def _is_app(name: str) -> bool:
    return any(name == app or name.startswith(app + ".") for app in APPS)


def test_the_graph_is_read():
    assert "kimi.parallel.engine_rules" in GRAPH["kimi.parallel.build"]  # relative, module level
    assert "kimi.cli.conf_dir" in GRAPH["kimi.cli"]  # inside a function
    assert "kimi.data.loader" in GRAPH["kimi.data.rank_batches"]  # absolute, a name of the module


def test_no_import_cycles():
    cycle = _cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_libraries_import_no_application():
    wrong = [f"{lib} imports {m}" for lib, deps in GRAPH.items() if not _is_app(lib) for m in sorted(deps)
             if _is_app(m)]
    assert not wrong, "; ".join(wrong)


def _room(module: str) -> str:
    """The package (or root module) directly under kimi/ that `module` lies in: a room of the house."""
    return ".".join(module.split(".")[:2])


def _is_command(name: str) -> bool:
    """A command's entry point (`python -m kimi.data.prepare`): it stands on top of the house, whichever
    room its file is in, as it composes the whole config (kimi.config, kimi.cli) to run its package's work."""
    return name.rpartition(".")[2] == "__main__"


def _room_cycle() -> list[str] | None:
    """Rooms that import each other around a loop (a cycle of the graph with each package as one node); a
    command's entry point is no part of its room."""
    rooms: dict[str, set[str]] = {}
    for name, deps in GRAPH.items():
        if _is_command(name):
            continue
        rooms.setdefault(_room(name), set()).update(_room(d) for d in deps if _room(d) != _room(name))
    done: set[str] = set()

    def visit(room: str, path: list[str]) -> list[str] | None:
        if room in path:
            return path[path.index(room):] + [room]
        if room in done:
            return None
        for nxt in sorted(rooms.get(room, ())):
            if found := visit(nxt, path + [room]):
                return found
        done.add(room)
        return None

    return next((c for r in sorted(rooms) if (c := visit(r, []))), None)


def test_packages_import_each_other_in_one_direction():
    """Floors: no package imports one that imports it back, through any chain, so the house has a ground
    floor (errors, config), floors above it and no arrow running back up."""
    cycle = _room_cycle()
    assert cycle is None, "packages import each other around: " + " -> ".join(cycle)


ROOT_MODULES_MAX = 10


def test_the_package_root_holds_few_modules():
    """The root holds the commands and the ground floor; a helper lives in the package of its concern."""
    root = sorted(p.name for p in KIMI.glob("*.py") if p.name != "__init__.py")
    assert len(root) <= ROOT_MODULES_MAX, f"{len(root)} modules at kimi/'s root: {', '.join(root)}"


# The root config assembles the sections, each defined beside its owner; the floors below it are the packages
# of those owner modules and whatever they import, reached through the room graph. Also these libraries, which
# kimi.config does not reach, take their sections from the owners rather than from the assembled root.
CONFIG_MAX_LINES = 300
SECTION_OWNERS = {"kimi.model.config", "kimi.data.config", "kimi.optim.config", "kimi.parallel.config",
                  "kimi.precision.config", "kimi.schema.run", "kimi.schema.vocabulary"}
LIBRARIES_OFF_THE_ROOT = ("kimi.ops", "kimi.checkpoint", "kimi.diagnostics", "kimi.interop")


def _rooms_below(start: str) -> set[str]:
    """The rooms `start` imports, directly or through others (commands' entry points left out)."""
    found, todo = set(), [start]
    while todo:
        room = todo.pop()
        for name, deps in GRAPH.items():
            if _room(name) == room and not _is_command(name):
                for dep in deps:
                    if _room(dep) not in found and _room(dep) != start:
                        found.add(_room(dep))
                        todo.append(_room(dep))
    return found


def test_the_config_is_imported_by_nothing_below_it():
    assert SECTION_OWNERS <= GRAPH["kimi.config"], "kimi.config assembles the sections from their owners"
    below = _rooms_below("kimi.config")
    assert {"kimi.model", "kimi.data", "kimi.optim", "kimi.parallel", "kimi.precision", "kimi.schema",
            "kimi.ops", "kimi.errors"} <= below, sorted(below)
    wrong = [name for name, deps in GRAPH.items() if "kimi.config" in deps and not _is_command(name)
             and (_room(name) in below or _room(name) in LIBRARIES_OFF_THE_ROOT)]
    assert not wrong, ("import the section's config from its owner (kimi/<package>/config.py, kimi/schema/), "
                       "not from kimi.config, which lies above their floor: " + ", ".join(sorted(wrong)))


def test_the_config_root_stays_short():
    lines = len((KIMI / "config.py").read_text().splitlines())
    assert lines < CONFIG_MAX_LINES, (f"kimi/config.py has {lines} lines: a section's schema and rules "
                                      "belong beside the code that owns it")


@pytest.mark.parametrize("module", ["kimi.config", *sorted(SECTION_OWNERS)])
def test_the_config_imports_no_torch(module):
    """train.py refuses a misspelt key before the seconds of importing torch: the root config and each
    section's config import none (the packages holding them import their heavy modules on first use)."""
    import subprocess
    import sys

    code = f"import sys, {module}; assert 'torch' not in sys.modules, [m for m in sys.modules if 'kimi' in m]"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


# A function that takes the trainer reaches into all of it; library code takes explicit arguments (torchft's
# replica groups too: an Engine that build_engine wraps around the chosen one, given the run's step and data
# position through RunState).


def _takes_trainer(tree: ast.AST) -> list[int]:
    """Lines of functions with a parameter named trainer or annotated with Trainer."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs]:
                note = ast.unparse(arg.annotation) if arg.annotation else ""
                if arg.arg == "trainer" or "Trainer" in note.replace("TrainerConfig", ""):
                    found.append(node.lineno)
    return found


def test_no_function_outside_the_trainer_takes_the_trainer():
    assert _takes_trainer(ast.parse("def f(x, trainer): pass\ndef g(t: 'Trainer'): pass\n"
                                    "def h(t: TrainerConfig): pass")) == [1, 2]
    hits = [f"{path.relative_to(ROOT)}:{n}" for name, path in MODULES.items()
            if name != "kimi.trainer"
            for n in _takes_trainer(ast.parse(path.read_text(), str(path)))]
    assert not hits, "pass what the function needs, not the trainer:\n" + "\n".join(hits)


def _outside_parallel(pattern: str) -> list[str]:
    hits = []
    for name, path in MODULES.items():
        if name == "kimi.parallel" or name.startswith("kimi.parallel."):
            continue
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(pattern, line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    return hits


def test_engines_are_named_only_in_kimi_parallel():
    hits = _outside_parallel(r'"deepspeed"')
    assert not hits, ("compare engines through kimi.parallel (engine_rules, interface.Engine):\n"
                      + "\n".join(hits))


def test_no_engine_probing_outside_kimi_parallel():
    hits = _outside_parallel(r"getattr\((self\.)?engine\b")
    assert not hits, "call what kimi.parallel.interface.Engine declares:\n" + "\n".join(hits)


def test_export_layouts_are_compared_only_in_their_registry():
    registry = KIMI / "interop" / "layouts.py"
    pattern = re.compile(r"""\blayout\w*\s*(?:[!=]=|(?:not\s+)?in\s*[(\[{])\s*[rbfu]?["']""")
    hits = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in MODULES.values() if path != registry
            for n, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not hits, "ask kimi.interop.layouts' Layout (a new layout is a class there):\n" + "\n".join(hits)


def _source_comparisons(tree: ast.AST) -> list[int]:
    """Lines comparing a ``.source`` attribute with a string literal (or a tuple/list/set of them)."""
    def literal(node: ast.AST) -> bool:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(literal(e) for e in node.elts)
        return isinstance(node, ast.Constant) and isinstance(node.value, str)

    def compares(node: ast.Compare) -> bool:
        sides = [node.left, *node.comparators]
        attribute = any(isinstance(o, ast.Attribute) and o.attr == "source" for o in sides)
        return attribute and any(map(literal, sides))

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare) and compares(node)]


def test_data_sources_are_compared_only_in_their_registry():
    chain = 'if cfg.source == "hf":\n    x = d.source in ("hf", "files")'
    assert _source_comparisons(ast.parse(chain)) == [1, 2]
    registry = KIMI / "data" / "source_registry.py"
    hits = [f"{path.relative_to(ROOT)}:{n}" for path in MODULES.values() if path != registry
            for n in _source_comparisons(ast.parse(path.read_text(), str(path)))]
    assert not hits, ("ask kimi.data.source_registry's DataSource (a new source is a class there):\n"
                      + "\n".join(hits))


def _name_comparisons(tree: ast.AST, names: set[str]) -> list[int]:
    """Lines comparing anything with a string literal in `names` (or a tuple/list/set holding one)."""
    def literals(node: ast.AST) -> list[str]:
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [v for e in node.elts for v in literals(e)]
        return [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []

    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Compare)
            and names & {v for side in (node.left, *node.comparators) for v in literals(side)}]


def test_optimizers_and_precisions_are_compared_only_in_their_registries():
    from kimi.optim.optimizers import MuonClipKind
    from kimi.optim.registry import OPTIMIZERS
    from kimi.precision.registry import PRECISIONS

    names = set(OPTIMIZERS) | set(PRECISIONS)
    chain = 'if cfg.optim.name == "muonclip":\n    x = t.precision in ("fp8", "mxfp8")\ny = o.name != "x"'
    assert _name_comparisons(ast.parse(chain), names) == [1, 2]
    registries = {KIMI / "optim" / "registry.py", KIMI / "optim" / "optimizers.py",
                  KIMI / "precision" / "registry.py"}
    # MuonClip's own module compares its families ("muon", "adamw"): routing, not optimizer names
    own = {KIMI / "optim" / "muonclip.py": names - set(MuonClipKind.FAMILIES)}
    hits = [f"{path.relative_to(ROOT)}:{n}" for path in MODULES.values() if path not in registries
            for n in _name_comparisons(ast.parse(path.read_text(), str(path)), own.get(path, names))]
    assert not hits, ("ask kimi.optim.registry's OptimizerKind or kimi.precision.registry's Precision (a new "
                      "optimizer or precision is a class there):\n" + "\n".join(hits))


def test_test_modules_live_in_area_folders_and_import_no_other_folders_tests():
    """Test modules are in tests/<area>/ (docs/testing.md); one that imports a test module of another folder
    passes or fails by which modules the xdist worker happened to import before it."""
    tests = ROOT / "tests"
    assert not sorted(p.name for p in tests.glob("test_*.py")), "put test modules in a folder of tests/"
    where = {p.stem: p.parent for p in tests.glob("*/test_*.py")}
    assert len(where) == len(list(tests.glob("*/test_*.py"))), "two test modules share a name"
    wrong = []
    for name, folder in where.items():
        tree = ast.parse((folder / f"{name}.py").read_text())
        for node in ast.walk(tree):
            imported = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module] if isinstance(node, ast.ImportFrom) and node.module else [])
            wrong += [f"{folder.name}/{name}.py imports {m} ({where[m].name}/)" for m in imported
                      if m in where and where[m] != folder]
    workers = [p for p in tests.glob("*.py")
               if any(re.search(rf"^\s*(from|import) {m}\b", line) for line in p.read_text().splitlines()
                      for m in where)]
    assert not wrong and not workers, ("move what is shared into a module of tests/ (helpers.py, a "
                                       "*_problem.py):\n" + "\n".join(wrong + [str(p) for p in workers]))


# The model section's old flat keys (kimi/model/sections.py ALIASES) still read for one release; tests write
# the section keys, so that removing the aliases changes no test. Only the tests of the aliases use them.
ALIAS_TESTS = {"config/test_config.py::test_the_old_flat_model_keys_still_read_with_one_line",
               "project/test_structure.py::test_tests_write_the_model_sections_keys"}
CONFIG_CALLS = ("ModelConfig", "tiny_model_cfg", "replace", "preset")


def _old_model_keys(tree: ast.AST, aliases: dict) -> list[tuple[str, int, str]]:
    """(top-level function or class, line, old key) of each old flat key passed as a keyword to a call named
    in CONFIG_CALLS, or written in a string as an override (model.<old key>=); a section's own copy,
    replace(cfg.mla, q_lora_rank=8), passes its own keys."""
    sections = {new.partition(".")[0] for new in aliases.values()}
    override = re.compile(rf"\bmodel\.({'|'.join(aliases)})=")
    hits = []
    for top in tree.body:
        owner = getattr(top, "name", "")
        for node in ast.walk(top):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                own = (name == "replace" and node.args and isinstance(node.args[0], ast.Attribute)
                       and node.args[0].attr in sections)
                if name in CONFIG_CALLS and not own:
                    hits += [(owner, k.lineno, k.arg) for k in node.keywords if k.arg in aliases]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                hits += [(owner, node.lineno, old) for old in override.findall(node.value)]
    return hits


def test_tests_write_the_model_sections_keys():
    from kimi.model.sections import ALIASES

    sample = ("cfg = tiny_model_cfg(kda_num_heads=2, d_model=8)\n"
              "def test_a():\n"
              "    dataclasses.replace(cfg, moe_num_experts=4, mla=replace(cfg.mla, q_lora_rank=8))\n"
              "    run(['model.mlp_hidden=64', 'model.mlp.hidden=64'])\n"
              "    ModelConfig(mla=dict(q_lora_rank=8), moe=MoeConfig(num_experts=4))\n")
    assert _old_model_keys(ast.parse(sample), ALIASES) == [
        ("", 1, "kda_num_heads"), ("test_a", 3, "moe_num_experts"), ("test_a", 4, "mlp_hidden")]
    tests = ROOT / "tests"
    hits = [f"{path.relative_to(tests)}:{line}: {old} -> {ALIASES[old]}"
            for path in sorted(tests.rglob("*.py"))
            for owner, line, old in _old_model_keys(ast.parse(path.read_text(), str(path)), ALIASES)
            if f"{path.relative_to(tests)}::{owner}" not in ALIAS_TESTS]
    assert not hits, ("write the model section's keys (the old flat ones go in a later release), e.g. "
                      "tiny_model_cfg(kda=dict(num_heads=2)), model.kda.num_heads=2, "
                      "dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, num_experts=4)):\n"
                      + "\n".join(hits))
