"""kimi.plan.cuda_autocast: CPU autocast made to cast as CUDA's does, for a GPU run's activation trace. Its
lists are held to the installed torch's own (ATen/autocast_mode.h, the lists CUDA's autocast kernels are
built from), and its casts to what those lists mean: fp32 ops compute in fp32, the fp32-output ops return
fp32, the matmuls stay in bf16, gradients flow, and leaving the context gives CPU autocast back."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from kimi.plan import cuda_autocast

HEADER = Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h"


def header_list(macro: str) -> tuple:
    """The entries of one AT_FORALL_* list of the header, as "op" or "op.overload"."""
    text = HEADER.read_text()
    body = re.search(rf"#define {macro}\(_\)(.*?)\n\n", text, re.S).group(1)
    return tuple(".".join(part.strip() for part in entry.split(","))
                 for entry in re.findall(r"_\(([^)]*)\)", body))


@pytest.mark.unit
def test_the_lists_are_the_installed_torchs():
    if not HEADER.exists():  # a torch installed without its C++ headers: nothing to compare with
        pytest.skip(f"{HEADER} is not installed with this torch")
    assert cuda_autocast.FP32 == header_list("AT_FORALL_FP32")
    assert cuda_autocast.FP32_OUTPUT == header_list("AT_FORALL_FP32_SET_OPT_DTYPE")
    assert cuda_autocast.PROMOTE == header_list("AT_FORALL_PROMOTE")


def dtypes() -> dict:
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = x @ w
        out = {"mm": y, "exp": torch.exp(y), "softmax": torch.softmax(y, -1), "sum": y.sum(),
               "rms_norm": torch.nn.functional.rms_norm(y, (8,)), "pow": y.pow(2),
               "silu": torch.nn.functional.silu(y), "addcmul": torch.addcmul(y, y, y.float())}
    loss = sum(v.float().sum() for v in out.values())
    loss.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
    return {k: v.dtype for k, v in out.items()}


@pytest.mark.unit
def test_cpu_autocast_casts_as_cudas_inside_the_context_only():
    cpu = dtypes()
    assert set(cpu.values()) == {torch.bfloat16, torch.float32} and cpu["exp"] == torch.bfloat16
    with cuda_autocast.cuda_policy():
        cuda = dtypes()
    fp32 = torch.float32
    assert cuda == {"mm": torch.bfloat16, "exp": fp32, "softmax": fp32, "sum": fp32, "rms_norm": fp32,
                    "pow": fp32, "silu": torch.bfloat16, "addcmul": fp32}
    assert dtypes() == cpu  # CPU autocast's own kernels again
