"""The fused Block AttnRes depth mix in Triton: online softmax over the sources, optionally followed by the
sublayer's pre-norm (RMSNorm with its weight), forward and backward, as torch custom ops.

Runs on CUDA tensors, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1 set before triton is
imported), which is how the tests check it without a GPU. Files: kernels.py (the two kernels and their math),
op.py (custom ops, autograd), common.py (checks). `python bench/attnres.py --compile-check` compiles both
kernels for sm_90 and sm_80 without a GPU.
"""

from .common import INTERPRET
from .op import attnres_mix, attnres_mix_bwd, depth_mix_triton

__all__ = ["INTERPRET", "attnres_mix", "attnres_mix_bwd", "depth_mix_triton"]
