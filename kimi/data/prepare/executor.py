"""datatrove runs a preparation in parts (kimi.data.prepare.parts): one task per worker, then the merge
(kimi.data.prepare.merge), with LocalPipelineExecutor (``data.prepare_executor=local``: tasks at once on this
machine) or SlurmPipelineExecutor (``slurm``: an sbatch array, and a merge job that waits for it).

datatrove is optional (the prep extra): import this module only once it is there (kimi.data.prepare's
command checks). It keeps a completion marker per task under <data_dir>/parts-<N>/datatrove/, so the same
command run again runs only the unfinished tasks; the step itself is our worker, which also keeps a killed
task's finished files."""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, Optional

from datatrove.executor import LocalPipelineExecutor, SlurmPipelineExecutor
from datatrove.pipeline.base import PipelineStep

from kimi.data import pack
from kimi.data.config import DataConfig
from kimi.data.encode import default_num_proc
from kimi.data.pack import MANIFEST, PreparedData, data_dir_for
from kimi.data.prepare.merge import merge_parts
from kimi.data.prepare.parts import EXECUTOR_LOGS, make_tokenizer, parts_dir, prepare_part
from kimi.errors import ConfigError


class PreparePart(PipelineStep):
    """Task ``rank`` of ``world_size``: that worker's part (prepare_part)."""

    name, type = "prepare part", "kimi"

    def __init__(self, cfg: DataConfig, num_proc: Optional[int], command: str):
        super().__init__()
        self.cfg, self.num_proc, self.command = cfg, num_proc, command

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> None:
        prepare_part(self.cfg, rank, world_size, self.num_proc, self.command)


class MergeParts(PipelineStep):
    """The one task after the workers: merge_parts."""

    name, type = "merge parts", "kimi"

    def __init__(self, cfg: DataConfig, workers: int, command: str):
        super().__init__()
        self.cfg, self.workers, self.command = cfg, workers, command

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> None:
        merge_parts(self.cfg, self.workers, self.command)


def local_executor(cfg: DataConfig, command: str) -> LocalPipelineExecutor:
    """The workers as tasks on this machine: data.prepare_executor_args.workers at once (default: one per
    core, up to the number of tasks), each on its share of the cores (or data.num_proc processes)."""
    tasks = cfg.prepare_workers or 1
    args: Dict[str, Any] = dict(cfg.prepare_executor_args)
    cores = default_num_proc(None)
    at_once = int(args.pop("workers", min(tasks, cores)))
    num_proc = cfg.num_proc or max(1, cores // at_once)
    # fork: a task needs no import of its own (datatrove's default, forkserver, re-imports datasets in each)
    args.setdefault("start_method", "fork")
    return LocalPipelineExecutor([PreparePart(cfg, num_proc, command)], tasks=tasks, workers=at_once,
                                 logging_dir=str(parts_dir(data_dir_for(cfg), tasks) / EXECUTOR_LOGS), **args)


def slurm_executor(cfg: DataConfig, command: str) -> SlurmPipelineExecutor:
    """The merge job, depending on the workers' array job; data.prepare_executor_args are
    SlurmPipelineExecutor's (partition and time are required), for both. The jobs activate this Python's
    virtual environment unless the arguments name another (venv_path, condaenv, env_command)."""
    tasks = cfg.prepare_workers or 1
    args: Dict[str, Any] = dict(cfg.prepare_executor_args)
    lacking = [k for k in ("partition", "time") if k not in args]
    if lacking:
        raise ConfigError(f"data.prepare_executor=slurm needs {' and '.join(lacking)} for sbatch: add "
                          + " ".join(f"+data.prepare_executor_args.{k}=..." for k in lacking))
    if sys.prefix != sys.base_prefix and not {"venv_path", "condaenv", "env_command"} & set(args):
        args["venv_path"] = os.path.join(sys.prefix, "bin", "activate")
    logs = parts_dir(data_dir_for(cfg), tasks)
    args.setdefault("job_name", f"prepare-{cfg.name}")
    workers = SlurmPipelineExecutor([PreparePart(cfg, cfg.num_proc, command)], tasks=tasks,
                                    logging_dir=str(logs / EXECUTOR_LOGS), **args)
    merge_args = {**args, "job_name": f"{args['job_name']}-merge", "workers": -1}
    return SlurmPipelineExecutor([MergeParts(cfg, tasks, command)], tasks=1, depends=workers,
                                 logging_dir=str(logs / f"{EXECUTOR_LOGS}-merge"), **merge_args)


def run_executor(cfg: DataConfig, command: str) -> Optional[PreparedData]:
    """The preparation through data.prepare_executor: the tokenizer made first (once, here), then the
    workers and the merge. Returns the prepared data, or None when SLURM jobs were submitted."""
    if (data_dir_for(cfg) / MANIFEST).is_file():
        return pack.prepare(cfg, limit=False)
    make_tokenizer(cfg)
    if cfg.prepare_executor == "local":
        local_executor(cfg, command).run()
        return merge_parts(cfg, cfg.prepare_workers or 1, command)
    slurm_executor(cfg, command).run()  # submits the array, then the merge job after it
    print(f"[data] submitted {cfg.prepare_workers or 1} worker task(s) and a merge job; the logs and "
          f"completion markers are under {parts_dir(data_dir_for(cfg), cfg.prepare_workers or 1)}",
          flush=True)
    return None
