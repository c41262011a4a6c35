"""The planner's traces kept on disk between commands (kimi/plan/disk_cache.py): read back equal to a fresh
trace, traced anew under other code (whose entries then go), never written by a library call, and a damaged
entry traced again."""

import json

import pytest
import torch
from helpers import tiny_model_cfg

from kimi.plan import activations, disk_cache, optimizer_step

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(monkeypatch):
    """Empty in-memory caches, and a count of the traces made."""
    monkeypatch.setattr(activations, "_CACHE", {})
    made = []
    trace = activations._trace
    monkeypatch.setattr(activations, "_trace", lambda *a: made.append(a) or trace(*a))
    return made


def test_a_trace_read_back_equals_the_traced_one(tmp_path, fresh, monkeypatch):
    m = tiny_model_cfg(num_layers=2)
    with disk_cache.enabled(tmp_path):
        first = activations.trace(m, "none")
    made = len(fresh)
    assert made == 1 and [p.name.split("-")[1] for p in tmp_path.iterdir()] == ["activations"]
    monkeypatch.setattr(activations, "_CACHE", {})  # another command: only the disk remembers
    with disk_cache.enabled(tmp_path):
        again = activations.trace(m, "none")
    assert len(fresh) == made and again == first  # the same tuples and lists, float for float
    assert isinstance(again.first, tuple) and isinstance(again.blocks[0], tuple) and again.extra > 0


def test_a_library_call_writes_nothing_and_a_damaged_entry_is_traced_again(tmp_path, fresh, monkeypatch):
    m = tiny_model_cfg(num_layers=2)
    activations.trace(m, "full")  # no enabled(): memory only
    assert len(fresh) == 1 and list(tmp_path.iterdir()) == []
    monkeypatch.setattr(activations, "_CACHE", {})
    with disk_cache.enabled(tmp_path):
        first = activations.trace(m, "full")
    (entry,) = tmp_path.iterdir()
    entry.write_text(entry.read_text()[:40])  # cut short, as by a killed command
    monkeypatch.setattr(activations, "_CACHE", {})
    with disk_cache.enabled(tmp_path):
        assert activations.trace(m, "full") == first
    assert len(fresh) == 3 and json.loads(entry.read_text())["key"]  # rewritten whole


def test_the_optimizer_steps_trace_is_kept_and_traced_anew_under_other_code(tmp_path, monkeypatch):
    from test_plan_models import config

    cfg = config()
    made, trace = [], optimizer_step._trace
    monkeypatch.setattr(optimizer_step, "_trace", lambda *a: made.append(a) or trace(*a))
    got = []
    for code in ("a" * 64, "a" * 64, "b" * 64):  # this code twice, then other code (or another torch)
        monkeypatch.setattr(optimizer_step, "_CACHE", {})  # each a new command
        monkeypatch.setattr(disk_cache, "fingerprint", lambda: code)
        with disk_cache.enabled(tmp_path):
            got.append(optimizer_step._traced(cfg))
    assert isinstance(got[1], tuple) and got[0] == got[1] == got[2]
    (kept,) = tmp_path.iterdir()  # the old code's entry removed when the new code's was written
    assert len(made) == 2 and kept.name.startswith("b" * 16 + "-optimizer_step-")


def test_the_fingerprint_follows_every_source_file(tmp_path, monkeypatch):
    (tmp_path / "ops").mkdir()
    for name in ("a.py", "ops/b.py"):
        (tmp_path / name).write_text("x = 1\n")
    monkeypatch.setattr(disk_cache, "PACKAGE", tmp_path)

    def now() -> str:
        disk_cache.fingerprint.cache_clear()
        return disk_cache.fingerprint()

    try:
        first = now()
        (tmp_path / "ops" / "b.py").write_text("x = 2\n")
        second = now()
        (tmp_path / "notes.txt").write_text("not code")
        assert first != second == now()
        monkeypatch.setattr(torch, "__version__", "0.0")
        assert now() != second
    finally:
        monkeypatch.undo()
        disk_cache.fingerprint.cache_clear()
