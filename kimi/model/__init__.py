"""Single-device model code: KDA and MLA token mixers, SwiGLU MLPs, residual streams, the full model."""

from .cache import InferenceCache, KDACache, MLACache
from .kda import KDA
from .mla import MLA
from .mlp import SwiGLU
from .norm import RMSNorm
from .transformer import Block, KimiModel, lm_loss, training_flops

__all__ = ["KimiModel", "Block", "lm_loss", "training_flops", "KDA", "MLA", "SwiGLU", "RMSNorm",
           "InferenceCache", "KDACache", "MLACache"]
