"""Train a Kimi-style model: `python train.py [model=tiny] [trainer.max_steps=300] ...` (see README)."""

import sys

import hydra
from omegaconf import DictConfig

from kimi.config import ConfigError, register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from kimi.data.sources import DataError
    from kimi.parallel import destroy_distributed
    from kimi.trainer import Trainer

    try:
        Trainer(cfg).fit()
        destroy_distributed()  # after success only: a barrier after one rank's failure would hang the rest
    except (ConfigError, DataError, FileNotFoundError) as e:
        # A settings problem, not a bug: say what is wrong and how to fix it, without a traceback.
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
