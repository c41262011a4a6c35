"""Other libraries' output a user cannot act on stays out of ours (docs/data.md, docs/runs.md): datasets'
progress bars while our [data] phase loads local files, and torch's DeviceMesh deprecation note on every
rank but rank 0."""

import os
import subprocess
import sys
import textwrap

import pytest

BARS = ("Generating train split", "Downloading data")


def _corpus(path):
    path.mkdir()
    for i in range(3):
        (path / f"doc{i}.txt").write_text(f"Document {i}. The king loves the crown.\n")
    return [str(p) for p in sorted(path.glob("*.txt"))]


@pytest.mark.unit
def test_loading_local_files_draws_no_datasets_bars(tmp_path, capfd):
    import datasets
    from datasets.utils.logging import is_progress_bar_enabled

    from kimi.data.sources import _load_files

    datasets.load_dataset("text", data_files=_corpus(tmp_path / "plain"), split="train", sample_by="document")
    assert any(bar in capfd.readouterr().err for bar in BARS)  # what datasets draws by itself
    docs = _load_files(_corpus(tmp_path / "ours"), "text", "text", "data.data_files")
    assert len(docs) == 3
    err = capfd.readouterr().err
    assert not any(bar in err for bar in BARS), err
    assert is_progress_bar_enabled()  # back on for the user's own use of datasets afterwards


MESH = textwrap.dedent("""
    import tempfile
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from kimi.parallel.dims import ParallelDims

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    mesh = ParallelDims(1, 1, 1, 1, 1).build_mesh("cpu")
    ParallelDims.fsdp_mesh(mesh)
    dist.destroy_process_group()
""")


@pytest.mark.dist
@pytest.mark.parametrize("rank,shown", [("0", 1), ("1", 0)])
def test_the_device_mesh_note_is_printed_by_rank_0_alone(rank, shown):
    env = {**os.environ, "RANK": rank}
    proc = subprocess.run([sys.executable, "-c", MESH], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("Slicing a flattened dim from root mesh") == shown, proc.stderr
