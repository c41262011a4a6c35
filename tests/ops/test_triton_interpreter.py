"""kimi.ops.triton_interpreter: nested device-function calls under the Triton interpreter skip mapping the
language again once it is mapped, and a kernel computes and leaves triton.language as the interpreter alone
does (conftest sets TRITON_INTERPRET=1)."""

import sys

import pytest
import torch

pytestmark = pytest.mark.unit

if sys.platform != "linux":  # elsewhere there is no triton to import (pyproject.toml)
    pytest.skip("triton is a dependency on Linux only", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

from kimi.ops import triton_interpreter  # noqa: E402


@triton.jit
def _scaled_row_sum(x, scale):  # a helper of ours, calling one of triton.language.standard's (tl.sum)
    return tl.sum(x, axis=0) * scale


@triton.jit
def _row_sums(x_ptr, out_ptr, N: tl.constexpr, REPEAT: tl.constexpr):
    row = tl.program_id(0)
    x = tl.load(x_ptr + row * N + tl.arange(0, N))
    acc = tl.zeros([1], dtype=tl.float32)
    for i in range(REPEAT):
        acc += _scaled_row_sum(x, i + 1.0)
    tl.store(out_ptr + row + tl.arange(0, 1), acc)


def _run(monkeypatch, original, wrapped: bool) -> tuple[torch.Tensor, int, dict]:
    """The kernel's output, how often the interpreter's own patching (`original`) ran, and triton.language
    after."""
    calls = 0

    def counted(fn):
        nonlocal calls
        calls += 1
        return original(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", counted)
    if wrapped:
        assert triton_interpreter.install()
    x = torch.arange(24, dtype=torch.float32).reshape(3, 8) / 7
    out = torch.zeros(3)
    _row_sums[(3,)](x, out, N=8, REPEAT=5)
    return out, calls, {name: getattr(tl, name) for name in dir(tl)}


def test_nested_calls_map_the_language_once_per_launch_and_compute_alike(monkeypatch):
    assert interpreter._patch_lang.kimi_nested_skip  # installed on import under the interpreter
    original = interpreter._patch_lang.original
    plain, plain_calls, plain_lang = _run(monkeypatch, original, wrapped=False)
    fast, fast_calls, fast_lang = _run(monkeypatch, original, wrapped=True)
    want = torch.arange(24, dtype=torch.float64).reshape(3, 8).sum(1) / 7 * 15  # 1 + 2 + ... + 5
    torch.testing.assert_close(plain.double(), want)
    assert torch.equal(fast, plain)
    # per program 5 calls of ours, 5 of tl.sum and one of tl.zeros, after the launch's own
    assert plain_calls == 1 + 3 * 11
    assert fast_calls == 2  # the launch, and the first call into triton.language.standard (tl.core)
    assert fast_lang == plain_lang  # the language as the interpreter restores it
