"""Triton kernels for Kimi Delta Attention: chunkwise forward and backward (training, prefill) and a fused
recurrent step (decoding), registered as torch custom ops. kimi.ops.kda dispatches here for CUDA tensors
(backend="triton"); CPU tensors run here only under the Triton interpreter (TRITON_INTERPRET=1 before
triton is imported), which is how the tests check these kernels without a GPU.

Math, numerics: docs/algorithms.md section 1. Files: common.py (shared helpers), chunk_fwd.py, chunk_bwd.py,
recurrent.py, op.py (custom ops, autograd, the functions below).
"""

from .op import chunk_kda_triton, fused_recurrent_kda_triton

__all__ = ["chunk_kda_triton", "fused_recurrent_kda_triton"]
