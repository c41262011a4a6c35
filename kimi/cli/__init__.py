"""How commands start and end: Hydra overrides checked before Hydra reports them, key=value commands'
--help, and one line (no traceback) with its exit code for every known problem (the codes and error types
are kimi.errors').

torchrun turns any non-zero exit of a rank into its own failure (exit 1, after killing the other ranks), so
under torchrun a stopped run's ranks exit 0 and rank 0 records the code in ``<run_dir>/exit_code``, which
launch/torchrun.sh and launch/slurm.sbatch exit with. A single process exits with the code itself. The same
holds for a FinalError (exit code 1 in the file): with --max-restarts, torchrun restarts a rank that exits
non-zero, and a restart would only repeat that failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

from kimi.errors import EXIT_OK, EXIT_STOPPED, STORAGE_ERRORS, FinalError, describe, exit_code_for

_final = False  # whether the error run_main last reported is a FinalError (for finish)


def run_main(body: Callable[[], int]) -> int:
    """Run `body` (which returns an exit code); known problems become one line on stderr and their code."""
    global _final
    _final = False
    try:
        return body()
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 (anything unknown is re-raised below)
        code = exit_code_for(e)
        if code is None:
            raise
        print(f"error: {describe(e)}", file=sys.stderr, flush=True)
        _final = isinstance(e, FinalError)
        return code


def key_value_main(argv: list[str] | None, help_text: str, usage: str, parse: Callable, run: Callable,
                   usage_error: type) -> int:
    """main() of a key=value command (kimi.generate, kimi.eval): -h / --help prints help_text; parse(argv)
    gives the arguments run(args) takes; a usage_error from parse also prints the usage line; every known
    problem is one line (run_main)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text)
        return EXIT_OK

    def body() -> int:
        try:
            args = parse(argv)
        except usage_error:
            print(usage, file=sys.stderr)
            raise
        return run(args)

    return run_main(body)


def finish(code: int, run_dir: str | os.PathLike) -> int:
    """Record `code` for the launch scripts (rank 0, when the run dir exists) and return the process's own
    exit code."""
    # run_dir "": a command refused before it had one (Path("") would be the working directory)
    if os.environ.get("RANK", "0") == "0" and str(run_dir) and Path(run_dir).is_dir():
        try:
            (Path(run_dir) / "exit_code").write_text(f"{code}\n")
        except OSError:
            pass  # a run dir that cannot be written has already been reported
    under_torchrun = "TORCHELASTIC_RUN_ID" in os.environ
    return EXIT_OK if (code == EXIT_STOPPED or (_final and code)) and under_torchrun else code


def import_frozen(module: str) -> None:
    """Import `module` (a command's heavy imports: torch, DCP, dynamo) with Python's cyclic garbage collector
    paused, then freeze all objects made so far (gc.freeze) and resume it; at exit they are unfrozen, so that
    the interpreter's teardown still frees them (triton's bindings report leaked objects otherwise).

    Those imports make about 400k objects and little garbage, yet each automatic full collection among them
    walks every one again, and so does every later collection of the run (destroy_distributed's, a stage's):
    1.0 s of a tiny 3-step run's 6-7 s on this project's 2-core CPU (docs/environment.md). Only in a fresh
    command, before torch is imported: a process that has torch already (a test calling train.cli()
    in-process) imports as usual, since freezing its heap would keep whatever garbage it holds for good."""
    import gc
    import importlib

    if "torch" in sys.modules:
        importlib.import_module(module)
        return
    enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
    import atexit

    atexit.register(gc.unfreeze)


def check_overrides(argv: list[str], config_dir: str | None = None) -> None:
    """Compose the config from command-line overrides as Hydra will, so that what Hydra itself refuses (a
    misspelt key, a value of the wrong type, a preset that does not exist, a syntax error) and a run dir
    Hydra cannot create become one ConfigError line, before Hydra prints its own multi-line report. Runs
    with Hydra's own flags (--multirun, --cfg, ...; --config-path=DIR is understood) are left to Hydra.
    config_dir: a directory or pkg://module; default kimi.cli.conf_dir.search_path()."""
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("--config-path=")]
    argv = [a for a in argv if not a.startswith("--config-path=")]
    if any(a.startswith("-") for a in argv):
        return
    config_dir = str(Path(paths[-1]).resolve()) if paths else config_dir
    from hydra.errors import MissingConfigException

    from kimi.cli.conf_dir import compose
    from kimi.config import ConfigError, unknown_key

    for a in argv:
        if a.startswith("hydra.run.dir="):
            _check_run_dir(Path(a.split("=", 1)[1]))
    try:
        cfg = compose([a for a in argv if not a.startswith("hydra.")], where=config_dir)
    except MissingConfigException as e:
        group, _, name = (e.missing_cfg_file or "").rpartition("/")
        choices = "|".join(e.options or [])
        raise ConfigError(f"{group}={name}: no such preset; choose one of {choices} (files in "
                          f"conf/{group}/)") from None
    except Exception as e:  # noqa: BLE001 (Hydra's and OmegaConf's errors, whose messages span lines)
        cause = e.__cause__
        key = getattr(cause, "full_key", None)
        if key and type(cause).__name__ in ("ConfigAttributeError", "ConfigKeyError"):
            raise ConfigError(unknown_key(key)) from None
        if key:  # a value OmegaConf could not convert
            value = next((a.split("=", 1)[1] for a in argv if a.lstrip("+~").split("=", 1)[0] == key), "?")
            raise ConfigError(f"{key}={value} is invalid: {str(cause).splitlines()[0]}") from None
        raise ConfigError(f"cannot read the overrides: {' '.join(str(e).split())}") from None
    _check_resolved(cfg)


def _check_resolved(cfg) -> None:
    """An interpolation that names no key (optim.lr='${nope}') would be OmegaConf's traceback when the trainer
    resolves the config; and a model size past every real model's (a typo: model.num_layers=1000000) is
    refused here, before the seconds of importing torch, rather than by the trainer's own validation."""
    from omegaconf import OmegaConf
    from omegaconf.errors import GrammarParseError, InterpolationKeyError, InterpolationToMissingValueError

    from kimi.config import ConfigError, check_sizes

    cfg.trainer.run_dir = "unused"  # Hydra's ${hydra:...}, which only a running job resolves
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except (GrammarParseError, InterpolationKeyError, InterpolationToMissingValueError) as e:
        key = getattr(e, "full_key", "") or "an override"
        raise ConfigError(f"{key} cannot be resolved: {' '.join(str(e).splitlines()[0].split())}; a ${{...}} "
                          "interpolation must name a key of the config (e.g. ${trainer.seed})") from None
    except Exception:  # noqa: BLE001 (other resolvers (Hydra's own) are resolved by the job itself)
        return
    check_sizes(cfg.model)


def _check_run_dir(path: Path) -> None:
    """Hydra creates the run dir and its log file before any of our checks: a run dir it cannot write would
    be its multi-line 'Unable to configure handler' traceback."""
    import tempfile

    from kimi.config import ConfigError

    for p in (path, *path.parents):
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"hydra.run.dir={path}: {p} is a file, not a directory; choose another "
                                  "run dir")
            try:  # by trying: os.access says yes to root on a read-only file system
                tempfile.TemporaryFile(dir=p).close()
            except OSError as e:
                why = STORAGE_ERRORS.get(e.errno, e.strerror)
                raise ConfigError(f"hydra.run.dir={path}: cannot write in {p}: {why}; choose another run "
                                  "dir or make it writable") from None
            return
