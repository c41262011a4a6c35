"""torchao's float8 all-gather under FSDP2 (precision.fp8.fsdp_all_gather, tensorwise; docs/precision.md).

torchao's Float8Linear wraps each converted weight in ``WeightWithDynamicFloat8CastTensor``: an fp32 tensor
subclass whose FSDP2 hooks cast this rank's shard to e4m3 before the all-gather, with the amax of the whole
weight (all-reduced over the FSDP mesh, or precomputed for all weights in one all-reduce after the update:
``refresh_scales``), and hand the layer the gathered fp8 weight and its scale. The gather moves 1 byte per
element instead of bf16's 2. The fp32 masters stay where they were; what this module adds around them:

* gloo has no fp8 type. FSDP2 gathers a unit whose inputs are all fp8 in that dtype, so on CPU the units
  gather the same bytes viewed as uint8 (NCCL takes fp8 as it is).
* The subclass is only the FSDP-facing skin of the fp32 master: checkpoints (``plain``) hold the plain tensor
  under the unchanged names, so they load into any layout and precision.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor


class ByteAllGather:
    """FSDP2's all-gather comm (``FSDPModule.set_custom_all_gather``) over the buffers' bytes."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False):
        return dist.all_gather_single(output_tensor.view(torch.uint8), input_tensor.view(torch.uint8),
                                      group=group, async_op=async_op)


class Float8Gather:
    """The engine's hooks around the float8 gather (kimi/parallel/engine.py)."""

    def __init__(self) -> None:
        self.weights: list[str] = []  # the parameters FSDP gathers as fp8 (attach)

    def attach(self, parts: list[nn.Module], device: torch.device) -> None:
        """After fully_shard and materialisation: on CPU, every FSDP unit gathers bytes (gloo has no fp8)."""
        self.weights = [n for part in parts for n, p in part.named_parameters() if _wrapped(p)]
        if device.type == "cpu":
            for unit in (m for part in parts for m in part.modules() if isinstance(m, FSDPModule)):
                unit.set_custom_all_gather(ByteAllGather())

    @staticmethod
    def refresh_scales(model: nn.Module) -> None:
        """Every float8-gathered weight's scale from its current value, in one all-reduce (collective): after
        each change of the weights (the update and QK-Clip, a loaded checkpoint). It is the scale the gather
        would otherwise all-reduce for each weight on its own."""
        precompute_float8_dynamic_scale_for_fsdp(model)

    @staticmethod
    def plain(state):
        """A (model or optimizer) state dict with each float8-gather weight as the fp32 tensor it wraps (the
        same storage, so loading into it loads the weight; a DTensor stays a DTensor)."""
        if isinstance(state, dict):
            return {k: Float8Gather.plain(v) for k, v in state.items()}
        if isinstance(state, DTensor) and _wrapped(state):
            return DTensor.from_local(state.to_local()._tensor, state.device_mesh, state.placements,
                                      run_check=False, shape=state.shape, stride=state.stride())
        return state._tensor if _wrapped(state) else state


def _wrapped(t) -> bool:
    local = t.to_local() if isinstance(t, DTensor) else t
    return isinstance(local, WeightWithDynamicFloat8CastTensor)
