"""The engines parallel.engine names (a registry: a new engine is its module plus one line here), and the
layouts each one takes.

Torch-free: the validation pass (kimi/parallel/rules.py) asks :func:`engine_problem` before any data work,
and build_engine imports an engine's module only when it is chosen.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, Optional, Union

from kimi.parallel.config import ENGINES as _TABLE

TORCH, DEEPSPEED = "torch", "deepspeed"
# The table is kimi.parallel.config.ENGINES itself, the values validate() allows for parallel.engine:
# "module:Class" inside kimi.parallel (kimi.schema.vocabulary.registered imports it when the engine is built),
# or the class.
ENGINES: Dict[str, Union[str, type]] = _TABLE
ENGINES.update({TORCH: "engine:TorchEngine", DEEPSPEED: "deepspeed_engine:DeepSpeedEngine"})

DEEPSPEED_MISSING = ("parallel.engine=deepspeed needs the deepspeed package, which is not installed: "
                     "pip install deepspeed (or the project's extra: pip install -e '.[deepspeed]'), "
                     "or use parallel.engine=torch")


def engine_problem(p: Any) -> Optional[str]:
    """Why the parallel config `p` cannot run on the engine it names (None: it can). DeepSpeed's engine
    partitions over plain data parallelism: the layouts it does not take are named."""
    if p.engine != DEEPSPEED:
        return None
    if importlib.util.find_spec("deepspeed") is None:
        return DEEPSPEED_MISSING
    unsupported = [f"parallel.{k}={getattr(p, k)}" for k in ("dp_replicate", "cp", "tp", "pp", "ep")
                   if getattr(p, k) > 1]
    unsupported += [f"parallel.{k}=true" for k in ("compile", "sequence_parallel") if getattr(p, k)]
    if p.activation_checkpointing != "none":
        unsupported.append(f"parallel.activation_checkpointing={p.activation_checkpointing}")
    if p.cuda_graphs != "none":
        unsupported.append(f"parallel.cuda_graphs={p.cuda_graphs}")
    if unsupported:
        return (f"parallel.engine=deepspeed runs ZeRO over data parallelism only (parallel.dp_shard ranks), "
                f"without {', '.join(unsupported)}: reset those, or use parallel.engine=torch, "
                "which has them all")
    return None
