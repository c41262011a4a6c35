"""Safe dispatch to the Triton kernels: with the backend left to `auto` (backend=None), a Triton kernel that
fails to compile or launch on this machine sends its op to the PyTorch path for the rest of the process,
with one warning per op; with the Triton backend forced, the same failure is an error that says so.

What counts as a Triton failure (`is_triton_failure`): any triton.errors.TritonError (CompilationError,
OutOfResources, PTXASError, AutotunerError, ...), and a RuntimeError or ImportError raised from inside the
triton package or carrying the driver's "Triton Error [...]" prefix (launch failures, a Triton/driver
mismatch, triton missing). Our own argument checks (ValueError, TypeError, and the RuntimeErrors raised by
kimi code such as "CPU tensors need TRITON_INTERPRET=1") are not failures of the kernel: they propagate.

Backward failures: the op is decided at forward time. The Triton kernels are torch custom ops whose backward
lives in their registered autograd formula; by the time a backward kernel fails, the forward's inputs are held
only as that node's saved tensors (possibly packed by activation checkpointing), so recomputing the gradient
with PyTorch there would mean keeping a second reference to every input outside autograd (memory, and a clash
with checkpointing). Instead, before the first Triton forward of a configuration that will need gradients
(dtypes, head dims, flags: see each op's `probe key`), `Guard.probe` compiles and launches the forward AND
backward kernels once on a tiny input of that configuration, outside autograd (under no_grad, so no saved
tensors) and outside any dispatch mode (`aside`: selective checkpointing's would take the probe's outputs for
the step's); on fake tensors (a planner's trace) it does not probe. If either fails, the op falls back before
any Triton output enters the graph, and the gradients are the PyTorch path's exactly. Compile-time failures
(the common case: an unsupported GPU, out of shared memory, a ptxas/driver mismatch) depend on the dtypes and
tile sizes, not on the sequence length, so the probe sees them. A backward failure that only the full-size
launch hits still raises.

Not covered: a kernel that faults while it runs (an illegal memory access) leaves the CUDA context unusable,
so nothing can fall back after it; `make gpu-check` is what finds those, and launches known to fault are
refused before they start (KernelUnsupported). Inside torch.compile (trainer.compile=true) the kernels run
inside the compiled graph where no Python handler sees their errors; the dispatch then follows the state
reached so far in eager calls.
Guarded ops: chunk_kda, fused_recurrent_kda (kimi.ops.kda), the KDA layer's fused l2norm and gate
(kimi.ops.kda.gate.normalize_and_gate), attention (kimi.ops.attention) and the fused AttnRes depth mix
(kimi.ops.attnres).

Tests: `AUTO_TRITON_ON_CPU = True` makes `auto` choose the Triton kernels for CPU tensors too (they run under
TRITON_INTERPRET=1), and `reset()` forgets every fallback and probe.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import warnings
from typing import Callable, Hashable

import torch

# Tests only: let auto pick Triton for CPU tensors (interpreted), so the fallback can be shown without a GPU.
AUTO_TRITON_ON_CPU = False


def is_fake(t: torch.Tensor) -> bool:
    """A fake tensor (FakeTensorMode: shapes and dtypes only, as kimi/plan/activations.py traces a run): the
    custom ops run their fake implementations on it, so no kernel needs its device. Also one wrapped for a
    trace (AOTAutograd's functional tensors over fake ones: kimi/plan/compiled.py)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.fake_tensor import is_fake as wrapped_fake

    if isinstance(t, FakeTensor):
        return True
    # dynamo does not trace torch's is_fake (it stops a fullgraph compile), and needs no answer: there the
    # check sees the tensors dynamo traces, as an eager call would
    return not torch.compiler.is_compiling() and wrapped_fake(t)


def auto_picks_triton(device: torch.device) -> bool:
    """Whether `auto` (backend=None) prefers the Triton kernels for tensors on this device."""
    return device.type == "cuda" or (AUTO_TRITON_ON_CPU and device.type == "cpu")


class TritonKernelError(RuntimeError):
    """A Triton kernel failed with its backend forced to Triton (with auto the op would have fallen back)."""


class KernelUnsupported(RuntimeError):
    """Raised by our host code before a launch that is known to go wrong on this GPU (a compiler bug, not a
    bad argument): a Triton failure, so auto falls back and a forced backend says why."""


def _triton_dir() -> str | None:
    spec = importlib.util.find_spec("triton")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0]) + os.sep


_TRITON_DIR = _triton_dir()


