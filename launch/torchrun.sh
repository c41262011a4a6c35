#!/usr/bin/env bash
# Local launcher:  NPROC=1 RUN_DIR=runs/exp1 launch/torchrun.sh model=small trainer.max_steps=2000
# Rerunning the same command resumes from RUN_DIR's newest complete checkpoint. Under torchrun the run
# directory must be explicit: Hydra's timestamped default could differ between ranks.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="${RUN_DIR:-runs/torchrun}"
exec "${PYTHON:-.venv/bin/python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-1}" \
    train.py hydra.run.dir="$RUN_DIR" "$@"
