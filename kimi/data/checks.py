"""Input checks: bad data ends in one :class:`DataError` line naming the file (and the line, for text and JSON
Lines, or the row, for Parquet) and the fix, instead of a traceback from deep inside datasets or Arrow.

What is refused: empty, unreadable and binary files; text that is not UTF-8 (strict: nothing is silently
replaced); JSON and JSON Lines that do not parse; rows whose data.text_field is missing, null or not a string;
Parquet files without a usable text column; a corpus with no text at all.

The rule: a good corpus is never read twice for checking. Before loading, each file costs a stat and its
first 8 KB (:func:`check_file`); after loading, the text column is judged from Arrow metadata
(:func:`require_string_column`) and only the first non-blank batch is looked at (:func:`require_text`). The
functions that read whole files to name the culprit (:func:`locate` and the ``_*_problem`` finders it runs)
are called only once something has already failed: loading, a column check, or the UTF-8 decoding that the
tokenising pass does anyway (the files source's ``undecodable``, kimi/data/sources.py).
"""

from __future__ import annotations

import codecs
import contextlib
import json
import logging
import lzma
import os
import zlib
from typing import TYPE_CHECKING, Any, Callable, Iterator, List, Optional

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

# Files are opened through open_binary, so they are read as datasets reads them.
from kimi.data.files import open_binary
from kimi.errors import DataError, one_line

if TYPE_CHECKING:  # imported where it is used: datasets takes about a second to import, and a run whose
    import datasets  # data is already prepared never needs it

_SNIFF_BYTES = 8192  # how much of each file is looked at for NUL bytes before loading
# What reading a (possibly compressed) file can raise when the file itself is broken.
_READ_ERRORS = (OSError, EOFError, zlib.error, lzma.LZMAError)
_ROW_FIX = ("every row needs its text as a string there: fix or drop such rows, or set data.text_field to "
            "the field that holds the text")


# --------------------------------------------------------------------------------------------- before loading


def check_file(path: str, fmt: str) -> None:
    """Refuse an empty, unreadable or (for text and JSON) binary file before datasets reads it.

    Reads the first 8 KB only. Binary means a NUL byte there, the test git and grep use: text never holds
    NUL, while images, archives, executables and UTF-16 files almost always do near their start. Binary
    bytes further in still fail the strict UTF-8 decoding of the load itself.
    """
    if os.path.getsize(path) == 0:
        raise DataError(f"{path} is empty (0 bytes); delete it or leave it out of data.data_files")
    try:
        with open_binary(path, fmt) as f:
            head = f.read(_SNIFF_BYTES)
    except PermissionError:
        raise DataError(f"cannot read {path}: permission denied; make it readable (chmod a+r) or leave it "
                        "out of data.data_files") from None
    except _READ_ERRORS as e:
        raise _unreadable(path, e) from None
    if fmt != "parquet" and b"\x00" in head:
        raise DataError(f"{path} looks binary (it has NUL bytes in its first {_SNIFF_BYTES // 1024} KB), "
                        f"not UTF-8 {fmt}; leave it out of data.data_files (or narrow the pattern that "
                        "matched it)")


def _unreadable(path: str, e: BaseException) -> DataError:
    return DataError(f"cannot read {path} ({one_line(e)}); re-create the file or leave it out of "
                     "data.data_files")


# ---------------------------------------------------------------------------------------------- while loading


@contextlib.contextmanager
def quiet_loaders() -> Iterator[None]:
    # datasets logs each bad JSON/Parquet file before raising; the DataError raised instead says it better
    # and in one line. Its progress bars ("Downloading data", "Generating train split") count local files
    # copied into its cache in a fraction of a second, between our [data] lines: off here too (a hub
    # download, which nothing of ours reports, keeps them).
    from datasets.utils import logging as datasets_logging

    loggers = [logging.getLogger(f"datasets.packaged_modules.{m}.{m}") for m in ("json", "parquet")]
    levels = [lg.level for lg in loggers]
    bars = datasets_logging.is_progress_bar_enabled()
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    datasets_logging.disable_progress_bar()
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        if bars:
            datasets_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------- after loading


