"""Kimi's tiktoken tokenizer (kimi.data.tiktoken_bpe): ids equal to Hugging Face `tokenizers` (an independent
BPE and regex engine) under the same files and pattern; Kimi's pattern keeps Han apart from Latin letters;
the special-token table follows the release's layout; long runs are cut where Moonshot's code cuts them;
bad files are refused with what to do; data preparation and run dirs carry the config beside the model."""

import json

import numpy as np
import pytest
import tiktoken  # noqa: F401 (a hard dependency: imported so that without it this module fails, never skips)

from helpers import GPT_PATTERN, MIXED_TEXT, write_kimi_tiktoken
from kimi.config import DataConfig, TokenizerConfig
from kimi.data import DataError, Tokenizer, open_tokens, prepare
from kimi.data import tiktoken_bpe
from kimi.data.tiktoken_bpe import KIMI_PATTERN

pytestmark = pytest.mark.unit

TEXTS = [MIXED_TEXT, "中文abc Kimi训练 文abc", "Don't SHOUT, we'll see: 3.14159 and 1,000,000!",
         "  leading\twhitespace \n\n\n trailing   ", "emoji 🙂🚀 and ℕ𝕆𝕋 letters", "[EOS] is text here", ""]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return write_kimi_tiktoken(tmp_path_factory.mktemp("kimi_tok"))


def test_ids_equal_huggingface_tokenizers(bpe):
    from transformers.convert_slow_tokenizer import TikTokenConverter

    ours = Tokenizer(bpe)
    theirs = TikTokenConverter(vocab_file=str(bpe), pattern=KIMI_PATTERN).converted()
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text, add_special_tokens=False).ids, text
        assert ours.decode(ids) == text
    assert ours.encode_batch(TEXTS) == [ours.encode(t) for t in TEXTS]


def test_han_runs_are_split_from_latin_letters(bpe):
    """The BPE was trained under GPT's pattern on text with '文abc', so it has tokens crossing from Han into
    Latin; GPT's pattern uses them, Kimi's never does."""
    ours = Tokenizer(bpe)
    text = "中文abc文abc"
    gpt = ours._impl._enc.__class__("gpt", pat_str=GPT_PATTERN,
                                    mergeable_ranks=ours._impl._enc._mergeable_ranks, special_tokens={})
    crossing = [i for i in gpt.encode_ordinary(text)
                if "文a" in gpt.decode_single_token_bytes(i).decode(errors="ignore")]
    assert crossing, "the fixture's BPE should have a token crossing from Han into Latin"
    assert ours.encode(text) == (ours.encode("中文") + ours.encode("abc") + ours.encode("文")
                                 + ours.encode("abc"))


def test_special_tokens_follow_the_release_layout(bpe):
    tok = Tokenizer(bpe)
    n = len(bpe.read_text().splitlines())
    assert (tok.kind, tok.vocab_size, tok.bos_id, tok.eos_id) == ("tiktoken", n + 256, n, n + 1)
    assert tok.decode([n + 1, n + 2, n + 7, n + 255]) == f"[EOS]<|im_end|><|reserved_token_{n + 7}|>[PAD]"
    assert n + 1 not in tok.encode("a document that says [EOS] in its text")


def _naive_segments(text: str):
    """The cut rule as a character-by-character loop: windows of 400,000 characters, and inside each a cut
    before the character that would make a run of whitespace or non-whitespace longer than 25,000."""
    out = []
    for w in range(0, len(text), tiktoken_bpe.WINDOW_CHARS):
        window, start, run, space = text[w:w + tiktoken_bpe.WINDOW_CHARS], 0, 0, None
        for i, ch in enumerate(window):
            if ch.isspace() != space:
                run, space = 1, ch.isspace()
            else:
                run += 1
                if run > tiktoken_bpe.MAX_RUN_CHARS:
                    out.append(window[start:i])
                    start, run = i, 1
        out.append(window[start:])
    return out


def test_long_runs_are_cut_where_moonshots_code_cuts(bpe, monkeypatch):
    monkeypatch.setattr(tiktoken_bpe, "WINDOW_CHARS", 4000)
    monkeypatch.setattr(tiktoken_bpe, "MAX_RUN_CHARS", 250)
    for text in ["a" * 1000 + " " * 600 + "b c", "x" * 250 + " " + "y" * 251, ("ab " * 700 + "z" * 900) * 3,
                 "short"]:
        assert list(tiktoken_bpe.segments(text)) == _naive_segments(text)
    tok = Tokenizer(bpe)
    text = "文" * 700 + "a" * 1300 + "\n" * 300 + MIXED_TEXT * 30
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.encode_batch([text, "x"]) == [ids, tok.encode("x")]


BAD = [
    ("a line that is not a rank", lambda d: (d / "tiktoken.model").write_text(
        (d / "tiktoken.model").read_text() + "not base64!! x\n"), "line .* is not '<base64 token> <rank>'"),
    ("a rank twice", lambda d: (d / "tiktoken.model").write_text(
        (d / "tiktoken.model").read_text() + "QUJDREVG 3\n"), "ranks are not 0..400, each once"),
    ("no config", lambda d: (d / "tokenizer_config.json").unlink(),
     "tokenizer_config.json, which is missing"),
    ("eos not special", lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "</s>", "added_tokens_decoder": {}})), "eos_token '</s>' is not one of its special"),
    ("config of another tokenizer", lambda d: (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "[EOS]", "added_tokens_decoder": {"5": {"content": "[EOS]"}}})),
     "special token id 5, outside"),
]


@pytest.mark.parametrize("name,damage,message", BAD, ids=[b[0] for b in BAD])
def test_bad_files_are_refused_with_what_to_do(tmp_path, name, damage, message):
    path = write_kimi_tiktoken(tmp_path)
    damage(tmp_path)
    with pytest.raises(DataError, match=message):
        Tokenizer(path)


def test_prepared_data_and_its_cache_keep_the_config_beside_the_model(bpe, tmp_path):
    from helpers import make_corpus, offline_caches

    gen = offline_caches(tmp_path / "hf")
    next(gen)
    corpus = make_corpus(tmp_path / "corpus", docs=8, sentences=10)
    cfg = DataConfig(name="tk", source="files", data_files=[str(corpus / "*.txt")], val_fraction=0.25,
                     cache_dir=str(tmp_path / "cache"), tokenizer=TokenizerConfig(model_path=str(bpe)))
    first = prepare(cfg)
    assert (first.data_dir / "tokenizer_config.json").is_file()
    again = prepare(cfg)  # from the cache: the copy in the data dir is read back with its config
    assert again.tokenizer.sha256 == first.tokenizer.sha256 == Tokenizer(bpe).sha256
    tokens = open_tokens(again.shards["train"][-1], expected_tokenizer_sha256=first.tokenizer.sha256)
    assert tokens.dtype == np.uint16 and tokens[-1] == first.tokenizer.eos_id
    text = (corpus / sorted(p.name for p in corpus.iterdir())[0]).read_text()
    assert first.tokenizer.decode(first.tokenizer.encode(text)) == text
    # The config decides the eos id, so it is part of the identity: another config, another tokenizer.
    config = json.loads((bpe.parent / "tokenizer_config.json").read_text())
    other = tmp_path / "other"
    other.mkdir()
    (other / "tiktoken.model").write_bytes(bpe.read_bytes())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": "<|im_end|>"}))
    assert Tokenizer(other / "tiktoken.model").sha256 != first.tokenizer.sha256
    gen.close()
