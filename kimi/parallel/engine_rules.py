"""The engines parallel.engine names, and the layouts each one takes.

Torch-free and importing nothing of kimi: kimi.config reads the names while it is itself being imported,
and the validation pass (kimi/parallel/rules.py) asks :func:`engine_problem` before any data work.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Optional

TORCH, DEEPSPEED = "torch", "deepspeed"
ENGINES = (TORCH, DEEPSPEED)

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
    if unsupported:
        return (f"parallel.engine=deepspeed runs ZeRO over data parallelism only (parallel.dp_shard ranks), "
                f"without {', '.join(unsupported)}: reset those, or use parallel.engine=torch, "
                "which has them all")
    return None
