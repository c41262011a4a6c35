"""torchrun worker for tests/parallel/test_parallel.py: several training runs, one after another, in one
launch (the start-up of torch on every rank is most of a tiny run's time).

    torchrun --nproc_per_node N tests/dist_train.py RUNS.pkl

RUNS.pkl holds a list of typed configs (kimi.config.Config, each with its trainer.run_dir), composed from
conf/ as train.py composes them (tests/layout_runs.py dist_train), each trained to the end. A run that fails
ends the launch (torchrun then stops every rank).
"""

from __future__ import annotations

import gc
import pickle
import sys
from pathlib import Path


def main(spec: Path) -> None:
    from kimi.cli import import_frozen

    import_frozen("kimi.trainer")  # as train.py does: each run's collections then skip what the imports made
    from kimi.parallel import destroy_distributed
    from kimi.trainer import Trainer

    for cfg in pickle.loads(spec.read_bytes()):
        trainer = Trainer(cfg)
        result = trainer.fit()
        if "sample" in result and trainer.is_main:
            Path(cfg.trainer.run_dir, "sample.txt").write_text(result["sample"])
        del trainer
        gc.collect()
        print(f"[dist_train] finished {cfg.trainer.run_dir}", flush=True)
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
