"""data.streaming (kimi/data/streaming.py): a local dataset laid out like a hub repo, read through
load_dataset(path, streaming=True): the same windows as the prepared path's packing, an exact resume (loader
and trainer), disjoint data-parallel parts, and one-line refusals."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from kimi.config import ConfigError, DataConfig, DataSourceConfig
from kimi.errors import DataError
from kimi.data.loader import TokenLoader
from kimi.data.rules import validate_data
from kimi.data.streaming import StreamLoader, _digest, stream_ranks
from kimi.data.tokenizer import Tokenizer, train_tokenizer
from kimi.run.metrics import read_metrics
from helpers import train_run

WORDS = "the king a fool my lord loves fears follows the crown night sea stars letter".split()
SHARDS, PER_SHARD = 4, 6


def _docs(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [f"doc{i:03d} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 60)))
            for i in range(SHARDS * PER_SHARD)]


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """A hub-like dataset directory: data/train-0000k-of-00004.parquet, a text column and another one."""
    root = tmp_path_factory.mktemp("repo")
    (root / "data").mkdir()
    docs = _docs()
    for k in range(SHARDS):
        part = docs[k * PER_SHARD:(k + 1) * PER_SHARD]
        table = pa.table({"content": part, "id": list(range(k * PER_SHARD, (k + 1) * PER_SHARD))})
        pq.write_table(table, root / "data" / f"train-{k:05d}-of-{SHARDS:05d}.parquet")
    return root


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return train_tokenizer(_docs(), 300, tmp_path_factory.mktemp("tok") / "tokenizer.model")


def _cfg(repo: Path, **kw) -> DataConfig:
    return DataConfig(source="hf", path=str(repo), text_field="content", streaming=True, **kw)


def _packed(tok: Tokenizer, docs: list[str]) -> np.ndarray:
    """The prepared path's layout (kimi.data.pack): every document's tokens, then EOS."""
    return np.concatenate([np.asarray(ids + [tok.eos_id], np.int64) for ids in tok.encode_batch(docs)])


@pytest.mark.unit
def test_stream_windows_equal_prepared_packing(repo, tok):
    stream = StreamLoader(_cfg(repo), tok, batch_size=3, seq_len=16)
    packed = TokenLoader(_packed(tok, _docs()), 3, 16, seed=0, eos_id=tok.eos_id, shuffle=False)
    for _ in range(packed.batches_per_epoch):
        got, want = stream.next_batch(), packed.next_batch()
        for name in ("input_ids", "labels", "doc_starts"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name


@pytest.mark.unit
def test_local_text_files_stream_one_document_each(tmp_path, tok):
    docs = _docs()[:5]
    for i, doc in enumerate(docs):
        (tmp_path / f"d{i}.txt").write_text(doc + "\nand a second line")
    cfg = DataConfig(source="files", data_files=[str(tmp_path / "*.txt")], streaming=True)
    stream = StreamLoader(cfg, tok, batch_size=1, seq_len=8)
    packed = TokenLoader(_packed(tok, [d + "\nand a second line" for d in docs]), 1, 8, seed=0,
                         eos_id=tok.eos_id, shuffle=False)
    for _ in range(packed.batches_per_epoch):
        assert torch.equal(stream.next_batch().input_ids, packed.next_batch().input_ids)


def _batches(loader, n: int) -> list[torch.Tensor]:
    return [loader.next_batch().input_ids for _ in range(n)]


@pytest.mark.unit
@pytest.mark.parametrize("dp_world", [1, 3], ids=["one-rank", "three-ranks-by-example"])
def test_loader_resumes_exactly_across_epochs(repo, tok, dp_world):
    cfg = _cfg(repo)
    whole = StreamLoader(cfg, tok, 4, 24, dp_rank=dp_world - 1, dp_world=dp_world)
    want = _batches(whole, 70)
    assert whole.epoch >= 2  # the resume below crosses the end of the stream
    first = StreamLoader(cfg, tok, 4, 24, dp_rank=dp_world - 1, dp_world=dp_world)
    head = _batches(first, 34)
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint keeps it: plain data
    second = StreamLoader(cfg, tok, 4, 24, dp_rank=dp_world - 1, dp_world=dp_world)
    second.load_state_dict(state)
    got = head + _batches(second, 36)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.unit
@pytest.mark.parametrize("dp_world", [2, 3], ids=["by-file", "by-example"])
def test_ranks_read_disjoint_documents(repo, tok, dp_world):
    seen = []
    for rank in range(dp_world):
        loader = StreamLoader(_cfg(repo), tok, 2, 16, dp_rank=rank, dp_world=dp_world)
        ids = []  # the windows' inputs, in order, are the stream's tokens without a gap
        while loader.epoch == 0:  # through this rank's whole part (and into its repeat)
            ids += loader.next_batch().input_ids.flatten().tolist()
        seen.append(set(re.findall(r"doc\d{3}", tok.decode(ids))))
    assert set().union(*seen) == {f"doc{i:03d}" for i in range(SHARDS * PER_SHARD)}
    assert sum(map(len, seen)) == SHARDS * PER_SHARD  # no document on two ranks


@pytest.mark.unit
def test_validation_is_held_out_and_fixed(repo, tok):
    t = dataclasses.make_dataclass("T", [("micro_batch_size", int, 2), ("seq_len", int, 16),
                                         ("grad_accum_steps", int, 1), ("eval_batches", int, 2),
                                         ("seed", int, 0)])()
    loader, val = stream_ranks(type("D", (), {"cfg": _cfg(repo), "tokenizer": tok})(), t, 0, 1)
    held = set(re.findall(r"doc\d{3}", tok.decode(torch.cat([b.input_ids.flatten() for b in val]).tolist())))
    assert len(val) == 2 and held
    trained = []
    while loader.epoch == 0:
        trained += loader.next_batch().input_ids.flatten().tolist()
    assert held.isdisjoint(re.findall(r"doc\d{3}", tok.decode(trained)))
    _, again = stream_ranks(type("D", (), {"cfg": _cfg(repo), "tokenizer": tok})(), t, 0, 1)
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(val, again))


@pytest.mark.unit
def test_subset_and_its_validation_split(tmp_path, tok):
    # A hub repo's README names subsets (data.config) and their splits: the validation windows come from the
    # subset's validation split, and training reads every document of its train split, none skipped.
    (tmp_path / "README.md").write_text(
        "---\nconfigs:\n- config_name: small\n  data_files:\n  - split: train\n"
        "    path: small/train-*.parquet\n"
        "  - split: validation\n    path: small/validation-*.parquet\n- config_name: other\n"
        "  data_files: other/*.parquet\n---\n")
    docs = _docs()
    for name, part in (("small/train-0", docs[:8]), ("small/validation-0", docs[8:16]),
                       ("other/x", docs[16:])):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"content": part}), tmp_path / f"{name}.parquet")
    t = dataclasses.make_dataclass("T", [("micro_batch_size", int, 2), ("seq_len", int, 16),
                                         ("grad_accum_steps", int, 1), ("eval_batches", int, 1),
                                         ("seed", int, 0)])()
    cfg = _cfg(tmp_path, config="small", val_split="validation")
    loader, val = stream_ranks(type("D", (), {"cfg": cfg, "tokenizer": tok})(), t, 0, 1)
    names = lambda ids: set(re.findall(r"doc\d{3}", tok.decode(ids.flatten().tolist())))  # noqa: E731
    assert names(torch.cat([b.input_ids for b in val])) <= {f"doc{i:03d}" for i in range(8, 16)}
    trained = []  # the windows' inputs, in order, are the stream's tokens without a gap
    while loader.epoch == 0:
        trained.append(loader.next_batch().input_ids)
    assert names(torch.cat(trained)) == {f"doc{i:03d}" for i in range(8)}


@pytest.mark.unit
def test_one_line_refusals(repo, tok, tmp_path):
    blend = _cfg(repo, sources=[DataSourceConfig(name="a"), DataSourceConfig(name="b")])
    with pytest.raises(ConfigError, match="data.streaming=True is invalid: a blend"):
        validate_data(blend)
    two = StreamLoader(_cfg(repo), tok, 2, 16, dp_rank=0, dp_world=2)
    two.next_batch()
    one = StreamLoader(_cfg(repo), tok, 2, 16)
    with pytest.raises(DataError, match=r"saved on 2 data-parallel rank\(s\) and this run has 1") as e:
        one.load_state_dict(two.state_dict())
    assert "\n" not in str(e.value)
    # what checkpoint.load hands each loader of the other's state: only the keys its own state has
    shards = TokenLoader(np.arange(200), 2, 16, seed=0, eos_id=tok.eos_id)
    with pytest.raises(DataError, match=r"read prepared token shards and this run streams"):
        one.load_state_dict({k: v for k, v in shards.state_dict().items() if k in one.state_dict()})
    with pytest.raises(DataError, match=r"read a stream \(data.streaming=true\) and this run reads prepared"):
        shards.load_state_dict({k: v for k, v in one.state_dict().items() if k in shards.state_dict()})
    every = {_digest(d) for d in _docs()}
    with pytest.raises(DataError, match="rank 0's part of the stream has no document to train on"):
        StreamLoader(_cfg(repo), tok, 2, 16, skip=every).next_batch()
    from kimi.data.prepare.__main__ import main as prepare_main

    with pytest.raises(DataError, match="no shards to prepare"):
        prepare_main(["data.source=hf", f"data.path={repo}", "data.streaming=true"])
    broken = tmp_path / "broken"
    (broken / "data").mkdir(parents=True)
    (broken / "data" / "train-00000-of-00001.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(DataError, match="cannot stream data.path=") as e:
        StreamLoader(_cfg(broken), tok, 2, 16).next_batch()
    assert "\n" not in str(e.value)


@pytest.mark.unit
def test_hub_name_without_network_is_one_line(monkeypatch, tmp_path):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DataError, match=r"cannot stream data.path='someone/absent': the Hugging Face hub is "
                                        r"offline or unreachable \(HF_HUB_OFFLINE=1 is set\)") as e:
        StreamLoader(_cfg(Path("someone/absent"), cache_dir=str(tmp_path)), None, 2, 16)
    assert "\n" not in str(e.value)


@pytest.mark.e2e
def test_trainer_resume_equals_uninterrupted(repo, tmp_path):
    # No tokenizer given: the run trains one on the stream's first characters, as the docs say. Ten steps of
    # 4 x 96 tokens pass the end of the stream (about 2,100 training tokens after the 769 held out) after the
    # resume at step 5.
    data = ["data.source=hf", f"data.path={repo}", "data.text_field=content", "data.streaming=true",
            f"data.cache_dir={tmp_path / 'cache'}"]
    common = ["trainer.max_steps=10", "trainer.seq_len=96", "trainer.checkpoint_every=0",
              "trainer.eval_every=5", "data.tokenizer.vocab_size=300"]
    full = train_run(tmp_path / "full", data, *common)
    run = tmp_path / "split"
    assert train_run(run, data, *common, "trainer.stop_at_step=5").step == 5
    resumed = train_run(run, data, *common)
    assert resumed.loader.epoch == full.loader.epoch == 1
    a, b = read_metrics(tmp_path / "full" / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    for key in ("loss", "val_loss"):
        assert [r[key] for r in a if key in r] == [r[key] for r in b if key in r]
    for (name, p), q in zip(full.model.state_dict().items(), resumed.model.state_dict().values()):
        assert torch.equal(p, q), name


@pytest.mark.dist
@pytest.mark.slow
def test_two_ranks_resume_equals_uninterrupted(repo, tmp_path):
    # Each rank reads its own part, so the checkpoint must hold both ranks' positions (gathered into the one
    # copy it keeps of what is not a tensor): steps 1-3, then 4-6, on 2 ranks equal steps 1-6 on 2 ranks.
    from layout_runs import dist_train, final_weights, metrics, resumed_at

    from helpers import TINY_TRAINER

    args = [*TINY_TRAINER, "data.source=hf", f"data.path={repo}", "data.text_field=content",
            "data.streaming=true", f"data.cache_dir={tmp_path / 'cache'}", "data.tokenizer.vocab_size=300",
            "trainer.max_steps=6", "trainer.seq_len=64", "trainer.eval_every=3", "trainer.checkpoint_every=0",
            "parallel.dp_shard=2"]
    # one launch: the three starts one after another (the second start of "split" resumes the first's)
    dist_train(2, [(tmp_path / "full", args), (tmp_path / "split", [*args, "trainer.stop_at_step=3"]),
                   (tmp_path / "split", args)], tmp_path / "runs.pkl")
    assert resumed_at(tmp_path / "split") == [3]
    assert metrics(tmp_path / "split") == metrics(tmp_path / "full")
    assert len(metrics(tmp_path / "full")[0]) == 6
    got, want = final_weights(tmp_path / "split", tmp_path), final_weights(tmp_path / "full", tmp_path)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
