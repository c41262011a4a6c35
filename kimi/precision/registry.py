"""Precisions by their trainer.precision name: adding one is a class following :class:`Precision` and one line
in ``PRECISIONS``, whose names are trainer.precision's allowed values (kimi.schema.run.PRECISIONS). Callers
ask :func:`precision_for` and never compare trainer.precision with a name.
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Dict, Optional, Tuple

from kimi.precision.config import PrecisionConfig
from kimi.schema.run import PRECISIONS as _TABLE
from kimi.schema.vocabulary import check


class Precision:
    """One trainer.precision. Weights, gradients and optimizer state stay fp32 under every one; what differs:

      BF16          the model computes under bf16 autocast (else fp32); FSDP gathers the weights in it
      ALIGN         > 0: the large block projections are converted (kimi.precision.apply_low_precision,
                    torchao), each of their dimensions and the tokens of one forward a multiple of ALIGN;
                    0: nothing is converted
      NATIVE_FROM   the compute capability of the first GPUs with the converted matmuls
      FSDP_GATHER   precision.fp8.fsdp_all_gather can gather its converted weights in their format
      converter(p, emulate, fsdp_gather)
                    the function that converts one nn.Linear (only where ALIGN > 0)
    """

    BF16: ClassVar[bool] = False
    ALIGN: ClassVar[int] = 0
    NATIVE_FROM: ClassVar[Optional[Tuple[int, int]]] = None
    FSDP_GATHER: ClassVar[bool] = False

    def __init__(self, name: str):
        self.name = name

    @property
    def converts(self) -> bool:
        return self.ALIGN > 0

    def compute_name(self) -> str:
        """The dtype of the model's compute outside converted projections (and of FSDP's gathered copies)."""
        return "bf16" if self.BF16 else "fp32"

    def compute_bytes(self) -> int:
        return 2 if self.BF16 else 4

    def compute_dtype(self):
        """The same as a torch dtype (what a CPU's matmul rate is measured in, kimi.run.peaks)."""
        import torch

        return torch.bfloat16 if self.BF16 else torch.float32

    def converter(self, p: PrecisionConfig, emulate: bool, fsdp_gather: bool) -> Callable[[Any], Any]:
        raise NotImplementedError(f"trainer.precision={self.name} converts no projection")


class Fp32(Precision):
    pass


class Bf16(Precision):
    BF16 = True


class Fp8(Precision):
    """torchao's fp8 linears (precision.fp8.recipe), the rest of the model as bf16 runs it."""

    BF16, ALIGN, NATIVE_FROM, FSDP_GATHER = True, 16, (8, 9), True  # the fp8 GEMM's multiples of 16

    def converter(self, p, emulate, fsdp_gather):
        from . import linear

        config = linear.fp8_config(p.fp8.recipe, emulate, fsdp_gather)
        return lambda m: linear.to_fp8(m, config)


class Mxfp8(Precision):
    """MXFP8 linears (one E8M0 scale per block of 32 along the reduced dimension), the rest as bf16."""

    BF16, ALIGN, NATIVE_FROM = True, 32, (10, 0)

    def converter(self, p, emulate, fsdp_gather):
        from . import linear

        return lambda m: linear.to_mxfp8(m, emulate)


# The table is kimi.schema.run.PRECISIONS itself, the values validate() allows for trainer.precision: the
# config is imported first and cannot import this module, so the entries are made here.
PRECISIONS: Dict[str, type] = _TABLE
PRECISIONS.update({"fp32": Fp32, "bf16": Bf16, "fp8": Fp8, "mxfp8": Mxfp8})


def precision_for(name: str) -> Precision:
    """trainer.precision's class, for the name `name`."""
    check(name in PRECISIONS, "trainer.precision", name, f"choose one of {'|'.join(PRECISIONS)}")
    return PRECISIONS[name](name)


def names_where(test: Callable[[Precision], bool]) -> list:
    """The precisions for which `test` holds, in table order (for messages)."""
    return [name for name in PRECISIONS if test(precision_for(name))]
