"""torchrun worker for tests/parallel/test_parallel.py: several training runs, one after another, in one
launch (the start-up of torch on every rank is most of a tiny run's time).

    torchrun --nproc_per_node N tests/dist_train.py RUNS.json

RUNS.json holds a list of {"run_dir": ..., "overrides": [...]}: each is composed from conf/ like train.py
and trained to the end. A run that fails ends the launch (torchrun then stops every rank).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]


def main(spec: Path) -> None:
    from kimi.cli import import_frozen

    import_frozen("kimi.trainer")  # as train.py does: each run's collections then skip what the imports made
    from kimi.config import register_configs
    from kimi.parallel import destroy_distributed
    from kimi.trainer import Trainer

    register_configs()
    for run in json.loads(spec.read_text()):
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"trainer.run_dir={run['run_dir']}", *run["overrides"]])
        trainer = Trainer(cfg)
        result = trainer.fit()
        if "sample" in result and trainer.is_main:
            Path(run["run_dir"], "sample.txt").write_text(result["sample"])
        del trainer
        gc.collect()
        print(f"[dist_train] finished {run['run_dir']}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
