"""Train a Kimi-style model: `python train.py [model=tiny] [trainer.max_steps=300] ...` (see README).

Exit codes (kimi/cli.py): 0 finished, 75 stopped early with a checkpoint (rerun to continue), 2 bad config,
data or run directory, 1 failure. Under torchrun a stopped run's ranks exit 0 and <run_dir>/exit_code holds
75 (torchrun would call any other code a failure); the launch scripts exit with it."""

import sys

import hydra
from omegaconf import DictConfig

from kimi.config import register_configs

register_configs()


def train(cfg: DictConfig) -> int:
    from kimi.cli import EXIT_OK, EXIT_STOPPED
    from kimi.parallel import destroy_distributed
    from kimi.trainer import Trainer

    result = Trainer(cfg).fit()
    destroy_distributed()  # after success only: a barrier after one rank's failure would hang the rest
    return EXIT_OK if result["finished"] else EXIT_STOPPED


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from kimi.cli import finish, run_main

    sys.exit(finish(run_main(lambda: train(cfg)), cfg.trainer.run_dir))


def cli() -> None:
    """What `python train.py ...` runs: the overrides are checked first (kimi.cli.check_overrides), so what
    Hydra would refuse with a report of several lines is one line and exit code 2, like every other error."""
    from pathlib import Path

    from kimi.cli import check_overrides, finish, run_main

    code = run_main(lambda: check_overrides(sys.argv[1:], str(Path(__file__).resolve().parent / "conf")) or 0)
    if code:
        run_dir = next((a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("hydra.run.dir=")), "")
        sys.exit(finish(code, run_dir))
    main()


if __name__ == "__main__":
    cli()
