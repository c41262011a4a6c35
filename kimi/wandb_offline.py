"""What a run's offline wandb record holds, read back with wandb's own protobuf types, before (or instead of)
``wandb sync``: the run's name, group and tags, and per key how many steps logged it, with the images and
tables among them.

    python -m kimi.wandb_offline run=RUN_DIR [json=OUT]

  run             the run directory (required)
  json            a file to write the summary to as well, as JSON

key=value arguments (kimi/cli/keyvalue.py); a bad argument is one line and exit code 2.

Besides the logged keys it shows the charts' x axis the run defines (tokens, kimi.run.wandb_run.tokens_axis),
the run's artifacts, the checkpoints among them (logging.wandb.log_checkpoints), and how many console lines
it captured (wandb's Logs tab); a record that does not hold its run's end yet (still logging, or killed) says
so.

A resumed run continues its wandb run in a new offline-run-* folder with the same run id: every such segment
of the newest run is read, oldest first, and their records merged (a step logged again by a later segment is
the later one's). Keys are as wandb got them: train/loss, val/loss, ... (kimi.run.metrics.grouped_name) from
runs of this version on, the flat metrics.jsonl names (loss, val_loss, ...) in older ones.

The ``.wandb`` file is a LevelDB-style log (wandb 0.31 has no Python reader of its own; its Go core writes the
file): a 7-byte header, then 32 KiB blocks of chunks, each [crc32 of type + data (4), length (2), type (1):
full 1, first 2, middle 3, last 4]; a record is one full chunk or a first, middles and a last.
"""

from __future__ import annotations

import json
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

_BLOCK = 32768


class WandbFileError(ValueError):
    pass


def read_records(path: Path) -> list:
    """The records (wandb_internal_pb2.Record) of a .wandb file, in order."""
    data = Path(path).read_bytes()
    if data[:4] != b":W&B":
        raise WandbFileError(f"{path} is not a wandb run file (it does not start with ':W&B')")
    return [_record(payload) for payload in _payloads(data, 7, path)]


