"""pyproject.toml's dependencies: each floor is the one recorded here with its reason, the environment running
the suite meets them, and every third-party module the package imports is a dependency, an extra's, or named
below as optional with the reason.

How the floors were checked (they cannot be in the suite: CI reaches no package index): the tests named in
each reason ran in a virtual environment holding the floor release over this venv's packages (a .pth file,
as tests/project/test_install.py builds one), on 2026-12-02. Where a floor release cannot run beside this
venv's other packages (pyarrow 15, numpy 1.26 and matplotlib 3.8 against numpy 2 builds; torch is the venv
itself), the reason says what sets it instead."""

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

try:
    import tomllib
except ImportError:  # Python 3.10: pip's copy of the same parser
    from pip._vendor import tomli as tomllib

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

FLOORS = {
    "torch": ("2.9", "the release the code was first written against (FSDP2's fully_shard, DTensor, "
                     "pipelining schedules, torch._grouped_mm where present); older releases never ran; the "
                     "suite runs the Makefile's pin, 2.13"),
    "triton": ("3.4", "the Triton that torch 2.9 ships with (the kernels' language features)"),
    "hydra-core": ("1.3", "version_base='1.3' in every compose and hydra.main; test_config and test_summary "
                          "pass with hydra-core 1.3.0"),
    "omegaconf": ("2.3", "hydra-core 1.3's own floor; test_config and test_summary pass with omegaconf "
                         "2.3.0"),
    "pyyaml": ("5.1", "imported by kimi.run.runlog (config.yaml through its C emitter); omegaconf 2.3's own "
                      "floor, which sets it (yaml.dump's sort_keys, which config_yaml passes, came in 5.1); "
                      "not run with 5.1 here"),
    "wandb": ("0.18", "test_wandb_runs passes with wandb 0.18.0 (offline runs, define_metric's tokens axis, "
                      "checkpoint artifacts staged offline; the record reader's protobuf types)"),
    "datasets": ("3.0", "test_data, test_bad_data and test_blend pass with datasets 3.0.0 (text/json/parquet "
                        "loading, sample_by=document, Arrow batches); 4.x is not needed"),
    "pyarrow": ("15.0", "imported by kimi.data (pyarrow.compute); datasets 3.0's own floor, which sets it: "
                        "pyarrow 15 predates numpy 2 and cannot run beside this venv's numpy"),
    "huggingface-hub": ("0.22", "imported by kimi.data.sources (its offline switch); datasets 3.0's own "
                                "floor; test_data and test_bad_data pass with huggingface-hub 0.22.0"),
    "tokenizers": ("0.20", "a tokenizer.json as data.tokenizer (kimi.data.hf_tokenizer), which no other "
                           "dependency brings; test_data's and test_blend's tokenizer tests pass with "
                           "0.20.0"),
    "sentencepiece": ("0.2", "the default tokenizer; test_data passes with sentencepiece 0.2.0"),
    "tiktoken": ("0.7", "Kimi's released BPE files (kimi.data.tiktoken_bpe); test_tiktoken passes with 0.7.0 "
                        "(its comparison against transformers aside)"),
    "numpy": ("1.26", "the first numpy with wheels for every Python this package supports (3.10-3.12); "
                      "numpy 1 cannot run beside this venv's numpy-2 builds"),
    "matplotlib": ("3.8", "the first matplotlib built for numpy 1.26 and Python 3.12; likewise not runnable "
                          "here"),
    "safetensors": ("0.4", "kimi.convert's safe_open on a Path and save_file with metadata: checked with "
                           "0.4.0 (to-hf's tests compare against transformers, which needs a newer "
                           "safetensors)"),
}

# The prep extra (data.prepare_executor): its floor and reason, checked as FLOORS'. datatrove brings loguru
# and humanize beyond what datasets already installs (dill, multiprocess, fsspec, tqdm, huggingface-hub,
# numpy).
PREP_FLOORS = {
    "datatrove": ("0.10", "LocalPipelineExecutor (tasks, workers, start_method, logging_dir with "
                          "completions/) and SlurmPipelineExecutor (depends, venv_path) as "
                          "kimi/data/prepare/executor.py calls them; test_prepare_workers passes with "
                          "datatrove 0.10.0 (checked 2026-12-04)"),
}


