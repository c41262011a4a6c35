"""A training run's own machinery, below the trainer that uses it: the run directory (rundir), its log and
saved config (runlog), signals, resuming, divergence checks, the profiler, CPU threads, and what a run
reports (metrics.jsonl, the progress line, MFU's peaks, wandb)."""
