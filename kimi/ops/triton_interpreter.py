"""A faster Triton interpreter for nested device-function calls (TRITON_INTERPRET=1: the tests, the GPU
check's dry run, Triton kernels on CPU tensors).

The interpreter remaps triton.language onto numpy once per kernel launch and restores it after. Every call
of a @triton.jit helper inside the kernel (our own helpers, and tl.sum, tl.zeros, tl.cdiv: they are
helpers of triton.language.standard) maps the language again, walking every member of the modules it
sees, and never restores those patches: about 2 ms a call, a quarter of an interpreted KDA check's time.
Inside a launch that mapping is already in place for every language module the launch or one of its
earlier nested calls saw, so `install()` skips the repeat and runs the original for the first call that
brings a module not mapped yet. What runs, and the state the language is left in, are the interpreter's.
Compiled kernels never reach this code.

`INTERPRET` is the switch every kernel package reads: triton.jit decides at decoration time whether kernels
are compiled or interpreted, from TRITON_INTERPRET, so it must be set before triton is imported.
"""

from __future__ import annotations

import functools
import inspect

import triton


class _Launch:
    """A kernel launch's patch scope, and the language modules mapped while it runs."""

    __slots__ = ("scope", "modules", "launches")

    def __init__(self, scope, modules: frozenset, launches: list):
        self.scope, self.modules, self.launches = scope, modules, launches

    def restore(self) -> None:
        try:
            self.scope.restore()
        finally:
            self.launches.remove(self)


def install() -> bool:
    """Wrap the interpreter's language patching (once per process); True when it is in place. A Triton whose
    interpreter lacks the function this wraps is left as it is."""
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    if original is None or not hasattr(interpreter, "tl"):
        return False
    if getattr(original, "kimi_nested_skip", False):
        return True
    languages = (interpreter.tl, interpreter.tl.core)
    launches: list[_Launch] = []

    @functools.lru_cache(maxsize=None)
    def modules(fn) -> frozenset:
        return frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages)

    def patch_lang(fn):
        seen = modules(fn)
        if not launches:  # a kernel launch: the interpreter restores this scope when the launch ends
            launch = _Launch(original(fn), seen, launches)
            launches.append(launch)
            return launch
        if seen <= launches[-1].modules:  # a nested call: what it would map is mapped
            return None  # (the interpreter drops a nested call's scope unread)
        launches[-1].modules |= seen
        return original(fn)

    patch_lang.kimi_nested_skip = True
    patch_lang.original = original
    interpreter._patch_lang = patch_lang
    return True


INTERPRET: bool = bool(triton.knobs.runtime.interpret)
if INTERPRET:
    install()
