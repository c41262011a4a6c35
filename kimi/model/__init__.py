"""Single-device model code: KDA and MLA token mixers, SwiGLU MLPs, residual streams, the full model.

The names below are imported on first use, so that importing the model's torch-free config
(kimi/model/config.py, which kimi.config assembles) does not import torch and the model.
"""

from typing import TYPE_CHECKING

from kimi import lazy_getattr

_WHERE = {
    "InferenceCache": "cache", "KDACache": "cache", "MLACache": "cache", "KDA": "kda", "MLA": "mla",
    "SwiGLU": "mlp", "RMSNorm": "norm", "Block": "transformer", "KimiModel": "transformer",
    "lm_loss": "transformer", "training_flops": "transformer",
}
__all__ = ["KimiModel", "Block", "lm_loss", "training_flops", "KDA", "MLA", "SwiGLU", "RMSNorm",
           "InferenceCache", "KDACache", "MLACache"]


__getattr__ = lazy_getattr(__name__, _WHERE)


if TYPE_CHECKING:  # for type checkers: the names of __all__, which __getattr__ imports at run time
    from .cache import InferenceCache, KDACache, MLACache  # noqa: F401
    from .kda import KDA  # noqa: F401
    from .mla import MLA  # noqa: F401
    from .mlp import SwiGLU  # noqa: F401
    from .norm import RMSNorm  # noqa: F401
    from .transformer import Block, KimiModel, lm_loss, training_flops  # noqa: F401
