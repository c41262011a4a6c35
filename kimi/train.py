"""The training command: `kimi-train [overrides]` once the package is installed, `python train.py [overrides]`
in a checkout (the same function), e.g. `kimi-train model=tiny trainer.max_steps=300` (see README).
A config with stages (`kimi-train recipe=k2_like`, docs/stages.md) trains them in order, one Trainer each
(kimi/run/stages.py).

Hydra's multirun runs several jobs one after another in this process, e.g. an ablation's arms x seeds:
`kimi-train -m +experiment=ablate_residual` (conf/experiment/, docs/ablations.md); a failed job does not stop
the others, the command exits 1 at the end if one failed, and a signal stops the sweep after the current
job's checkpoint.

Exit codes (kimi/errors.py): 0 finished, 75 stopped early with a checkpoint (rerun to continue; after
trainer.stop_at_step with it raised or dropped), 2 bad config, data or run directory, 1 failure. Under
torchrun a stopped run's ranks exit 0 and <run_dir>/exit_code holds 75 (torchrun would call any other code a
failure); the launch scripts exit with it.

The configs come from kimi.cli.conf_dir: a checkout's conf/, else the installed package's (Hydra's pkg://).
"""

import os
import sys
from pathlib import Path

# Hydra's multirun (`-m ...`, e.g. `-m +experiment=ablate_residual`, conf/experiment/) runs its jobs one after
# another in this process: (run dir, exit code) of each job that failed, reported once all have run.
FAILED_JOBS: list = []
# The folders a single run's hydra.run.dir will make (kimi.run.rundir.FoldersMade), taken before Hydra makes
# them: a job refused before any work removes them again while they are empty. None: not known (a multirun, or
# main() called without cli()).
FOLDERS_MADE = None


def train(cfg) -> int:
    from kimi.errors import EXIT_OK, EXIT_STOPPED
    from kimi.config import to_config
    from kimi.parallel import destroy_distributed
    from kimi.run.stages import run_stages
    from kimi.trainer import Trainer

    cfg = to_config(cfg)
    result = run_stages(cfg, Trainer) if cfg.stages else Trainer(cfg).fit()  # stages: one Trainer each
    destroy_distributed()  # after success only: a barrier after one rank's failure would hang the rest
    return EXIT_OK if result["finished"] else EXIT_STOPPED


def job(cfg) -> None:
    """One Hydra job: train, record its exit code, and exit with it unless a multirun goes on."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from kimi.cli import finish, run_main
    from kimi.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_STOPPED

    code = run_main(lambda: train(cfg))
    if code == EXIT_BAD_INPUT and FOLDERS_MADE is not None and "TORCHELASTIC_RUN_ID" not in os.environ:
        from kimi.run.rundir import remove_unused

        # refused before any work (one line said why): no empty outputs/<date>/<time>/ left behind
        remove_unused(Path(cfg.trainer.run_dir), FOLDERS_MADE.top(Path(cfg.trainer.run_dir)))
    code = finish(code, cfg.trainer.run_dir)
    if HydraConfig.get().mode != RunMode.MULTIRUN or code in (EXIT_STOPPED, 130):  # 130: Ctrl-C at start-up
        # one run; or a multirun job stopped by a signal, which stops the sweep (rerun it to continue: the
        # finished jobs say so and exit, the stopped one resumes from its checkpoint)
        sys.exit(code)
    if code != EXIT_OK:  # a failed job (a diverged lr, a bad arm) does not stop the others
        FAILED_JOBS.append((cfg.trainer.run_dir, code))


def main() -> None:
    """Hydra's entry over sys.argv (its flags included: --multirun, --cfg, --config-path, ...)."""
    import hydra

    from kimi.cli.conf_dir import search_path
    from kimi.config import register_configs

    register_configs()
    # the job is this module's function, so Hydra names the job (and its log, train.log) after this file
    hydra.main(version_base="1.3", config_path=search_path(), config_name="config")(job)()


USAGE = """usage: kimi-train [key=value ...]   (in a checkout: python train.py [key=value ...])

Train a Kimi-style model. Each argument is a Hydra override: key=value sets one of the keys below,
group=name picks a preset (model=small), +experiment=NAME adds an experiment's settings. Hydra's own flags
still work: -m / --multirun sweeps (key=a,b), --cfg job prints the composed config, --hydra-help lists the
rest. Put overrides before --help to see the values they give (kimi-train model=small --help).

Exit codes: 0 finished, 75 stopped early with a checkpoint (trainer.stop_at_step or a signal), 2 bad config,
data or run directory, 1 failure."""


# Hydra's flags that print and exit without running a job (--cfg job, --info, ...): they import no torch
HYDRA_PRINTS = ("--cfg", "-c", "--info", "-i", "--hydra-help", "--shell-completion", "-sc")


def cli() -> None:
    """What `python train.py ...` runs: the overrides are checked first (kimi.cli.check_overrides), so what
    Hydra would refuse with a report of several lines is one line and exit code 2, like every other error."""
    from kimi.cli import check_overrides, finish, import_frozen, run_main
    from kimi.config import register_configs

    if any(a in ("-h", "--help") for a in sys.argv[1:]):  # Hydra's own --help dumps the config unexplained
        import kimi.data.source_registry  # noqa: F401 (the registries fill the keys' choices)
        import kimi.optim.registry  # noqa: F401
        import kimi.parallel.engine_rules  # noqa: F401
        import kimi.precision.registry  # noqa: F401
        from kimi.cli.config_help import config_help

        print(config_help(USAGE, sys.argv[1:]))
        sys.exit(0)
    register_configs()  # the schema Hydra checks the overrides against
    code = run_main(lambda: check_overrides(sys.argv[1:]) or 0)
    if code:
        run_dir = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir=")), "")
        sys.exit(finish(code, run_dir))
    if not any(a.split("=", 1)[0] in HYDRA_PRINTS for a in sys.argv[1:]):
        import_frozen("kimi.trainer")  # a run: the imports that take seconds
    global FOLDERS_MADE
    FOLDERS_MADE = _folders_made(sys.argv[1:])
    try:
        main()
    finally:  # this command's: a later main() in the same process (tests) takes its own
        FOLDERS_MADE = None
    if FAILED_JOBS:  # only after a multirun
        from kimi.errors import EXIT_FAILED

        for run_dir, code in FAILED_JOBS:
            print(f"error: multirun job {run_dir} exited with code {code}", file=sys.stderr)
        sys.exit(EXIT_FAILED)


def _folders_made(argv: list):
    """kimi.run.rundir.FoldersMade of this command's hydra.run.dir (the override, else conf/config.yaml's),
    for a single run; None for a multirun or Hydra's other flags (their folders are Hydra's own)."""
    from omegaconf import OmegaConf

    from kimi.cli.conf_dir import conf_dir
    from kimi.run.rundir import FoldersMade

    if any(a.startswith("-") for a in argv):
        return None
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    try:
        pattern = given[-1] if given else OmegaConf.load(conf_dir() / "config.yaml").hydra.run.dir
        return FoldersMade(str(pattern))
    except Exception:  # noqa: BLE001 (without it a refused run keeps its folder, as before)
        return None


def entry() -> None:
    """The kimi-train console script: the at-once SIGTERM handler first, as train.py installs it."""
    from kimi.run.signals import exit_while_starting

    exit_while_starting()  # before the imports that take seconds: a SIGTERM among them exits 75, not -15
    cli()


if __name__ == "__main__":
    entry()
