"""kimi.wandb_offline's reading of the LevelDB-style log wandb writes, on files laid out chunk by chunk here:
records split across blocks, and whether a file holds its run's end yet (wandb's service writes the last
block after run.finish() has returned)."""

import struct
import zlib

import pytest

from kimi.wandb_offline import _BLOCK, contents, finished, read_records, render

pytestmark = pytest.mark.unit


def _log(payloads):
    """A .wandb file of these records: the 7-byte header, then each record as one full chunk or a first,
    middles and a last, never across a block's end (a block's tail under 7 bytes is zero padding)."""
    out = bytearray(b":W&B\x00\x00\x01")
    for payload in payloads:
        rest, first = payload, True
        while True:
            room = _BLOCK - len(out) % _BLOCK
            if room < 7:
                out += bytes(room)
                continue
            chunk, rest = rest[:room - 7], rest[room - 7:]
            kind = (1 if not rest else 2) if first else (4 if not rest else 3)
            out += struct.pack("<IHB", zlib.crc32(bytes([kind]) + chunk), len(chunk), kind) + chunk
            first = False
            if not rest:
                break
    return bytes(out)


def _record(kind, **fields):
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    getattr(record, kind).SetInParent()
    for key, value in fields.items():
        setattr(getattr(record, kind), key, value)
    return record.SerializeToString()


def _history(step):
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    record.history.step.num = step
    record.history.item.add(key="loss", value_json="1.5")
    return record.SerializeToString()


def _console(n):
    return _record("output_raw", line="x" * n)


@pytest.mark.parametrize("before", [0, 3, 50_000, 100_000])  # bytes of console output ahead of the end
def test_a_file_is_finished_once_its_exit_record_is_written(tmp_path, before):
    path = tmp_path / "run-x.wandb"
    body = [_record("run", run_id="x"), *(_history(s) for s in range(3))]
    body += [_console(before)] if before else []
    path.write_bytes(_log([]))  # what a run's file holds until wandb's service writes its last block
    assert not finished(path) and read_records(path) == []
    path.write_bytes(_log(body))
    assert not finished(path)  # a killed run's file: no end
    path.write_bytes(_log([*body, _record("exit", exit_code=0)]))
    assert finished(path)
    kinds = [r.WhichOneof("record_type") for r in read_records(path)]
    assert kinds == ["run", "history", "history", "history"] + ["output_raw"] * bool(before) + ["exit"]
    data = path.read_bytes()
    path.write_bytes(data[:-2])  # the last chunk half written
    assert not finished(path)


def test_an_exit_record_across_a_block_boundary_is_read_from_the_tail(tmp_path):
    """A long console record fills the first two blocks but for 10 bytes, so the exit record's first chunk
    (3 bytes of it) ends block 1 and its last chunk starts block 2: the tail read (blocks 1 and 2) must join
    the two, and skip the long record's last chunk, whose start lies in block 0."""
    long = next(r for r in map(_console, range(2 * _BLOCK - 200, 2 * _BLOCK))
                if len(_log([r])) == 2 * _BLOCK - 10)
    path = tmp_path / "run-x.wandb"
    path.write_bytes(_log([long, _record("exit", exit_code=1, runtime=1234)]))  # 6 bytes
    data = path.read_bytes()
    assert data[2 * _BLOCK - 10 + 6] == 2 and data[2 * _BLOCK + 6] == 4  # first chunk, then last chunk
    kinds = [r.WhichOneof("record_type") for r in read_records(path)]
    assert kinds == ["output_raw", "exit"] and finished(path)


def test_the_summary_says_when_a_record_has_no_end(tmp_path):
    path = tmp_path / "wandb" / "offline-run-20261207_000000-x" / "run-x.wandb"
    path.parent.mkdir(parents=True)
    body = [_record("run", run_id="x", display_name="r"), _history(1)]
    ending = "no end record yet: the run is still logging, or it stopped without finishing (killed)"
    path.write_bytes(_log(body))
    assert render(contents(tmp_path))[-1] == ending
    path.write_bytes(_log([*body, _record("exit", exit_code=0)]))
    summary = contents(tmp_path)
    assert summary["finished"] and summary["steps"] == 1 and ending not in render(summary)
