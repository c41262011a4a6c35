"""Train a Kimi-style model: `python train.py [model=tiny] [trainer.max_steps=300] ...` (see README)."""

import hydra
from omegaconf import DictConfig

from kimi.config import register_configs

register_configs()


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from kimi.trainer import Trainer

    Trainer(cfg).fit()


if __name__ == "__main__":
    main()
