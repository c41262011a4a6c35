"""The precision section (precision.*, precision.fp8): its schema. trainer.precision's names are the run
section's (kimi/schema/run.py), filled by kimi/precision/registry.py.

Torch-free, like every section's config (kimi/schema/__init__.py); the section's rules are
kimi/precision/rules.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from kimi.schema.vocabulary import one_of

FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")  # torchao's recipe names
QAT_MODES = ("mxfp4_experts",)


@dataclass
class Fp8Config:
    recipe: str = one_of(FP8_RECIPES, "tensorwise")  # torchao's Float8LinearConfig.from_recipe_name
    # tensorwise under FSDP2 (dp_shard * cp > 1): FSDP gathers the converted weights as fp8 (1 byte per
    # element) instead of bf16 (2), each cast from its fp32 shard with the whole weight's amax
    fsdp_all_gather: bool = False


@dataclass
class PrecisionConfig:
    """Low-precision training (trainer.precision=fp8|mxfp8, precision.qat; kimi/precision,
    docs/precision.md)."""

    fp8: Fp8Config = field(default_factory=Fp8Config)
    # null: the fp8 / MXFP8 matmuls emulated on CPU, native on CUDA (a GPU without them, below sm_89 for fp8
    # or sm_100 for MXFP8, is refused unless true); true: emulated everywhere; false: native only
    emulate: Optional[bool] = None
    # blocks at each end of the model whose projections stay bf16 (the first and last layers)
    keep_end_blocks: int = 1
    # projections with fewer input or output features stay bf16 (their cast costs more than it saves)
    min_features: int = 64
    # mxfp4_experts: the routed experts' weights fake-quantised to MXFP4 in the forward (QAT), exportable
    qat: Optional[str] = one_of(QAT_MODES, None)
