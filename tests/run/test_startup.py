"""A command's start-up: train.py imports torch and the trainer with Python's cyclic garbage collector paused
and then freezes what the imports made (kimi.cli.import_frozen), so no full collection walks those objects
again; a process that has torch already (pytest, a test calling train.cli()) is left as it is."""

import gc
import subprocess
import sys
import textwrap

import pytest

from kimi.cli import import_frozen

pytestmark = pytest.mark.e2e

FRESH = textwrap.dedent("""
    import gc, sys
    full = []
    gc.callbacks.append(lambda phase, info: phase == "stop" and info["generation"] == 2 and full.append(1))
    from kimi.cli import import_frozen
    import_frozen("kimi.trainer")
    frozen = gc.get_freeze_count()
    import_frozen("kimi.generate")  # torch is there now: imported as usual, nothing more frozen
    print(len(full), frozen, gc.get_freeze_count() - frozen, gc.isenabled(), "torch" in sys.modules)
""")


def test_a_fresh_process_imports_without_full_collections_freezes_them_and_exits_clean():
    proc = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    full, frozen, more, enabled, torch = proc.stdout.split()
    # without the pause, importing the trainer runs five full collections (0.43 s on 2 cores)
    assert (int(full), int(more), enabled, torch) == (0, 0, "True", "True")
    assert int(frozen) > 100_000  # torch, DCP, dynamo: about 400k objects
    # unfrozen at exit: the interpreter's teardown frees them (triton's bindings would report leaks)
    assert "leaked" not in proc.stderr, proc.stderr[-3000:]


def test_a_process_with_torch_already_imports_as_usual():
    frozen, enabled = gc.get_freeze_count(), gc.isenabled()
    import_frozen("kimi.trainer")
    assert (gc.get_freeze_count(), gc.isenabled()) == (frozen, enabled)
