"""Preparing in parts (kimi/data/prepare/parts.py, merge.py, executor.py): N workers over a split of the files
and one merge give the bytes of the single-process preparation (shards, document index, manifest, tokenizer),
through the explicit worker numbers and through datatrove's local executor; a killed worker is rerun alone;
the merge refuses, in one line, while a part is missing."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from helpers import ROOT
from prepare_problem import prepare, prepare_overrides, prepared_dir, uneven_corpus

pytestmark = pytest.mark.e2e  # the prepare command's body, in process and as a command

WORKERS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, offline):
    return uneven_corpus(tmp_path_factory.mktemp("workers") / "corpus")


def _files(data_dir):
    """Every file the preparation leaves (the lock aside), by name: shards, indexes, metadata, manifest,
    tokenizer; and nothing else (the parts are gone)."""
    return {p.name: p.read_bytes() for p in data_dir.iterdir() if p.name != ".lock"}


@pytest.fixture(scope="module")
def single(corpus, tmp_path_factory):
    """The single-process preparation's files."""
    overrides = prepare_overrides(corpus, tmp_path_factory.mktemp("single"))
    assert prepare(*overrides) == 0
    files = _files(prepared_dir(overrides))
    assert sum(name.startswith("train-") and name.endswith(".bin") for name in files) > 3
    assert sum(name.startswith("val-") and name.endswith(".bin") for name in files) > 1
    return files


def _same(files, single):
    assert sorted(files) == sorted(single)
    for name in single:
        assert files[name] == single[name], f"{name} differs from the single-process preparation"


def test_the_split_is_deterministic_by_file_and_balanced():
    from kimi.data.prepare.parts import assign

    sizes = [50, 10, 40, 10, 30, 20, 5]
    owner = assign(sizes, 3)
    assert owner == assign(sizes, 3)
    loads = [sum(s for s, w in zip(sizes, owner) if w == k) for k in range(3)]
    assert max(loads) - min(loads) <= 10 and sorted(set(owner)) == [0, 1, 2]
    assert assign([7] * 5, 8)[:5] == [0, 1, 2, 3, 4]  # more workers than files: some have none


def test_explicit_workers_give_the_single_process_bytes(corpus, single, tmp_path, capsys):
    overrides = [*prepare_overrides(corpus, tmp_path), f"data.prepare_workers={WORKERS}"]
    assert prepare(*overrides) == 0  # no worker number, no tokenizer yet: it trains the tokenizer, once
    assert "tokenizer ready" in capsys.readouterr().out
    for i in (3, 1, 0, 2):  # any order, as independent jobs would finish
        assert prepare(*overrides, f"data.prepare_worker={i}") == 0
        out = capsys.readouterr().out
        assert f"[data] worker {i}/{WORKERS}: file 1/" in out and "tokens/s" in out
    assert prepare(*overrides) == 0  # the merge
    out = capsys.readouterr().out
    assert f"[data] parts: {WORKERS}/{WORKERS} workers done" in out and "[data] ready:" in out
    _same(_files(prepared_dir(overrides)), single)


def test_a_killed_worker_is_rerun_alone_and_the_merge_refuses_until_then(corpus, single, tmp_path):
    from kimi.data import DataError
    from kimi.data.prepare.parts import parts_dir, worker_dir

    overrides = [*prepare_overrides(corpus, tmp_path), f"data.prepare_workers={WORKERS}"]
    prepare(*overrides)
    for i in (0, 1, 2):  # worker 3 never ran
        prepare(*overrides, f"data.prepare_worker={i}")
    parts = parts_dir(prepared_dir(overrides), WORKERS)
    killed = worker_dir(parts, 1)  # as a kill leaves it: no done.json, one file's run unfinished
    (killed / "done.json").unlink()
    next(killed.glob("file-*.json")).unlink()
    kept = {w: (worker_dir(parts, w) / "done.json").stat().st_mtime_ns for w in (0, 2)}
    with pytest.raises(DataError) as refused:
        prepare(*overrides)
    message = str(refused.value)
    assert "\n" not in message and "worker(s) 1,3 of 4 have not finished" in message
    assert "data.prepare_worker=I` for each I in 1,3" in message and "data.prepare_workers=4" in message
    for i in (1, 3):
        prepare(*overrides, f"data.prepare_worker={i}")
    assert kept == {w: (worker_dir(parts, w) / "done.json").stat().st_mtime_ns for w in (0, 2)}
    assert prepare(*overrides) == 0
    _same(_files(prepared_dir(overrides)), single)


def test_a_damaged_part_is_refused_not_merged(corpus, tmp_path):
    from kimi.data import DataError
    from kimi.data.prepare.parts import parts_dir, worker_dir

    overrides = [*prepare_overrides(corpus, tmp_path), "data.prepare_workers=2"]
    prepare(*overrides)
    for i in (0, 1):
        prepare(*overrides, f"data.prepare_worker={i}")
    run = next(worker_dir(parts_dir(prepared_dir(overrides), 2), 0).glob("file-*.bin"))
    run.write_bytes(run.read_bytes()[:-2] + b"\x00\x00")
    with pytest.raises(DataError, match="worker.s. 0 left a missing or damaged file run"):
        prepare(*overrides)
    assert not (prepared_dir(overrides) / "manifest.json").exists()