def finished(path: Path) -> bool:
    """Whether a .wandb file holds its run's end: the exit record, always wandb's last. Reads the last two
    blocks only (a record as small as the exit record spans two at most), so a long run's file costs the same.
    wandb's service writes the file's last block when it closes the run's stream, which can come after
    run.finish() has returned; a run that was killed never gets one."""
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        start = max(0, (size - 1) // _BLOCK - 1) * _BLOCK
        f.seek(start)
        data = f.read()
    try:
        payloads = _payloads(data, max(7 - start, 0), path, tail=True)
    except WandbFileError:  # a chunk still being written
        return False
    return bool(payloads) and _record(payloads[-1]).WhichOneof("record_type") == "exit"


def wait_finished(path: Path, timeout_s: float) -> bool:
    """finished(path), polled for up to timeout_s seconds."""
    deadline = time.monotonic() + timeout_s
    while not (path.is_file() and finished(path)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _record(payload: bytes):
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    record.ParseFromString(payload)
    return record


def _payloads(data: bytes, pos: int, path: Path, tail: bool = False) -> List[bytes]:
    """Each record's bytes, reassembled from the chunks of `data` from `pos` on (data starts on a block
    boundary). tail: data starts inside the file, so chunks that continue a record begun before it are
    skipped."""
    payloads, pending, started = [], b"", not tail
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        if zlib.crc32(bytes([kind]) + chunk) != crc:
            raise WandbFileError(f"{path}: a chunk at byte {pos - 7 - length} fails its CRC (a torn write?)")
        started = started or kind in (1, 2)
        if not started:
            continue
        pending += chunk
        if kind in (1, 4):
            payloads.append(pending)
            pending = b""
    return payloads


def _offline_files(run_dir: Path) -> List[Path]:
    """Every offline wandb file of a run directory, oldest first (offline-run-<date>_<time>-<id>: the folder
    names sort by start time; the file's age breaks a tie)."""
    found = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"),
                   key=lambda p: (p.parent.name.split("-")[2], p.stat().st_mtime))
    if not found:
        raise WandbFileError(f"{run_dir} has no wandb/offline-run-*/run-*.wandb: was it trained with "
                             "logging.wandb.mode=offline?")
    return found


def run_file(run_dir: Path) -> Path:
    """The newest offline wandb file of a run directory."""
    return _offline_files(run_dir)[-1]


def run_files(run_dir: Path) -> List[Path]:
    """The segments of the newest offline wandb run of a run directory, oldest first: each start of a resumed
    run writes a folder of its own under the same run id (run-<id>.wandb)."""
    found = _offline_files(run_dir)
    return [p for p in found if p.name == found[-1].name]


def history(records: Sequence) -> Dict[int, Dict[str, Any]]:
    """{step: {key: value}} of the history records; an image's or a table's value is its JSON description
    (``_type`` image-file / table-file, ``path`` under the run's files/)."""
    out: Dict[int, Dict[str, Any]] = {}
    for r in records:
        if r.WhichOneof("record_type") != "history":
            continue
        items = out.setdefault(r.history.step.num, {})
        for item in r.history.item:
            # a scalar is one key; a media value arrives as its fields, [key, field] each
            key, *field = list(item.nested_key) or [item.key]
            value = json.loads(item.value_json)
            if field:
                items.setdefault(key, {})[".".join(field)] = value
            else:
                items[key] = value
    return out


def contents(run_dir: Path) -> Dict[str, Any]:
    """A summary of the run's offline wandb record, all its segments merged (what the command prints)."""
    paths = run_files(run_dir)
    path = paths[-1]
    segments = [read_records(p) for p in paths]
    records = [r for segment in segments for r in segment]
    runs = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    steps: Dict[int, Dict[str, Any]] = {}
    folder_of: Dict[int, Path] = {}
    for p, segment in zip(paths, segments):  # a later segment's step replaces an earlier one's
        found = history(segment)
        steps.update(found)
        folder_of.update(dict.fromkeys(found, p.parent))
    scalars: Dict[str, int] = {}
    media: Dict[str, Dict[str, Any]] = {}
    for step in sorted(steps):
        for key, value in steps[step].items():
            if isinstance(value, dict) and value.get("_type") in ("image-file", "table-file"):
                m = media.setdefault(key, {"type": value["_type"], "steps": []})
                m["steps"].append(step)
                if value["_type"] == "table-file":
                    m["nrows"], m["ncols"] = value.get("nrows"), value.get("ncols")
                m["files_present"] = m.get("files_present", True) and (folder_of[step] / "files" /
                                                                       value["path"]).is_file()
            elif not key.startswith("_"):
                scalars[key] = scalars.get(key, 0) + 1
    run = runs[0] if runs else None
    console = "".join(r.output_raw.line for r in records if r.WhichOneof("record_type") == "output_raw")
    return {"file": str(path), "segments": [str(p) for p in paths], "run": None if run is None else {
                "name": run.display_name, "project": run.project, "group": run.run_group,
                "tags": list(run.tags)},
            "steps": len(steps), "first_step": min(steps, default=None),
            "last_step": max(steps, default=None),
            "scalars": dict(sorted(scalars.items())), "media": media, "x_axis": x_axis(records),
            "artifacts": artifacts(records), "console_lines": len(console.splitlines()),
            "finished": bool(segments[-1]) and segments[-1][-1].WhichOneof("record_type") == "exit"}


def x_axis(records: Sequence) -> Dict[str, str]:
    """{metric name or glob: the metric it is plotted against} of the run's define_metric calls."""
    return {m.name or m.glob_name: m.step_metric for m in (r.metric for r in records
                                                            if r.WhichOneof("record_type") == "metric")
            if m.step_metric}


def artifacts(records: Sequence) -> List[Dict[str, Any]]:
    """Each artifact the run logged: name, type, aliases, metadata and the files it holds."""
    out = []
    for r in records:
        if r.WhichOneof("record_type") == "artifact":
            a = r.artifact
            out.append({"name": a.name, "type": a.type, "aliases": sorted(a.aliases),
                        "metadata": json.loads(a.metadata or "{}"),
                        "files": sorted(c.path for c in a.manifest.contents)})
    return out


def render(summary: Dict[str, Any]) -> List[str]:
    run = summary["run"] or {}
    segments = len(summary.get("segments", [])) or 1
    lines = [f"{summary['file']}" + (f" (and {segments - 1} earlier segments of this run: resumed starts)"
                                     if segments > 1 else ""),
             f"run {run.get('name')!r} project {run.get('project')!r} group {run.get('group')!r} tags "
             f"{run.get('tags')}",
             f"{summary['steps']} logged steps ({summary['first_step']} to {summary['last_step']})"]
    families: Dict[str, List[str]] = {"(top level)": []}
    for key in summary["scalars"]:
        families.setdefault(key.split("/", 1)[0] if "/" in key else "(top level)", []).append(key)
    lines.append(f"{len(summary['scalars'])} scalar keys:")
    for family, keys in families.items():
        if not keys:
            continue
        counts = sorted({summary["scalars"][k] for k in keys})
        shown = ", ".join(keys[:4]) + (f", ... ({len(keys)} keys)" if len(keys) > 4 else "")
        lines.append(f"  {family}: {shown}; logged at {'/'.join(map(str, counts))} steps")
    for key, m in summary["media"].items():
        size = f", {m['nrows']} rows x {m['ncols']} columns" if m["type"] == "table-file" else ""
        files = "" if m["files_present"] else " (some files missing)"
        lines.append(f"  {m['type']} {key}: steps {' '.join(map(str, m['steps']))}{size}{files}")
    if summary["x_axis"]:
        lines.append("x axis: " + ", ".join(f"{k} against {v}" for k, v in summary["x_axis"].items()))
    models = [a for a in summary["artifacts"] if a["type"] == "model"]
    for a in models:
        lines.append(f"  model artifact {a['name']} ({', '.join(a['aliases'])}): {len(a['files'])} files, "
                     f"metadata {json.dumps(a['metadata'])}")
    others = len(summary["artifacts"]) - len(models)
    if others:
        lines.append(f"  {others} other artifacts (the tables' own)")
    lines.append(f"{summary.get('console_lines', 0)} console lines captured (wandb's Logs tab)")
    if not summary.get("finished", True):
        lines.append("no end record yet: the run is still logging, or it stopped without finishing (killed)")
    return lines


def main(argv: Optional[Sequence[str]] = None) -> int:
    from kimi.cli import keyvalue
    from kimi.config import ConfigError

    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    try:
        args = keyvalue.parse(argv, {"run": Path, "json": Path}, "kimi.wandb_offline")
        if "run" not in args:
            raise ConfigError("no run: give the run directory, e.g. run=runs/exp1")
        summary = contents(args["run"])
    except (ConfigError, WandbFileError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("\n".join(render(summary)))
    if "json" in args:
        args["json"].write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
