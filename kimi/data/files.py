"""Local data files: which files data.data_files names, their format, and their bytes as datasets reads them.

Below both :mod:`kimi.data.sources` (which loads the files) and :mod:`kimi.data.checks` (which judges them
before and after loading), so neither imports the other for these.
"""

from __future__ import annotations

import bz2
import glob
import gzip
import lzma
import os
from typing import Any, BinaryIO, List

from kimi.data.config import DataConfig
from kimi.errors import DataError

_EXT_FORMATS = {".txt": "text", ".text": "text", ".md": "text", ".json": "json", ".jsonl": "json",
                ".parquet": "parquet"}
_COMPRESSION = (".gz", ".bz2", ".xz", ".zst")


def resolve_files(cfg: DataConfig) -> List[str]:
    """Every file named or matched by data.data_files, in the order given (a pattern's matches sorted).

    An entry naming an existing file is that file even when its name holds glob characters (``data[1].txt``
    is not a pattern for ``data1.txt``); any other entry is a glob pattern (``**`` recurses), whose matched
    directories are skipped. A directory named directly is an error rather than "every file inside": a data
    directory often holds READMEs, checksums or files of another format, so the files are to be named with a
    pattern (``dir/*.jsonl``). A pattern matching nothing is an error too (a typo should not silently shrink
    the corpus).
    """
    files: List[str] = []
    for entry in cfg.data_files or []:
        path = os.path.expanduser(str(entry))
        if os.path.isdir(path):
            raise DataError(f"data.data_files: {entry} is a directory; name the files in it with a pattern, "
                            f"e.g. {os.path.join(str(entry), '*.txt')} (or "
                            f"{os.path.join(str(entry), '**', '*.txt')} to include subdirectories)")
        if os.path.lexists(path):
            if not os.path.isfile(path):
                raise DataError(f"data.data_files: {entry} is not a regular file (a broken link, a pipe or a "
                                "device?); name the data files themselves")
            files.append(os.path.abspath(path))
            continue
        matched = sorted(glob.glob(path, recursive=True))
        if not matched:
            raise FileNotFoundError(f"data.data_files: nothing matches {entry!r} (relative paths start at "
                                    f"{os.getcwd()}); check the path or pattern")
        files.extend(os.path.abspath(m) for m in matched if os.path.isfile(m))
    if not files:
        raise FileNotFoundError(f"data.data_files={list(cfg.data_files or [])} names no files, only "
                                "directories; name the files with a pattern such as dir/*.txt")
    return files


def check_files_named(cfg: Any) -> None:
    """Before any data is read: every data.data_files entry of the run's data section and of each blend
    source (data.sources) names or matches a file, as resolve_files will need; the same errors."""
    for part in [cfg, *(cfg.sources or [])]:
        if part.data_files:
            resolve_files(part)


def _compression(path: str) -> str:
    return next((c for c in _COMPRESSION if path.lower().endswith(c)), "")


def file_format(cfg: DataConfig, files: List[str]) -> str:
    """data.format, else the one format every file's extension implies (.txt: text, .json/.jsonl: json,
    .parquet: parquet)."""
    if cfg.format:
        return cfg.format
    found = set()
    for f in files:
        name = f.lower().removesuffix(_compression(f))  # datasets decompresses these by itself
        suffix = os.path.splitext(name)[1]
        if suffix not in _EXT_FORMATS:
            raise DataError(f"cannot tell the format of {f}; set data.format=text|json|parquet")
        found.add(_EXT_FORMATS[suffix])
    if len(found) > 1:
        raise DataError(f"data.data_files mixes formats {sorted(found)}; use one format (or set data.format)")
    return found.pop()


def open_binary(path: str, fmt: str) -> BinaryIO:
    """The file's bytes as datasets will see them: decompressed, except for Parquet (compressed inside).

    The checks read files through this, so what they judge is what datasets loads.
    """
    kind = _compression(path) if fmt != "parquet" else ""
    if kind == ".gz":
        return gzip.open(path, "rb")
    if kind == ".bz2":
        return bz2.open(path, "rb")
    if kind == ".xz":
        return lzma.open(path, "rb")
    if kind == ".zst":
        import zstandard  # datasets needs it for .zst too, so it is there whenever such a file can load

        return zstandard.open(path, "rb")
    return open(path, "rb")