def test_the_prep_extra_has_its_floor_and_reason_and_is_met():
    reqs = {canonicalize_name(r.name): r for r in map(Requirement, PROJECT["optional-dependencies"]["prep"])}
    assert set(reqs) == set(PREP_FLOORS), "add the new prep dependency's floor and reason to PREP_FLOORS"
    for name, req in reqs.items():
        assert [s.version for s in req.specifier if s.operator == ">="] == [PREP_FLOORS[name][0]], str(req)
        installed = Version(importlib.metadata.version(req.name))  # the dev extra installs it
        assert req.specifier.contains(Version(installed.public), prereleases=True), f"{req}: {installed}"


# The tensorboard extra (logging.tensorboard): its floor and reason, checked as FLOORS'.
TENSORBOARD_FLOORS = {
    "tensorboard": ("2.18", "torch.utils.tensorboard's SummaryWriter with purge_step, read back by "
                            "tensorboard's EventAccumulator: test_live_metrics's TensorBoard tests pass with "
                            "2.18.0; 2.17.0 and 2.14.0 fail beside numpy 2 (np.string_); checked 2026-12-04"),
}


def test_the_tensorboard_extra_has_its_floor_and_reason_and_is_met():
    extras = PROJECT["optional-dependencies"]
    reqs = {canonicalize_name(r.name): r for r in map(Requirement, extras["tensorboard"])}
    assert set(reqs) == set(TENSORBOARD_FLOORS), "add the dependency's floor and reason to TENSORBOARD_FLOORS"
    dev = {canonicalize_name(r.name): r for r in map(Requirement, extras["dev"])}
    for name, req in reqs.items():
        floors = [s.version for s in req.specifier if s.operator == ">="]
        assert floors == [TENSORBOARD_FLOORS[name][0]], str(req)
        assert name in dev and str(dev[name].specifier) == str(req.specifier), "the dev extra has it alike"
        installed = Version(importlib.metadata.version(req.name))
        assert req.specifier.contains(Version(installed.public), prereleases=True), f"{req}: {installed}"


# Imported by the package but neither a dependency nor an extra's (the dev list does not count: it is the
# tests'), each with why a plain install may lack it.
OPTIONAL = {
    "transformers": "kimi.convert to-hf's tokenizer files (kimi/interop/tokenizer_files.py) and kimi.eval's "
                    "hf= check use transformers' own converters, and the modeling files to-hf writes run "
                    "under transformers; it comes with the eval extra (lm-eval[hf]), not with a plain "
                    "install",
    "zstandard": "only for a .zst data file (kimi.data.files), which datasets itself reads only with it",
    "fla-core": "only for model.kda.backend=fla (kimi/ops/kda/fla.py, CUDA): fla-core's KDA kernels, refused "
                "in one line without the package; the dev extra has it for the comparisons",
}


def _requirements(extras: bool = False) -> list[Requirement]:
    reqs = [Requirement(r) for r in PROJECT["dependencies"]]
    if extras:
        reqs += [Requirement(r) for name, rs in PROJECT["optional-dependencies"].items() if name != "dev"
                 for r in rs]
    return reqs


def test_every_dependency_has_its_floor_and_reason():
    declared = {canonicalize_name(r.name): r for r in _requirements()}
    assert set(declared) == set(FLOORS), ("add the new dependency's floor and its reason to FLOORS "
                                          "(or drop it)")
    for name, req in declared.items():
        floors = [s.version for s in req.specifier if s.operator == ">="]
        assert floors == [FLOORS[name][0]], f"{req}: the floor FLOORS records for {name} is {FLOORS[name][0]}"


def test_the_environment_meets_the_floors():
    for req in _requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        installed = Version(importlib.metadata.version(req.name))
        # a local build tag (torch's +cpu) is the same release
        assert req.specifier.contains(Version(installed.public), prereleases=True), (
            f"{req}: {installed} installed")


def _imported_modules() -> dict[str, str]:
    """{top-level third-party module: a file of kimi/ importing it}."""
    found = {}
    for path in sorted((ROOT / "kimi").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - {"kimi", "__future__"}:
                if top not in sys.stdlib_module_names:
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def test_every_imported_module_is_declared():
    declared = {canonicalize_name(r.name) for r in _requirements(extras=True)}
    by_module = importlib.metadata.packages_distributions()
    missing = []
    for module, where in _imported_modules().items():
        names = {canonicalize_name(d) for d in by_module.get(module, [module])}
        if not names & (declared | set(OPTIONAL)):
            missing.append(f"{module} ({where})")
    assert not missing, ("imported by the package but not a dependency, an extra's or OPTIONAL's: "
                         + ", ".join(missing))