def require_string_column(ds: datasets.Dataset, field: str, where: str,
                          locate_problem: Callable[[], Optional[str]] = lambda: None) -> None:
    """Refuse a dataset whose ``field`` column is missing or not a string in every row, judged from Arrow
    metadata: no pass over the data unless a row is bad, and then ``locate_problem`` names it."""
    if field not in ds.column_names:
        raise DataError(f"data.text_field={field!r} is not a column of {where}; "
                        f"available columns: {ds.column_names}")
    import datasets

    feature = ds.features[field]
    is_text = isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
    nulls = ds.data.column(field).null_count if is_text else 0
    if not is_text or nulls:
        raise DataError(locate_problem() or _column_problem(ds, field, where, feature, nulls))


def _column_problem(ds: datasets.Dataset, field: str, where: str, feature: Any, nulls: int) -> str:
    # The fallback when the files cannot name the row (a hub dataset, or nothing found in them).
    if nulls:
        first = pc.index(pc.is_null(ds.data.column(field)), True).as_py()
        return (f"{where}: {field!r} (data.text_field) is null in {nulls} row(s), the first being row "
                f"{first}; {_ROW_FIX}")
    return (f"{where}: column {field!r} (data.text_field) holds {feature}, not strings; set data.text_field "
            "to the column that holds the text")


def require_text(docs: datasets.Dataset, where: str) -> None:
    """Refuse a source whose documents are all empty or whitespace; stops at the first non-blank batch, which
    for any real corpus is the first."""
    for batch in docs.with_format("arrow").iter(batch_size=64):
        if pc.any(pc.match_substring_regex(batch["text"], r"\S")).as_py():
            return
    raise DataError(f"{where} holds no text: every document is empty or whitespace; point the data "
                    "settings at the real corpus")


# -------------------------------------------------------------------------------------------- after a failure


def locate(files: List[str], fmt: str, field: str) -> Optional[str]:
    """The first problem in the files as a one-line message: run only once loading or checking has failed,
    so good corpora are never read twice."""
    find = _PROBLEM_FINDERS[fmt]
    for f in files:
        try:
            found = find(f, field)
        except _READ_ERRORS as e:  # e.g. a compressed file whose damage starts past the checked head
            return str(_unreadable(f, e))
        if found:
            return found
    return None


# Each finder: (path, text field) -> the whole message for the file's first problem, or None.


def _text_problem(path: str, field: str) -> Optional[str]:
    where = _bad_utf8(path)
    if where is None:
        return None
    return (f"{path}, {where}: invalid UTF-8; convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or "
            "leave it out of data.data_files")


def _bad_utf8(path: str) -> Optional[str]:
    """'line L (byte offset B)' of the first byte that is not UTF-8, else None; streams the file."""
    with open_binary(path, "text") as f:
        pending, offset, line = b"", 0, 1  # pending: an incomplete character cut by the block boundary
        for block in iter(lambda: f.read(1 << 20), b""):
            data = pending + block
            try:
                _, used = codecs.utf_8_decode(data, "strict", False)
            except UnicodeDecodeError as e:
                bad_line = line + data.count(b"\n", 0, e.start)
                return f"line {bad_line} (byte offset {offset + e.start})"
            line += data.count(b"\n", 0, used)
            offset, pending = offset + used, data[used:]
    return f"line {line} (byte offset {offset}, a character cut off at the end)" if pending else None


