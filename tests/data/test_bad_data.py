"""Bad data inputs end in one DataError (or FileNotFoundError) line that names the file, and the line where
the format has lines, and says what to do; nothing is silently replaced, skipped or trained on.

Everything runs offline in temporary directories (the kimi and Hugging Face caches included).
"""

import json
import os
import random
import re
import shutil
import struct
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kimi.data.files
from helpers import make_corpus
from kimi.config import DataConfig, TokenizerConfig
from kimi.data import DataError, load_documents, open_tokens, prepare
from kimi.data import sources

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("offline")]  # offline: conftest.py

VOCAB = 384


def _cfg(tmp_path, files, **kw) -> DataConfig:
    return DataConfig(name="bad", source="files", data_files=[str(f) for f in files], val_fraction=0.2,
                      cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig(vocab_size=VOCAB), **kw)


def _png() -> bytes:
    """A valid 1x1 PNG: a real binary header, not just noise."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00"))
            + chunk(b"IEND", b""))


def _jsonl(*rows) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def _parquet(**columns) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table(columns), sink)
    return sink.getvalue().to_pybytes()


GOOD = {"text": "The king loves the crown."}
# (id, file name, content, extra DataConfig fields, words the message must contain besides the file name)
CASES = [
    ("random-bytes", "noise.txt", bytes(random.Random(0).randbytes(4096)), {}, ["looks binary", "NUL"]),
    ("png-as-text", "image.png", _png(), {"format": "text"}, ["looks binary"]),
    ("utf16-as-text", "wide.txt", "hello world\n".encode("utf-16"), {}, ["looks binary"]),
    ("latin1", "latin1.txt", "one\ntwo\ncaf\xe9 au lait\n".encode("latin-1"), {},
     ["line 3", "byte offset 11", "invalid UTF-8", "iconv"]),
    ("utf8-cut-at-end", "cut.txt", "abc\ndef \u20ac".encode()[:-1], {},
     ["line 2", "invalid UTF-8", "cut off"]),
    ("jsonl-garbage-line", "rows.jsonl", _jsonl(GOOD, b"this is not json", GOOD), {},
     ["line 2", "not valid JSON", "fix or delete that line"]),
    ("jsonl-truncated", "rows.jsonl", _jsonl(GOOD, GOOD) + b'{"text": "The que', {},
     ["line 3", "not valid JSON", "truncated?"]),
    ("jsonl-bad-utf8", "rows.jsonl", _jsonl(GOOD, b'{"text": "caf\xe9"}'), {}, ["line 2", "invalid UTF-8"]),
    ("jsonl-bad-utf8-one-row", "rows.jsonl", _jsonl(b'{"text": "caf\xe9"}'), {}, ["line 1", "invalid UTF-8"]),
    ("jsonl-not-object", "rows.jsonl", _jsonl(GOOD, ["a", "list"]), {},
     ["line 2", "a list, not a JSON object"]),
    ("text-null", "rows.jsonl", _jsonl(GOOD, GOOD, {"text": None}), {}, ["line 3", "'text'", "is null"]),
    ("text-number", "rows.jsonl", _jsonl(GOOD, {"text": 42}), {}, ["line 2", "'text'", "a number"]),
    ("text-all-numbers", "rows.jsonl", _jsonl({"text": 1}, {"text": 2}), {}, ["line 1", "a number"]),
    ("text-list", "rows.jsonl", _jsonl(GOOD, {"text": ["a", "b"]}), {}, ["line 2", "a list"]),
    ("text-missing-in-a-row", "rows.jsonl", _jsonl(GOOD, {"body": "x"}, GOOD), {},
     ["line 2", "has no field 'text'", "['body']"]),
    ("text-field-null", "rows.jsonl", _jsonl({"body": "a"}, {"body": None}), {"text_field": "body"},
     ["line 2", "'body'", "is null", "data.text_field"]),
    ("json-array-null", "rows.json", json.dumps([GOOD, {"text": None}]).encode(), {}, ["item 1", "is null"]),
    ("json-array-broken", "rows.json", b'[{"text": "a"},\n {"text": "b"]', {}, ["line 2", "not valid JSON"]),
    ("parquet-null", "rows.parquet", _parquet(text=["a", None, "c"]), {}, ["row 1", "is null"]),
    ("parquet-ints", "rows.parquet", _parquet(text=[1, 2]), {}, ["'text'", "int64, not strings"]),
    # view(), unlike cast(), does not validate: the bytes reach the file as they are.
    ("parquet-bad-utf8", "rows.parquet", _parquet(text=pa.array([b"ok", b"caf\xe9"]).view(pa.string())), {},
     ["row 1", "not valid UTF-8"]),
    ("parquet-corrupt", "rows.parquet", b"PAR1 this is not really parquet", {},
     ["not a readable Parquet file"]),
    ("empty-text", "empty.txt", b"", {}, ["is empty", "0 bytes"]),
    ("empty-jsonl", "empty.jsonl", b"", {}, ["is empty"]),
    ("whitespace-text", "blank.txt", b"  \n\n\t\n", {}, ["holds no text", "whitespace"]),
    ("blank-lines-jsonl", "blank.jsonl", b"\n  \n\n", {}, ["holds no JSON rows"]),
    ("empty-strings-jsonl", "blank.jsonl", _jsonl({"text": ""}, {"text": " \n"}), {}, ["holds no text"]),
    ("gzip-corrupt", "rows.jsonl.gz", b"\x1f\x8b\x08\x00 not a gzip stream", {}, ["cannot read"]),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_file_is_one_clear_line(tmp_path, case):
    _, name, content, extra, words = case
    path = tmp_path / "corpus" / name
    path.parent.mkdir()
    path.write_bytes(content)
    with pytest.raises(DataError) as err:
        prepare(_cfg(tmp_path, [path], **extra))
    message = str(err.value)
    assert str(path) in message and "\n" not in message, message
    for word in words:
        assert word in message, message
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").rglob("*.bin"))


def test_bad_row_is_found_in_a_later_file(tmp_path):
    good, bad = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    good.write_bytes(_jsonl(GOOD, GOOD))
    bad.write_bytes(_jsonl(GOOD, GOOD, GOOD, {"text": None}))
    message = rf"^{re.escape(str(bad))}, line 4: field 'text' \(data.text_field\) is null"
    with pytest.raises(DataError, match=message):
        load_documents(_cfg(tmp_path, [tmp_path / "*.jsonl"]))


def test_directory_pattern_and_unreadable_file(tmp_path, monkeypatch):
    (tmp_path / "dir").mkdir()
    where, pattern = re.escape(str(tmp_path / "dir")), re.escape(str(tmp_path / "dir" / "*.txt"))
    with pytest.raises(DataError, match=rf"{where} is a directory; name the files .* e\.g\. {pattern}"):
        load_documents(_cfg(tmp_path, [tmp_path / "dir"]))
    with pytest.raises(FileNotFoundError, match=rf"nothing matches '{pattern}'.*check the path"):
        load_documents(_cfg(tmp_path, [tmp_path / "dir" / "*.txt"]))
    secret = tmp_path / "secret.txt"
    secret.write_text("The king loves the crown.\n")
    secret.chmod(0)
    if os.geteuid() == 0:  # root reads anything: make the read fail as it would for anyone else
        real_open = open

        def refuse(path, *args, **kwargs):
            if str(path) == str(secret):
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, *args, **kwargs)
        monkeypatch.setattr(kimi.data.files, "open", refuse, raising=False)
    with pytest.raises(DataError, match=rf"^cannot read {re.escape(str(secret))}: permission denied;.*chmod"):
        load_documents(_cfg(tmp_path, [secret]))


def test_name_with_glob_characters_is_taken_literally(tmp_path):
    (tmp_path / "data[1].txt").write_text("alpha one\nalpha two\nalpha three\n")
    (tmp_path / "data1.txt").write_text("beta one\nbeta two\n")
    cfg = _cfg(tmp_path, [tmp_path / "data[1].txt"])
    assert sources.resolve_files(cfg) == [str(tmp_path / "data[1].txt")]
    train, val = load_documents(cfg)
    assert train[0]["text"] + "\n" + val[0]["text"] == "alpha one\nalpha two\nalpha three\n"
    # Still a pattern when no file has that name.
    pattern = _cfg(tmp_path, [tmp_path / "data[0-9].txt"])
    assert sources.resolve_files(pattern) == [str(tmp_path / "data1.txt")]


# ------------------------------------------------------------------------------------------ token cache


@pytest.fixture(scope="module")
def prepared_cache(tmp_path_factory):
    """A prepared corpus (cache root, config): each test corrupts its own copy of the cache."""
    root = tmp_path_factory.mktemp("good")
    cfg = _cfg(root, [make_corpus(root / "corpus", docs=12, sentences=40) / "*.txt"])
    return root / "cache", cfg, prepare(cfg)


def _put(path, offset, value, dtype):
    tokens = np.memmap(path, dtype=dtype, mode="r+")
    tokens[offset] = value
    tokens.flush()


def _rewrite_meta(path, **changes):
    meta = json.loads(path.read_text())
    path.write_text(json.dumps({**meta, **changes}))


CACHE_CASES = [
    ("id-beyond-vocab", "train-00000.bin", lambda p: _put(p, 5, 60000, np.uint16),
     ["holds token id 60000", "384 ids"]),
    ("id-equal-to-vocab", "val-00000.bin", lambda p: _put(p, 0, VOCAB, np.uint16),
     [f"holds token id {VOCAB}"]),
    ("checksum", "train-00000.bin",
     lambda p: _put(p, 3, (np.fromfile(p, np.uint16)[3] + 1) % VOCAB, np.uint16),
     ["does not match its checksum"]),
    ("odd-size", "train-00000.bin", lambda p: p.write_bytes(p.read_bytes()[:-1]), ["truncated"]),
    ("one-token-short", "val-00000.bin", lambda p: p.write_bytes(p.read_bytes()[:-2]),
     ["truncated", "bytes"]),
    ("missing", "train-00000.bin", lambda p: p.unlink(), ["is missing"]),
    ("meta-not-json", "train-00000.json", lambda p: p.write_text('{"format_version": 2, "dty'),
     ["is corrupt"]),
    ("meta-without-dtype", "val-00000.json", lambda p: _rewrite_meta(p, dtype=None), ["is corrupt"]),
    ("meta-vocab-edited", "train-00000.json", lambda p: _rewrite_meta(p, vocab_size=3),
     ["vocabulary 3", "384"]),
    ("index-truncated", "train-00000.idx", lambda p: p.write_bytes(p.read_bytes()[:-8]), ["truncated"]),
    ("manifest-not-json", "manifest.json", lambda p: p.write_text('{"splits": '),
     ["manifest.json is corrupt"]),
    ("tokenizer-corrupt", "tokenizer.model", lambda p: p.write_bytes(_png()), ["corrupt tokenizer.model"]),
]


@pytest.mark.parametrize("case", CACHE_CASES, ids=[c[0] for c in CACHE_CASES])
def test_corrupt_token_cache_says_delete_it(prepared_cache, tmp_path, case):
    _, name, corrupt, words = case
    cache, cfg, good = prepared_cache
    shutil.copytree(cache, tmp_path / "cache")  # the fingerprint ignores cache_dir: the copy is a cache hit
    cfg = DataConfig(**{**cfg.__dict__, "cache_dir": str(tmp_path / "cache")})
    data_dir = tmp_path / "cache" / good.data_dir.relative_to(cache)
    corrupt(data_dir / name)
    with pytest.raises(DataError) as err:
        prepare(cfg)
    message = str(err.value)
    assert str(data_dir) in message and "delete" in message and "\n" not in message, message
    for word in words:
        assert word in message, message
    if name.endswith((".bin", ".json")):  # the trainer's own open is checked the same way
        with pytest.raises(DataError, match="delete"):
            open_tokens(data_dir / name.replace(".json", ".bin"), good.tokenizer.sha256)


def test_cache_edited_after_a_check_is_caught_again(prepared_cache, tmp_path):
    cache, cfg, good = prepared_cache
    shutil.copytree(cache, tmp_path / "cache")
    path = tmp_path / "cache" / good.shards["train"][0].relative_to(cache)
    assert open_tokens(path, good.tokenizer.sha256).max() < VOCAB
    _put(path, 1, 65535, np.uint16)
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # a later edit
    with pytest.raises(DataError, match=f"{re.escape(str(path))} holds token id 65535"):
        open_tokens(path, good.tokenizer.sha256)


def test_invalid_utf8_found_while_tokenising(prepared_cache, tmp_path):
    """Arrow loads JSON strings unchecked; the tokenising pass decodes them, and only then are the files
    searched for the bad line (here past the tokenizer, which is the user's and is not trained)."""
    _, _, good = prepared_cache
    path = tmp_path / "rows.jsonl"
    path.write_bytes(_jsonl(*[GOOD] * 6, b'{"text": "caf\xe9"}', *[GOOD] * 3))
    cfg = _cfg(tmp_path, [path])
    cfg.tokenizer.model_path = str(good.tokenizer.path)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}, line 7: invalid UTF-8"):
        prepare(cfg)