def _raised_inside_triton(exc: BaseException) -> bool:
    if _TRITON_DIR is None:
        return False
    tb = exc.__traceback__
    while tb is not None:
        if os.path.realpath(tb.tb_frame.f_code.co_filename).startswith(_TRITON_DIR):
            return True
        tb = tb.tb_next
    return False


def is_triton_failure(exc: BaseException) -> bool:
    """A compile or launch failure of a Triton kernel (module docstring), not an error of our own checks."""
    try:
        from triton.errors import TritonError
    except Exception:  # triton missing or broken: nothing can be a TritonError
        TritonError = ()
    if (TritonError and isinstance(exc, TritonError)) or isinstance(exc, KernelUnsupported):
        return True
    if isinstance(exc, ImportError) and (exc.name or "").split(".")[0] == "triton":
        return True
    if isinstance(exc, (RuntimeError, ImportError)) and not isinstance(exc, TritonKernelError):
        return str(exc).startswith("Triton Error") or _raised_inside_triton(exc)
    return False


def describe(exc: BaseException) -> str:
    """`Type: message` in one line: a multi-line Triton message (a CompilationError's "at 12:4:", source
    excerpt, then the error) keeps its first and last lines, and at most 300 characters."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = "(no message)" if not lines else lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}"


class Guard:
    """The fallback state of one op (e.g. chunk_kda): whether it has fallen back, which probes passed."""

    def __init__(self, op: str, forced_hint: str):
        self.op = op
        self.forced_hint = forced_hint  # how the user forced Triton, for the error message
        self.failed = False
        self.reason = ""
        self.probed: set[Hashable] = set()
        _GUARDS.append(self)

    def reset(self) -> None:
        self.failed, self.reason = False, ""
        self.probed.clear()

    def _fail(self, kernel: str, exc: BaseException, forced: bool) -> None:
        if forced:
            raise TritonKernelError(
                f"{self.op}: Triton kernel {kernel} failed ({describe(exc)}); the Triton backend is forced "
                f"({self.forced_hint}): with auto this op would fall back to its PyTorch path") from exc
        if not self.failed:  # one warning per op and process
            self.failed, self.reason = True, f"{kernel}: {describe(exc)}"
            warnings.warn(f"{self.op}: Triton kernel {kernel} failed ({describe(exc)}); falling back to the "
                          f"PyTorch path for the rest of the process", RuntimeWarning, stacklevel=4)

    def use_triton(self, forced: bool) -> bool:
        """False once an auto op has fallen back (a forced op always tries Triton)."""
        return forced or not self.failed

    def probe(self, key: Hashable, kernels: str, run: Callable[[], object], forced: bool) -> bool:
        """Run `run` (the forward and backward kernels on a tiny input) once per key; False: fallen back."""
        if key in self.probed or torch.compiler.is_compiling():
            return True
        from torch._guards import detect_fake_mode

        if detect_fake_mode() is not None:  # a trace of shapes (kimi.plan): fake kernels, nothing to probe
            return True
        try:
            with torch.no_grad(), aside():
                run()
        except Exception as exc:
            if not is_triton_failure(exc):
                raise
            self._fail(kernels, exc, forced)
            return False
        self.probed.add(key)
        return True

    def call(self, kernel: str, triton_fn: Callable, torch_fn: Callable, forced: bool, *args):
        """triton_fn(*args); on a Triton failure torch_fn(*args) (auto) or TritonKernelError (forced)."""
        if torch.compiler.is_compiling():
            return triton_fn(*args)
        try:
            return triton_fn(*args)
        except Exception as exc:
            if not is_triton_failure(exc):
                raise
            self._fail(kernel, exc, forced)
        return torch_fn(*args)


_GUARDS: list[Guard] = []


def reset() -> None:
    """Forget every op's fallback and probes (tests)."""
    for guard in _GUARDS:
        guard.reset()


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


@contextlib.contextmanager
def aside():
    """A context for work beside the step (a kernel's probe, the attention's auto timing, which runs a
    forward and backward of its own): outside every dispatch mode and activation checkpointing's
    saved-tensor hooks. Selective checkpointing's mode keeps the outputs of the ops it saves, in order, and
    hands them to the recompute: a side run's outputs kept there would stand in for the step's (an error
    where the shapes differ, wrong gradients where they agree). Checkpointing's hooks would take the side
    run's saved tensors for the region's, and its backward would stop in a recompute of the region. And a
    counter (FLOPs, memory, collectives) would count the side run as the step's."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.autograd.graph.saved_tensors_hooks(_same, _same):
        yield


def needs_grad(*tensors: torch.Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
