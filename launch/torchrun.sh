#!/usr/bin/env bash
# Local launcher:  NPROC=1 RUN_DIR=runs/exp1 launch/torchrun.sh model=small trainer.max_steps=2000
# Rerunning the same command resumes from RUN_DIR's newest complete checkpoint. Under torchrun the run
# directory must be explicit: Hydra's timestamped default could differ between ranks.
# Exit code: the trainer's (kimi/errors.py): 0 finished, 75 stopped early with a checkpoint (rerun to
# continue), 2 bad config/data/run dir, 1 failure. torchrun itself only says 0 or 1, so the trainer's code
# is read from $RUN_DIR/exit_code.
set -uo pipefail
cd "$(dirname "$0")/.."
RUN_DIR="${RUN_DIR:-runs/torchrun}"
mkdir -p "$RUN_DIR" && rm -f "$RUN_DIR/exit_code"
"${PYTHON:-.venv/bin/python}" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-1}" \
    train.py hydra.run.dir="$RUN_DIR" "$@"
rc=$?
code="$(cat "$RUN_DIR/exit_code" 2>/dev/null || true)"
# torchrun's 0 with a recorded 75 is a stop; a failure keeps the trainer's own reason when it wrote one
if [[ -n "$code" && ( $rc -eq 0 || $code -ne 0 ) ]]; then exit "$code"; fi
exit "$rc"
