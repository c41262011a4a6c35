"""Blends (data.sources): the sampling rule against an exact-arithmetic reference, per-source epochs, exact
resume on another layout, per-source validation losses, and preparing a blend with a tokenizer.json (killed
and run again)."""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from kimi.config import DataConfig, DataSourceConfig, TokenizerConfig
from kimi.data import DataError, load_documents, prepare, read_tokens
from kimi.data import shards
from kimi.data.blend import BlendLoader, ValBatches, assign
from helpers import make_corpus

pytestmark = pytest.mark.unit

T = 8


def _reference_sources(weights, n):
    """The blend rule in exact fractions: sample i from the source lagging its share the most."""
    total = sum(Fraction(w) for w in weights)
    counts, out = [0] * len(weights), []
    for i in range(n):
        err = [Fraction(w) / total * (i + 1) - c for w, c in zip(weights, counts)]
        j = err.index(max(err))
        out.append(j)
        counts[j] += 1
    return out


def test_assign_follows_the_weights_at_every_prefix():
    weights = [3.0, 1.0, 0.5]
    which, counts = assign(weights, [0, 0, 0], 0, 900)
    assert which.tolist() == _reference_sources(weights, 900)
    share = np.array(weights) / sum(weights)
    seen = np.zeros(3)
    for i, j in enumerate(which):
        seen[j] += 1
        assert np.all(np.abs(seen - share * (i + 1)) <= 1.0)
    assert counts.tolist() == [600, 200, 100]
    # from the middle, given the counts so far: the same continuation
    later, _ = assign(weights, np.bincount(which[:301], minlength=3).tolist(), 301, 599)
    assert later.tolist() == which[301:].tolist()


def _sources():
    """Three sources whose token values say which source and which window they are (source j: j*10000 +
    position), of 5, 9 and 40 windows."""
    return [np.arange(n * T + 1, dtype=np.uint32) + j * 10000 for j, n in enumerate((5, 9, 40))]