# ---- a hub dataset without network: one DataError line within seconds ------------------------------------
def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on return: connections are refused


@pytest.fixture
def hub_online_but_unreachable(monkeypatch, tmp_path):
    """The offline switches off (as for a new user), an empty datasets cache, and a hub endpoint nothing
    answers on: every request would fail, as without network."""
    import datasets
    import huggingface_hub.constants

    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")

    def at(endpoint: str) -> str:
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", endpoint)
        monkeypatch.setattr(datasets.config, "HF_ENDPOINT", endpoint)
        return endpoint

    return at


def _load_hub(path="roneneldan/TinyStories"):
    import time

    start = time.monotonic()
    with pytest.raises(DataError) as err:
        load_documents(DataConfig(source="hf", path=path, val_split="validation"))
    return str(err.value), time.monotonic() - start


def test_unreachable_hub_is_one_line_in_seconds(hub_online_but_unreachable, caplog):
    import datasets
    import huggingface_hub.constants

    endpoint = hub_online_but_unreachable(f"http://127.0.0.1:{_closed_port()}")
    message, seconds = _load_hub()
    assert seconds < 5, seconds  # not ~30 s of download retries
    assert "\n" not in message
    assert message.startswith("cannot load data.path='roneneldan/TinyStories': it is not in the local "
                              "datasets cache and the Hugging Face hub is offline or unreachable "
                              f"({endpoint}: "), message
    for words in ("run once with network access", "HF_HUB_OFFLINE=1",
                  "data.source=files 'data.data_files=[/path/to/*.jsonl]'"):
        assert words in message, message
    assert not [r for r in caplog.records if "Retry" in r.getMessage()]
    # offline mode held only for that load
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False


