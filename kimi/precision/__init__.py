"""Low-precision training, applied from outside the single-device model like parallelism (docs/precision.md).

``apply_low_precision`` runs on the model the engine is given (on the meta device, before any parallelism,
activation checkpointing, torch.compile or FSDP):

* trainer.precision=fp8 | mxfp8: the block projections that benefit become torchao fp8 / MXFP8 linears
  (kimi/precision/linear.py); the rest of the model runs under bf16 autocast as trainer.precision=bf16 does.
  A projection stays bf16 when it is in the first or last ``precision.keep_end_blocks`` blocks, is an MoE
  router (its scores choose the experts) or has fewer than ``precision.min_features`` input or output
  features or a dimension that is not a multiple of the format's alignment (16 for fp8, the 32-element block
  for MXFP8). The LM head, embedding, norms, convolutions, AttnRes queries and the routed experts' grouped
  weights are never converted (torchao 0.18's fp8 grouped GEMM needs CUDA's _scaled_grouped_mm).
* precision.qat=mxfp4_experts: every routed-expert weight is read through MXFP4 fake quantisation with a
  straight-through gradient (kimi/precision/mxfp4.py), so `python -m kimi.convert to-hf ...
  mxfp4_experts=true` writes the experts whose dequantised forward is the trained one.

Parameters keep their names, shapes, dtype (fp32) and values, and their plain-tensor type except under
precision.fp8.fsdp_all_gather (torchao's fp32 weight subclass; its checkpoints still hold plain tensors,
fsdp_float8.py): the optimizer (MuonClip orthogonalises these masters, never a quantised copy), checkpoints
and QK-Clip (its max logits come from the forward's own q and k, so from the precision the forward used) see
the model they always saw.

The names below (kimi/precision/apply.py's) are imported on first use, so that importing the section's
torch-free config (kimi/precision/config.py, which kimi.config assembles) does not import torch.
"""

from typing import TYPE_CHECKING

from kimi import lazy_getattr

_WHERE = {"apply_low_precision": "apply", "emulated": "apply", "float8_gather": "apply", "targets": "apply"}
__all__ = sorted(_WHERE)


__getattr__ = lazy_getattr(__name__, _WHERE)


if TYPE_CHECKING:  # for type checkers: the names of __all__, which __getattr__ imports at run time
    from .apply import apply_low_precision, emulated, float8_gather, targets  # noqa: F401
