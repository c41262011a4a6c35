"""Train a Kimi-style model: `python train.py [model=tiny] [trainer.max_steps=300] ...` (see README); the
command itself is kimi/train.py, installed as `kimi-train`.

Hydra's multirun runs several jobs one after another in this process, e.g. an ablation's arms x seeds:
`python train.py -m +experiment=ablate_residual` (conf/experiment/, docs/ablations.md); a failed job does not
stop the others, the command exits 1 at the end if one failed, and a signal stops the sweep after the current
job's checkpoint.

Exit codes (kimi/cli.py): 0 finished, 75 stopped early with a checkpoint (rerun to continue), 2 bad config,
data or run directory, 1 failure. Under torchrun a stopped run's ranks exit 0 and <run_dir>/exit_code holds
75 (torchrun would call any other code a failure); the launch scripts exit with it."""

from kimi.run.signals import exit_while_starting

exit_while_starting()  # before the imports that take seconds: a SIGTERM among them exits 75, not -15

from kimi.train import FAILED_JOBS, cli, job, main, train  # noqa: E402, F401

if __name__ == "__main__":
    cli()