def test_silent_hub_is_given_up_after_the_probe_timeout(hub_online_but_unreachable, monkeypatch):
    import socket

    with socket.socket() as server:  # accepts connections (the kernel does) but never answers
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        hub_online_but_unreachable(f"http://127.0.0.1:{server.getsockname()[1]}")
        monkeypatch.setattr(sources, "HUB_PROBE_TIMEOUT_S", 1.0)
        message, seconds = _load_hub()
    assert seconds < 4, seconds
    assert "\n" not in message and "offline or unreachable" in message, message


@pytest.mark.parametrize("var", ["HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"])
def test_offline_setting_reads_only_the_cache_without_a_probe(hub_online_but_unreachable, monkeypatch, var):
    import datasets
    import huggingface_hub.constants

    monkeypatch.setenv(var, "1")  # as the libraries read it at import
    if var == "HF_HUB_OFFLINE":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(sources, "hub_unreachable", lambda *a: pytest.fail("probed the hub while offline"))
    message, seconds = _load_hub("someone/no-such-dataset")
    assert seconds < 5, seconds
    assert message == (
        "cannot load data.path='someone/no-such-dataset': it is not in the local datasets cache and the "
        f"Hugging Face hub is offline or unreachable ({var}=1 is set); run once with network access and "
        f"without {var} to cache it, or use local files: data.source=files "
        "'data.data_files=[/path/to/*.jsonl]'")
