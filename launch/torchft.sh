#!/usr/bin/env bash
# Fault tolerance across replica groups with torchft (docs/parallelism.md, "Fault tolerance"): one lighthouse,
# then one job per replica group, each its own torchrun over its own ranks (parallel.dp_shard x cp x tp).
#   launch/torchft.sh lighthouse          # once, on a host every group reaches; MIN_REPLICAS=1, PORT=29510
#   REPLICA_GROUP=0 REPLICA_GROUPS=2 NPROC=8 LIGHTHOUSE=http://HOST:29510 launch/torchft.sh group \
#       model=small parallel.dp_shard=8 trainer.max_steps=2000
# Every group needs the same config but for its REPLICA_GROUP, and a run dir of its own (RUN_DIR, default
# runs/torchft/group<REPLICA_GROUP>). A group whose process dies is started again by torchrun
# (MAX_RESTARTS, default 3) and rejoins by taking a live peer's state; the other groups train on meanwhile.
# A lighthouse that stops answering ends the group with one line and exit code 1, without restarts.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
case "${1:-}" in
  lighthouse)
    exec "$(dirname "$PYTHON")/torchft_lighthouse" --min_replicas "${MIN_REPLICAS:-1}" --bind "[::]:${PORT:-29510}"
    ;;
  group)
    shift
    g="${REPLICA_GROUP:?set REPLICA_GROUP (0..REPLICA_GROUPS-1)}"
    RUN_DIR="${RUN_DIR:-runs/torchft/group$g}"
    mkdir -p "$RUN_DIR" && rm -f "$RUN_DIR/exit_code"
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "${NPROC:-1}" \
        --max-restarts "${MAX_RESTARTS:-3}" train.py hydra.run.dir="$RUN_DIR" \
        parallel.fault_tolerance=torchft parallel.torchft.replica_group="$g" \
        parallel.torchft.replica_groups="${REPLICA_GROUPS:-2}" parallel.torchft.min_replicas="${MIN_REPLICAS:-1}" \
        parallel.torchft.lighthouse="${LIGHTHOUSE:?set LIGHTHOUSE=http://HOST:PORT}" "$@"
    rc=$?
    # the trainer's code (kimi/errors.py), as launch/torchrun.sh reads it: its ranks exit 0 where a restart
    # would not help (75 stopped; 1 the lighthouse gone), so torchrun does not restart them
    code="$(cat "$RUN_DIR/exit_code" 2>/dev/null || true)"
    if [[ -n "$code" && ( $rc -eq 0 || $code -ne 0 ) ]]; then exit "$code"; fi
    exit "$rc"
    ;;
  *)
    echo "usage: launch/torchft.sh lighthouse | launch/torchft.sh group [overrides...] (see the header)" >&2
    exit 2
    ;;
esac