def test_the_merge_command_refuses_a_missing_part_in_one_line_with_exit_2(corpus, tmp_path):
    from kimi.data.prepare.parts import make_tokenizer
    from kimi.summary import compose_config

    overrides = [*prepare_overrides(corpus, tmp_path), f"data.prepare_workers={WORKERS}"]
    make_tokenizer(compose_config(overrides).data)
    prepare(*overrides, "data.prepare_worker=0")
    done = subprocess.run([sys.executable, "-m", "kimi.data.prepare", *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "worker(s) 1-3 of 4 have not finished" in lines[0], done.stderr
    assert "kimi.data.prepare data=files" in lines[0] and "data.prepare_worker=I" in lines[0]
    assert "[data] parts: 1/4 workers done" in done.stdout


def test_datatrove_local_workers_give_the_single_process_bytes_and_rerun_only_a_lost_task(corpus, single,
                                                                                            tmp_path, capfd):
    from kimi.data.prepare.executor import local_executor
    from kimi.data.prepare.parts import make_tokenizer, parts_dir, worker_dir
    from kimi.summary import compose_config

    overrides = [*prepare_overrides(corpus, tmp_path), f"data.prepare_workers={WORKERS}",
                 "data.prepare_executor=local", "+data.prepare_executor_args.workers=2"]
    cfg = compose_config(overrides).data
    make_tokenizer(cfg)
    local_executor(cfg, "python -m kimi.data.prepare").run()  # the 4 tasks, 2 at a time, not merged
    parts = parts_dir(prepared_dir(overrides), WORKERS)
    markers = parts / "datatrove" / "completions"
    assert sorted(p.name for p in markers.iterdir()) == [f"{i:05d}" for i in range(WORKERS)]
    # task 2 lost: its completion marker and its output gone; the command runs it alone, then merges
    (markers / "00002").unlink()
    for f in worker_dir(parts, 2).iterdir():
        f.unlink()
    progress = {w: json.loads((worker_dir(parts, w) / "progress.json").read_text()) for w in (0, 1, 3)}
    assert all(p["files_done"] == p["files"] and p["tokens"] > 0 for p in progress.values())
    capfd.readouterr()
    assert prepare(*overrides) == 0
    out = capfd.readouterr().out  # the tasks' lines too (forked processes write to the same descriptor)
    assert f"[data] worker 2/{WORKERS}: file 1/" in out
    assert not any(f"[data] worker {w}/{WORKERS}" in out for w in (0, 1, 3))
    assert f"[data] parts: {WORKERS}/{WORKERS} workers done" in out
    _same(_files(prepared_dir(overrides)), single)
    assert not parts.exists()


def test_the_datatrove_executor_without_datatrove_is_one_line_naming_the_extra(corpus, tmp_path, monkeypatch):
    from kimi.errors import ConfigError, exit_code_for

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datatrove" else
                        find_spec(name, *a))
    with pytest.raises(ConfigError,
                       match=r"needs datatrove, which is not installed: pip install 'kimi\[prep\]'") as e:
        prepare(*prepare_overrides(corpus, tmp_path), "data.prepare_workers=2", "data.prepare_executor=local")
    assert exit_code_for(e.value) == 2 and "\n" not in str(e.value)


def test_the_worker_number_comes_from_a_slurm_array_or_torchrun():
    from kimi.config import DataConfig
    from kimi.data.prepare.parts import this_worker
    from kimi.errors import ConfigError

    four = DataConfig(source="files", prepare_workers=4)
    slurm = {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "1"}
    assert this_worker(four, slurm) == 2  # --array=1-4
    assert this_worker(four, {"RANK": "3", "WORLD_SIZE": "4"}) == 3
    assert this_worker(four, {}) is None  # the merge
    assert this_worker(DataConfig(source="files", prepare_workers=4, prepare_worker=1), slurm) == 1
    assert this_worker(DataConfig(source="files"), {"RANK": "3", "WORLD_SIZE": "4"}) is None  # not in parts
    with pytest.raises(ConfigError, match="launcher started 8 workers .RANK=3.: set data.prepare_workers=8"):
        this_worker(four, {"RANK": "3", "WORLD_SIZE": "8"})


def test_preparing_in_parts_is_refused_for_what_it_cannot_split():
    from kimi.config import ConfigError, DataConfig
    from kimi.data.rules import validate_data

    with pytest.raises(ConfigError, match="splits the files of data.source=files"):
        validate_data(DataConfig(source="shakespeare", prepare_workers=2))
    with pytest.raises(ConfigError, match="data.prepare_worker"):
        validate_data(DataConfig(source="files", data_files=["x"], prepare_workers=2, prepare_worker=2))
