"""Safe dispatch of the Triton kernels (kimi.ops.dispatch), on CPU: the Triton entry points the custom ops
call (kimi.ops.kda.triton.op.chunk_fwd / chunk_bwd / recurrent_fwd, kimi.ops.attention.triton.op
.attention_forward / attention_backward) are replaced by functions raising Triton's own error types, as an
unsupported GPU would. `auto` (backend=None; made to pick Triton for CPU tensors with
dispatch.AUTO_TRITON_ON_CPU) then falls back to the PyTorch path with one warning per op, giving exactly
the PyTorch path's outputs and gradients; a forced backend="triton" raises TritonKernelError instead."""

import ast
import warnings

import pytest
import torch
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

import kimi.ops.attention as attention_module
import kimi.ops.attention.triton.op as attn_op
import kimi.ops.kda as kda_ops
import kimi.ops.kda.triton.op as kda_op
from kimi.ops import dispatch
from kimi.ops.attention import attention
from kimi.ops.dispatch import TritonKernelError, is_triton_failure
import kimi.ops.kda.gate
from kimi.ops.kda import chunk_kda, fused_recurrent_kda
from kimi.ops.kda.gate import normalize_and_gate

pytestmark = pytest.mark.unit


def compile_error(*_, **__):
    raise CompilationError(None, ast.parse("x = 1").body[0], "unsupported MMA shape on this GPU")


def out_of_shared_memory(*_, **__):
    raise OutOfResources(300000, 232448, "shared memory")


def driver_error(*_, **__):
    raise RuntimeError("Triton Error [CUDA]: device kernel image is invalid")


@pytest.fixture(autouse=True)
def fresh_dispatch(monkeypatch):
    monkeypatch.setattr(dispatch, "AUTO_TRITON_ON_CPU", True)
    dispatch.reset()
    yield
    dispatch.reset()


def fallback_warnings(record, op):
    return [w for w in record
            if issubclass(w.category, RuntimeWarning) and str(w.message).startswith(op + ":")]


def kda_inputs(B=2, T=20, H=2, K=16, V=16, seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=gen)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, K, generator=gen)
    beta = torch.rand(B, T, H, generator=gen)
    h0 = torch.randn(B, H, K, V, generator=gen)
    return [x.requires_grad_(grad) for x in (q, k, v, g, beta, h0)]


def kda_run(fn, backend, inputs, w):
    """-> (o, state, grads of q, k, v, g, beta, h0) of a loss through both outputs."""
    q, k, v, g, beta, h0 = inputs
    o, state = fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)
    if not torch.is_grad_enabled() or not q.requires_grad:
        return o, state
    loss = (o * w[0]).sum() + (state * w[1]).sum()
    grads = torch.autograd.grad(loss, inputs)
    return (o.detach(), state.detach(), *grads)


