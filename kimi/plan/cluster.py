"""The cluster a plan is for: how many GPUs, how many share a node, and each GPU kind's datasheet numbers.

The planner's own keys (cluster.*, trainer.tokens_per_step, top, json) are taken out of the command line
before the rest composes as a training config; `split_args` does that.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kimi.cli import keyvalue
from kimi.errors import ConfigError

GIB = 1024**3


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    gpu: str  # the kind (h100, h200, b200) whose numbers the unset keys take, or "custom"
    peak_flops: float  # dense bf16 FLOP/s of one GPU
    hbm_bytes: int  # memory of one GPU
    hbm_bandwidth: float  # bytes/s
    intra_node_bandwidth: float  # bytes/s one GPU sends to the others of its node (one direction)
    inter_node_bandwidth: float  # bytes/s one GPU sends off its node (its network adapter, one direction)

    def link(self, span: int) -> Tuple[str, float]:
        """(name, bytes/s) of the link a group of ranks spanning `span` consecutive ranks crosses."""
        if span <= self.gpus_per_node:
            return "NVLink", self.intra_node_bandwidth
        return "inter-node", self.inter_node_bandwidth


# Vendor datasheet numbers (SXM parts; docs/planning.md cites them). Peaks: dense bf16 tensor-core FLOP/s
# without sparsity, as the trainer's MFU table (kimi/run/metrics.py) has them for H100 and H200. NVLink:
# half the datasheet's bidirectional per-GPU figure. Inter-node: one 400 Gb/s adapter per GPU (the DGX/HGX
# reference designs), 50 GB/s. HBM: the marketed capacity, GiB for H100 (80 GiB) and GB for H200/B200.
GPUS: Dict[str, Dict[str, float]] = {
    "h100": {"peak_flops": 989e12, "hbm_bytes": 80 * GIB, "hbm_bandwidth": 3.35e12,
             "intra_node_bandwidth": 450e9, "inter_node_bandwidth": 50e9},
    "h200": {"peak_flops": 989e12, "hbm_bytes": 141e9, "hbm_bandwidth": 4.8e12,
             "intra_node_bandwidth": 450e9, "inter_node_bandwidth": 50e9},
    "b200": {"peak_flops": 2.25e15, "hbm_bytes": 180e9, "hbm_bandwidth": 8.0e12,
             "intra_node_bandwidth": 900e9, "inter_node_bandwidth": 50e9},
}

# key -> (parser, meaning); the order is --help's
KEYS: Dict[str, Tuple[Any, str]] = {
    "cluster.gpus": (keyvalue.positive_int, "GPUs in all: the layouts' degrees multiply to it (required)"),
    "cluster.gpus_per_node": (keyvalue.positive_int, "GPUs that share a node's NVLink (default 8); tp stays "
                                                     "within one node"),
    "cluster.gpu": (keyvalue.one_of(*GPUS), "the GPU kind whose datasheet numbers the keys below default to "
                                            f"({'|'.join(GPUS)}; default h200)"),
    "cluster.peak_flops": (keyvalue.positive_float, "dense bf16 FLOP/s of one GPU (custom GPUs)"),
    "cluster.hbm_bytes": (keyvalue.positive_float, "memory of one GPU, bytes; 10% of it is kept in reserve"),
    "cluster.hbm_bandwidth": (keyvalue.positive_float, "HBM bytes/s of one GPU"),
    "cluster.intra_node_bandwidth": (keyvalue.positive_float, "bytes/s one GPU sends within its node "
                                                              "(NVLink, one direction)"),
    "cluster.inter_node_bandwidth": (keyvalue.positive_float, "bytes/s one GPU sends to other nodes (its "
                                                              "network adapter, one direction)"),
    "trainer.tokens_per_step": (keyvalue.positive_int, "tokens per optimizer step (default: the config's "
                                                       "micro_batch_size x seq_len x grad_accum_steps x "
                                                       "cluster.gpus); gradient accumulation fills what the "
                                                       "layout leaves"),
    "top": (keyvalue.positive_int, "layouts shown (default 5)"),
    "json": (str, "write the plan (every layout shown, rejections, assumptions) to this JSON file"),
    "measure": (keyvalue.positive_int, "train the best K layouts for 3 steps, one process per GPU of the "
                                       "plan (under torchrun on this machine, or srun inside a SLURM "
                                       "allocation), and rank them by measured tokens/s and peak memory per "
                                       "rank, beside the prediction"),
    "measure_launcher": (keyvalue.one_of("auto", "torchrun", "srun"), "with measure: auto (default: srun "
                                                                      "inside a SLURM allocation, else "
                                                                      "torchrun), torchrun or srun"),
    "measure_dir": (str, "with measure: where the ranks write their results (default: a temporary "
                         "directory; under srun runs/plan_measure_<job id>, which every node must see)"),
    "measure_layers": (keyvalue.positive_int, "with measure: run a depth-reduced model of this many blocks "
                                              "(model.num_layers; memory predicted again for it)"),
}


@dataclass(frozen=True)
class PlanArgs:
    cluster: Cluster
    tokens_per_step: Optional[int]
    top: int
    json: Optional[str]
    overrides: List[str]  # the rest: Hydra overrides of the training config
    measure: int = 0  # layouts to launch (kimi.plan.measure)
    measure_layers: Optional[int] = None
    launcher: Any = None  # kimi.plan.measure.Launcher, with measure
    measure_dir: Optional[str] = None


def split_args(argv: Sequence[str]) -> PlanArgs:
    """The planner's keys parsed, the rest kept as overrides; a wrong planner key is one ConfigError line."""
    mine = [a for a in argv if a.partition("=")[0] in KEYS]
    rest = [a for a in argv if a.partition("=")[0] not in KEYS]
    for a in rest:
        key = a.partition("=")[0].lstrip("+~")
        if key.startswith(("cluster.", "measure")) or key in ("top", "json"):
            keyvalue.parse([a], {k: v[0] for k, v in KEYS.items()}, "kimi.plan")  # its one-line error
    values = keyvalue.parse(mine, {k: v[0] for k, v in KEYS.items()}, "kimi.plan")
    if "cluster.gpus" not in values:
        raise ConfigError("cluster.gpus is required: the number of GPUs to plan for, e.g. cluster.gpus=64 "
                          "cluster.gpu=h200")
    kind = values.get("cluster.gpu", "h200")
    spec = dict(GPUS[kind])
    custom = False
    for key in spec:
        if f"cluster.{key}" in values:
            spec[key] = values[f"cluster.{key}"]
            custom = True
    spec["hbm_bytes"] = int(spec["hbm_bytes"])
    gpn = values.get("cluster.gpus_per_node", 8)
    gpus = values["cluster.gpus"]
    if gpus > gpn and gpus % gpn:
        raise ConfigError(f"cluster.gpus={gpus} is not a whole number of nodes of cluster.gpus_per_node="
                          f"{gpn}: give a multiple of it")
    cluster = Cluster(gpus, min(gpn, gpus), f"{kind} (custom)" if custom else kind, **spec)
    for key in ("measure_layers", "measure_launcher", "measure_dir"):
        if key in values and "measure" not in values:
            raise ConfigError(f"{key} is a setting of the measured runs: give measure=K with it")
    how = None
    if values.get("measure"):
        from .measure import launcher

        how = launcher(gpus, gpn, values.get("measure_launcher", "auto"), dict(os.environ))
    return PlanArgs(cluster, values.get("trainer.tokens_per_step"), values.get("top", 5), values.get("json"),
                    rest, values.get("measure", 0), values.get("measure_layers"), how,
                    values.get("measure_dir"))


def as_dict(c: Cluster) -> Dict[str, Any]:
    return dataclasses.asdict(c)