def _who(batch) -> list:
    return [(int(r[0]) // 10000, int(r[0]) % 10000 // T) for r in batch.input_ids]


def test_blend_loader_draws_by_weight_with_each_source_on_its_own_epochs():
    sources, weights = _sources(), [1.0, 1.0, 2.0]
    loader = BlendLoader(sources, weights, 4, T, seed=7, eos_id=-1)
    drawn = [w for _ in range(30) for w in _who(loader.next_batch())]
    assert [j for j, _ in drawn] == _reference_sources(weights, 120)
    for j, n in enumerate((5, 9, 40)):
        mine = [w for s, w in drawn if s == j]
        for e in range(len(mine) // n):  # every full epoch of a source is a permutation of its windows
            epoch = mine[e * n:(e + 1) * n]
            assert sorted(epoch) == list(range(n))
            assert epoch == np.random.default_rng([7, e, j]).permutation(n).tolist()
    # the 5-window source has gone round 6 times while the 40-window one is in its second pass
    assert len([1 for s, _ in drawn if s == 0]) == 30 and len([1 for s, _ in drawn if s == 2]) == 60


def _layout(micro, ranks, accum, seed=7):
    sources = _sources()
    return [BlendLoader(sources, [1.0, 1.0, 2.0], micro, T, seed=seed, eos_id=-1, dp_rank=r, dp_world=ranks,
                        global_batch=micro * ranks * accum) for r in range(ranks)], accum


def _step(layout) -> list:
    loaders, accum = layout
    return sorted(w for _ in range(accum) for ld in loaders for w in _who(ld.next_batch()))


@pytest.mark.parametrize("saved,resumed", [((2, 2, 1), (2, 1, 2)), ((4, 1, 1), (2, 2, 1))])
def test_blend_resumes_on_another_layout(saved, resumed):
    reference = _layout(*saved)
    expected = [_step(reference) for _ in range(20)]
    first = _layout(*saved)
    assert [_step(first) for _ in range(6)] == expected[:6]
    state = json.loads(json.dumps(first[0][0].state_dict()))
    again = _layout(*resumed, seed=0)
    for ld in again[0]:
        ld.load_state_dict(state)
    assert [_step(again) for _ in range(14)] == expected[6:]
    other = BlendLoader(_sources(), [1.0, 2.0, 2.0], 4, T, seed=7, eos_id=-1)
    with pytest.raises(DataError, match="data.sources weights"):
        other.load_state_dict(state)


def test_validation_losses_per_source_and_blended():
    losses = torch.tensor([1.0, 3.0, 2.0, 6.0, 4.0], dtype=torch.float64)
    single = ValBatches([None] * 5)
    assert single.reduce(losses.clone(), lambda x: x) == losses.mean().item() and single.note() == ""
    blend = ValBatches([None] * 5, [("a", 1.0, 0, 2), ("b", 3.0, 2, 5)])
    value = blend.reduce(losses, lambda x: x)
    assert blend.by_source == {"val_loss/a": 2.0, "val_loss/b": 4.0}
    assert value == pytest.approx((1.0 * 2.0 + 3.0 * 4.0) / 4.0) and blend.note() == "; a 2.0000; b 4.0000"


def _tokenizer_json(texts, path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=350, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def test_prepare_a_blend_with_a_tokenizer_json_killed_and_rerun(tmp_path, offline, monkeypatch):
    books = make_corpus(tmp_path / "books", docs=10, sentences=20)
    rows = tmp_path / "web.jsonl"
    rows.write_text("".join(json.dumps({"body": f"row {i}: " + "the sea and the stars " * (i % 7 + 1)}) + "\n"
                            for i in range(40)))
    tok_dir = _tokenizer_json([p.read_text() for p in books.iterdir()], tmp_path / "tok")
    cfg = DataConfig(name="mix", cache_dir=str(tmp_path / "cache"), shard_mb=300 / 2**20,
                     tokenizer=TokenizerConfig(model_path=str(tok_dir)),
                     sources=[DataSourceConfig(name="books", weight=2.0, source="files",
                                               data_files=[str(books / "*.txt")], val_fraction=0.2),
                              DataSourceConfig(name="web", source="files", data_files=[str(rows)],
                                               text_field="body", val_fraction=0.1)])
    close, closed = shards.ShardWriter._close, []

    def killed(writer):
        if writer.split == "train" and writer.path.parent.name.startswith("web") and closed:
            raise KeyboardInterrupt  # the second source's second shard: the first source is finished
        close(writer)
        closed.append(writer.path) if writer.path.parent.name.startswith("web") else None

    monkeypatch.setattr(shards.ShardWriter, "_close", killed)
    with pytest.raises(KeyboardInterrupt):
        prepare(cfg, limit=False)
    monkeypatch.setattr(shards.ShardWriter, "_close", close)
    kept = {p: p.stat().st_mtime_ns for p in closed}
    blend = prepare(cfg, limit=False)
    assert {p: p.stat().st_mtime_ns for p in closed} == kept and len(kept) == 1
    assert blend.names == ["books", "web"] and blend.weights == [2.0, 1.0]
    assert blend.tokenizer.kind == "tokenizer.json"
    for part in blend.parts:
        manifest = json.loads((part.data_dir / "manifest.json").read_text())
        assert manifest["tokenizer"]["sha256"] == blend.tokenizer.sha256
        shards_listed = manifest["splits"]["train"]["shards"]
        assert all((part.data_dir / s["file"]).with_suffix(".idx").is_file() for s in shards_listed)
    web = blend.parts[1]
    # the second source as a single-source config: the same documents, the same tokens
    alone = DataConfig(name="web", source="files", data_files=[str(rows)], text_field="body",
                       val_fraction=0.1, cache_dir=str(tmp_path / "cache"),
                       tokenizer=TokenizerConfig(model_path=str(tok_dir)))
    train, _ = load_documents(alone)
    tok = blend.tokenizer
    assert read_tokens(web, "train").tolist() == [i for t in train["text"]
                                                  for i in tok.encode(t) + [tok.eos_id]]


def test_a_blend_without_a_tokenizer_trains_one_on_its_sources_by_weight(tmp_path, offline, monkeypatch):
    """No data.tokenizer.model_path: one BPE is trained on the blend, each source giving its weight's share of
    data.tokenizer.train_chars (documents drawn across it), cached, so a second prepare trains nothing; every
    source is tokenised with it, and another weight is another tokenizer."""
    from kimi.data import pack

    def corpus(name, word):
        folder = tmp_path / name
        folder.mkdir()
        for i in range(30):
            (folder / f"{i:02d}.txt").write_text(f"{word} number {i} says {word} again. " * 6)
        return folder

    seen = []
    real = pack.train_tokenizer

    def recording(texts, *args, **kwargs):
        seen.append(list(texts))
        return real(seen[-1], *args, **kwargs)

    monkeypatch.setattr(pack, "train_tokenizer", recording)

    def config(weight_b):
        return DataConfig(name="mix", cache_dir=str(tmp_path / "cache"),
                          tokenizer=TokenizerConfig(vocab_size=300, train_chars=6000),
                          sources=[DataSourceConfig(name="a", weight=2.0, source="files",
                                                    data_files=[str(corpus_a / "*.txt")], val_fraction=0.1),
                                   DataSourceConfig(name="b", weight=weight_b, source="files",
                                                    data_files=[str(corpus_b / "*.txt")], val_fraction=0.1)])

    corpus_a, corpus_b = corpus("a", "zebra"), corpus("b", "quokka")
    blend = prepare(config(1.0), limit=False)
    (texts,) = seen
    chars = {w: sum(len(t) for t in texts if w in t) for w in ("zebra", "quokka")}
    doc = len(texts[0])
    assert 4000 <= chars["zebra"] < 4000 + doc and 2000 <= chars["quokka"] < 2000 + doc  # 2 : 1 of 6000
    tok = blend.tokenizer
    assert {p.tokenizer.sha256 for p in blend.parts} == {tok.sha256}
    assert len(tok.encode("zebra quokka")) < len("zebra quokka")  # both sources' words made pieces
    again = prepare(config(1.0), limit=False)
    assert len(seen) == 1 and again.tokenizer.sha256 == tok.sha256  # cached: nothing trained
    other = prepare(config(3.0), limit=False)
    assert len(seen) == 2 and other.tokenizer.sha256 != tok.sha256