def _json_problem(path: str, field: str) -> Optional[str]:
    """The first line of a JSON Lines file (or item of a JSON array file) that is not an object with a
    string ``field``, as a whole message; None when every row is fine. Streams the file line by line."""
    with open_binary(path, "json") as f:
        if f.read(_SNIFF_BYTES).lstrip(codecs.BOM_UTF8 + b" \t\r\n").startswith(b"["):
            return _json_array_problem(path, field)
    rows = 0
    with open_binary(path, "json") as f:
        for n, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as e:
                return (f"{path}, line {n}: invalid UTF-8 (column {e.start + 1}); convert the file to UTF-8 "
                        "or fix that line")
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                # Only the last line can lack its newline: the file stops mid-record.
                cut = "" if raw.endswith(b"\n") else "; the file ends inside this record: truncated?"
                return (f"{path}, line {n}: not valid JSON ({e.msg}: column {e.colno}){cut}; fix or delete "
                        "that line")
            problem = _row_problem(row, field)
            if problem:
                return f"{path}, line {n}: {problem}; {_ROW_FIX}"
            rows += 1
    if rows:
        return None
    return f"{path} holds no JSON rows, only blank lines; delete it or leave it out of data.data_files"


def _json_array_problem(path: str, field: str) -> Optional[str]:
    # A JSON array has no lines to stream by: the file is parsed whole.
    with open_binary(path, "json") as f:
        raw = f.read()
    try:
        rows = json.loads(raw.decode("utf-8-sig"))
    except UnicodeDecodeError as e:
        return f"{path}, byte offset {e.start}: invalid UTF-8; convert the file to UTF-8"
    except json.JSONDecodeError as e:
        return f"{path}, line {e.lineno}: not valid JSON ({e.msg}: column {e.colno}); fix the file"
    for i, row in enumerate(rows if isinstance(rows, list) else [rows]):
        problem = _row_problem(row, field)
        if problem:
            return f"{path}, item {i} of its JSON array: {problem}; {_ROW_FIX}"
    return None


def _row_problem(row: Any, field: str) -> Optional[str]:
    if not isinstance(row, dict):
        return f"is {_kind(row)}, not a JSON object"
    if field not in row:
        return f"has no field {field!r} (data.text_field; its fields: {sorted(row)[:8]})"
    if not isinstance(row[field], str):
        return f"field {field!r} (data.text_field) is {_kind(row[field])}, not a string"
    return None


def _kind(value: Any) -> str:
    # A parsed JSON value, named as JSON names it (the user wrote JSON, not Python).
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    names = {int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}
    return names.get(type(value), type(value).__name__)


def _parquet_problem(path: str, field: str) -> Optional[str]:
    """The first row of a Parquet file whose ``field`` is not a string, as a whole message, else None."""
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
        if field not in schema.names:
            return (f"{path} has no column {field!r} (data.text_field; its columns: {schema.names}); set "
                    "data.text_field to the column that holds the text")
        kind = schema.field(field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            return (f"{path}: column {field!r} (data.text_field) holds {kind}, not strings; set "
                    "data.text_field to the column that holds the text")
        row = 0
        for batch in pf.iter_batches(columns=[field]):
            column = batch.column(0)
            if column.null_count:
                first = pc.index(pc.is_null(column), True).as_py()
                return f"{path}, row {row + first}: {field!r} (data.text_field) is null; {_ROW_FIX}"
            bad = _first_undecodable(column)
            if bad is not None:
                return (f"{path}, row {row + bad}: {field!r} (data.text_field) is not valid UTF-8; re-create "
                        "the file with UTF-8 text")
            row += batch.num_rows
    except (pa.ArrowException, OSError) as e:
        return (f"{path} is not a readable Parquet file ({one_line(e)}); re-create it or leave it out of "
                "data.data_files")
    return None


def _first_undecodable(column: pa.Array) -> Optional[int]:
    # Arrow's Parquet and JSON readers accept any bytes in a string column; Python's decoding does not.
    try:
        column.validate(full=True)
        return None
    except pa.ArrowInvalid:
        pass
    for i in range(len(column)):
        try:
            column[i].as_py()
        except UnicodeDecodeError:
            return i
    return None


_PROBLEM_FINDERS = {"text": _text_problem, "json": _json_problem, "parquet": _parquet_problem}