def assert_identical(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("entry,error", [("chunk_fwd", compile_error), ("chunk_bwd", out_of_shared_memory),
                                         ("chunk_fwd", driver_error)])
def test_chunk_kda_auto_falls_back_once_with_pytorch_outputs_and_grads(monkeypatch, entry, error):
    monkeypatch.setattr(kda_op, entry, error)
    inputs = kda_inputs()
    w = (torch.randn(2, 20, 2, 16), torch.randn(2, 2, 16, 16))
    want = kda_run(chunk_kda, "chunk", inputs, w)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_identical(kda_run(chunk_kda, None, inputs, w), want)
    (warning,) = fallback_warnings(record, "chunk_kda")
    message = str(warning.message)
    assert "\n" not in message and "kda_chunk_" in message and "falling back to the PyTorch path" in message
    # the other op has not fallen back
    assert not kda_ops._RECURRENT_GUARD.failed


def test_chunk_kda_backward_failure_is_decided_before_the_forward(monkeypatch):
    """A backward kernel that cannot compile is found by the probe: no Triton forward enters the graph."""
    real_calls = []
    monkeypatch.setattr(kda_op, "chunk_bwd", out_of_shared_memory)
    real_fwd = kda_op.chunk_fwd
    monkeypatch.setattr(kda_op, "chunk_fwd", lambda *a: real_calls.append(1) or real_fwd(*a))
    inputs = kda_inputs(T=8)
    w = (torch.randn(2, 8, 2, 16), torch.randn(2, 2, 16, 16))
    with pytest.warns(RuntimeWarning, match=r"chunk_kda: Triton kernel kda_chunk_fwd/kda_chunk_bwd failed "
                                            r"\(OutOfResources: out of resource: shared memory"):
        got = kda_run(chunk_kda, None, inputs, w)
    assert len(real_calls) == 1  # the probe's forward only
    assert_identical(got, kda_run(chunk_kda, "chunk", inputs, w))


def test_chunk_kda_forward_failure_without_grad_falls_back(monkeypatch):
    monkeypatch.setattr(kda_op, "chunk_fwd", compile_error)
    inputs = kda_inputs(grad=False)
    want = kda_run(chunk_kda, "chunk", inputs, None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_identical(kda_run(chunk_kda, None, inputs, None), want)
    (warning,) = fallback_warnings(record, "chunk_kda")
    assert "kda_chunk_fwd failed (CompilationError: at 1:0: ... unsupported MMA shape" in str(warning.message)


def test_chunk_kda_forced_triton_raises_with_an_explanation(monkeypatch):
    monkeypatch.setattr(kda_op, "chunk_fwd", compile_error)
    inputs = kda_inputs(grad=False)
    expected = (r"chunk_kda: Triton kernel kda_chunk_fwd failed \(CompilationError"
                r".*forced.*kda\.backend=triton.*with auto this op would fall back")
    with pytest.raises(TritonKernelError, match=expected):
        kda_run(chunk_kda, "triton", inputs, None)


def test_chunk_kda_forced_triton_raises_a_backward_failure_at_forward_time(monkeypatch):
    monkeypatch.setattr(kda_op, "chunk_bwd", out_of_shared_memory)
    inputs = kda_inputs(T=8)
    expected = r"kda_chunk_fwd/kda_chunk_bwd failed \(OutOfResources"
    with pytest.raises(TritonKernelError, match=expected) as info:
        kda_run(chunk_kda, "triton", inputs, (torch.randn(2, 8, 2, 16), torch.randn(2, 2, 16, 16)))
    assert isinstance(info.value.__cause__, OutOfResources) and "\n" not in str(info.value)
    assert not kda_ops._CHUNK_GUARD.failed  # forced never records a fallback


@pytest.mark.slow
def test_half_precision_small_heads_on_hopper_are_refused_before_launch(monkeypatch):
    """On Hopper, bf16 KDA with head dims under 64 would fault in the kernels (common.HALF_MIN_ROW): the
    launch is refused (KernelUnsupported) before any kernel runs, so auto falls back to the PyTorch path with
    its exact outputs and gradients, and a forced backend says why. Hopper is simulated on CPU."""
    from kimi.ops.kda.triton import common

    monkeypatch.setattr(common, "narrow_operands_fault", lambda device: True)
    inputs = [x.detach().to(torch.bfloat16 if i < 3 else x.dtype).requires_grad_()
              for i, x in enumerate(kda_inputs(T=8))]
    w = (torch.randn(2, 8, 2, 16), torch.randn(2, 2, 16, 16))
    with pytest.warns(RuntimeWarning, match=r"KernelUnsupported: KDA backend='triton' with torch.bfloat16 "
                                            r"inputs on a Hopper GPU needs head dims of at least 64"):
        got = kda_run(chunk_kda, None, inputs, w)
    assert_identical(got, kda_run(chunk_kda, "chunk", inputs, w))
    with pytest.raises(TritonKernelError, match=r"K = 16, V = 16.*forced"):
        kda_run(chunk_kda, "triton", inputs, w)
    # fp32 inputs of the same shape are not narrow (64-byte rows of fp32 feed no tensor core as bf16)
    dispatch.reset()
    kda_run(chunk_kda, "triton", kda_inputs(T=8), w)


def test_hopper_tile_rules():
    """What the Hopper rule changes: half precision keeps 64-wide state blocks and multiplies chunk_bwd's
    32-wide key-block products as tf32x3; fp32 inputs and Ampere keep their tiles and precision."""
    from kimi.ops.kda.triton import common

    assert common.state_blocks(torch.bfloat16, hopper=True) == (64,)
    assert (common.state_blocks(torch.bfloat16, hopper=False) == common.state_blocks(torch.float32, True)
            == (32, 64))
    assert common.key_block_precision(1, 32, hopper=True) == 3 == common.key_block_precision(2, 32, True)
    assert common.key_block_precision(1, 32, hopper=False) == 1
    assert common.key_block_precision(1, 64, hopper=True) == 1
    assert common.key_block_precision(3, 32, hopper=True) == 3
    assert not common.narrow_operands_fault(torch.device("cpu"))


def test_fused_recurrent_kda_auto_falls_back(monkeypatch):
    monkeypatch.setattr(kda_op, "recurrent_fwd", driver_error)
    inputs = kda_inputs(T=1, grad=False)
    want = kda_run(fused_recurrent_kda, "recurrent", inputs, None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_identical(kda_run(fused_recurrent_kda, None, inputs, None), want)
    (warning,) = fallback_warnings(record, "fused_recurrent_kda")
    assert "kda_recurrent_fwd failed (RuntimeError: Triton Error [CUDA]" in str(warning.message)
    with pytest.raises(TritonKernelError, match="kda_recurrent_fwd"):
        kda_run(fused_recurrent_kda, "triton", inputs, None)


def test_our_own_errors_are_not_swallowed(monkeypatch):
    def own_check(*_):
        raise RuntimeError("a kimi check failed")

    monkeypatch.setattr(kda_op, "chunk_fwd", own_check)
    inputs = kda_inputs(grad=False)
    with pytest.raises(RuntimeError, match="a kimi check failed"):
        kda_run(chunk_kda, None, inputs, None)
    assert not kda_ops._CHUNK_GUARD.failed
    q, k, v, g, beta, h0 = inputs
    with pytest.raises(ValueError, match="beta must be"):
        chunk_kda(q, k, v, g, beta[..., :1])


def test_is_triton_failure():
    for error in (compile_error, out_of_shared_memory, driver_error):
        with pytest.raises(Exception) as info:
            error()
        assert is_triton_failure(info.value)
    assert is_triton_failure(ModuleNotFoundError("No module named 'triton'", name="triton"))
    assert not is_triton_failure(RuntimeError("CUDA out of memory"))
    assert not is_triton_failure(ValueError("bad shape"))
    assert not is_triton_failure(TritonKernelError("already explained"))
    assert is_triton_failure(dispatch.KernelUnsupported("a launch known to fault on this GPU"))


# the KDA layer's fused l2norm and gate kernels


class FailingLaunch:
    """Stands in for a @triton.jit kernel: `kernel[grid](...)` raises `error` as a failed launch would."""

    def __init__(self, error):
        self.error = error

    def __getitem__(self, grid):
        return self.error


def gate_inputs(seed=0, grad=True):
    gen = torch.Generator().manual_seed(seed)
    q, k, f = (torch.randn(2, 6, 2, 16, generator=gen) for _ in range(3))
    A_log, dt_bias = torch.randn(2, generator=gen), torch.randn(32, generator=gen)
    return [x.requires_grad_(grad) for x in (q, k, f, A_log, dt_bias)]


def gate_run(backend, inputs):
    q, k, g = normalize_and_gate(*inputs, backend=backend)
    outputs = (q, k, g)
    if not inputs[0].requires_grad:
        return outputs
    w = [torch.randn(x.shape, generator=torch.Generator().manual_seed(i)) for i, x in enumerate(outputs)]
    grads = torch.autograd.grad(sum((x * c).sum() for x, c in zip(outputs, w)), inputs)
    return (*(x.detach() for x in outputs), *grads)


@pytest.mark.parametrize("kernel", ["l2norm_fwd_kernel", "gate_bwd_kernel"])
def test_gate_and_l2norm_auto_fall_back_and_forced_raises(monkeypatch, kernel):
    """A failing forward or backward kernel: auto gives the PyTorch formulas' outputs and gradients (the
    backward found by the probe, before any Triton output enters the graph), forced raises."""
    import kimi.ops.kda.triton.gate as gate_kernels

    inputs = gate_inputs()
    want = gate_run("chunk", inputs)
    monkeypatch.setattr(gate_kernels, kernel, FailingLaunch(out_of_shared_memory))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(2):
            got = gate_run(None, inputs)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
    (warning,) = fallback_warnings(record, "kda_gate/l2norm")
    assert "OutOfResources" in str(warning.message) and "falling back" in str(warning.message)
    dispatch.reset()
    with pytest.raises(TritonKernelError, match=r"kda_gate/l2norm.*forced.*kda\.backend=triton"):
        gate_run("triton", inputs)


def test_gate_and_l2norm_triton_path_matches_pytorch():
    """Without failures auto runs the fused kernels (interpreted here): same values to fp32 rounding."""
    inputs = gate_inputs(seed=3)
    for a, b in zip(gate_run(None, inputs), gate_run("chunk", inputs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert not kimi.ops.kda.gate._GUARD.failed


# attention: auto picks Triton for fp16/bf16 only


def attn_inputs(dtype=torch.bfloat16, grad=True):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 24, 4, 32, generator=gen)
    k = torch.randn(2, 24, 2, 32, generator=gen)
    v = torch.randn(2, 24, 2, 16, generator=gen)
    return [x.to(dtype).requires_grad_(grad) for x in (q, k, v)]


def attn_run(backend, inputs, w):
    o, max_logits = attention(*inputs, causal=True, return_max_logits=True, backend=backend)
    if not inputs[0].requires_grad:
        return o, max_logits
    return (o.detach(), max_logits, *torch.autograd.grad((o.float() * w).sum(), inputs))


@pytest.mark.parametrize("entry,error,grad", [("attention_forward", compile_error, False),
                                              ("attention_forward", driver_error, True),
                                              ("attention_backward", out_of_shared_memory, True)])
def test_attention_auto_falls_back_once(monkeypatch, entry, error, grad):
    monkeypatch.setattr(attn_op, entry, error)
    inputs, w = attn_inputs(grad=grad), torch.randn(2, 24, 4, 16)
    want = attn_run("sdpa", inputs, w)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_identical(attn_run(None, inputs, w), want)
    (warning,) = fallback_warnings(record, "attention")
    assert "Triton kernel flash_attention" in str(warning.message) and "\n" not in str(warning.message)


def test_attention_forced_triton_raises(monkeypatch):
    monkeypatch.setattr(attn_op, "attention_backward", out_of_shared_memory)
    expected = (r"attention: Triton kernel flash_attention/flash_attention_backward "
                r"failed \(OutOfResources.*with auto this op would fall back")
    with pytest.raises(TritonKernelError, match=expected):
        attn_run("triton", attn_inputs(), torch.randn(2, 24, 4, 16))
    monkeypatch.setattr(attn_op, "attention_forward", compile_error)
    with pytest.raises(TritonKernelError, match=r"flash_attention failed \(CompilationError"):
        attn_run("triton", attn_inputs(grad=False), None)


@pytest.mark.slow
def test_working_kernels_pass_the_probe_without_warning():
    """No failure: auto runs the (interpreted) Triton kernels, probes once, warns never."""
    inputs, w = attn_inputs(), torch.randn(2, 24, 4, 16)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        got = attn_run(None, inputs, w)
        attn_run(None, inputs, w)
    assert not fallback_warnings(record, "attention")
    assert len(attention_module._GUARD.probed) == 1 and not attention_module._GUARD.failed
    want = attn_run("sdpa", inputs, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)
