"""The byte-level BPE tokenizer Kimi's released checkpoints ship: ``tiktoken.model`` +
``tokenizer_config.json``.

``tiktoken.model`` holds one ``<base64 bytes> <rank>`` line per mergeable token (163,584 in Kimi Linear's
release). The 256 ids after them are special tokens: those ``tokenizer_config.json`` names in
``added_tokens_decoder`` (``[BOS]``, ``[EOS]``, chat markers), the rest ``<|reserved_token_<id>|>``, so the
vocabulary is ranks + 256 (163,840, the model's ``vocab_size``). Text is pre-split by Kimi's pattern, which
keeps runs of Han characters apart from other letters, as Moonshot's ``tokenization_kimi.py`` defines it;
like that code, a text is encoded in windows of 400,000 characters, each cut inside any run of more than
25,000 whitespace or non-whitespace characters (tiktoken's regex engine overflows on longer ones).

Training data is encoded with special tokens as plain text: a document that contains the characters
``[EOS]`` does not end there. BPE files are only loaded here, never trained (a new vocabulary is
sentencepiece's job, :mod:`kimi.data.tokenizer`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import re
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Sequence

from kimi.errors import DataError

# Moonshot's pre-tokenisation pattern for Kimi (Kimi K2 / Kimi Linear releases, tokenization_kimi.py):
# Han runs, then cased letter runs with English contractions, digits in threes, punctuation, whitespace.
_NOT_HAN_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_NOT_HAN_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}*{_NOT_HAN_LOWER}+{_CONTRACTION}",
    rf"[^\r\n\p{{L}}\p{{N}}]?{_NOT_HAN_UPPER}+{_NOT_HAN_LOWER}*{_CONTRACTION}",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
NUM_SPECIAL = 256
CONFIG_NAME = "tokenizer_config.json"
WINDOW_CHARS = 400_000
MAX_RUN_CHARS = 25_000
_LINE = re.compile(rb"([A-Za-z0-9+/]+=*)[ \t]+(\d+)")
_RUN = re.compile(r"\s+|\S+")


def is_tiktoken_file(data: bytes) -> bool:
    """Whether file bytes look like a tiktoken BPE file (a sentencepiece model, a protobuf, starts with a
    newline byte, so its first line is empty)."""
    return _LINE.fullmatch(data.split(b"\n", 1)[0].rstrip(b"\r")) is not None


def segments(text: str) -> Iterator[str]:
    """``text`` in the pieces that are encoded apart (see the module docstring); they concatenate to it."""
    if len(text) <= MAX_RUN_CHARS:  # no run can be too long: the common case, one piece
        yield text
        return
    for w in range(0, len(text), WINDOW_CHARS):
        window, start = text[w:w + WINDOW_CHARS], 0
        for run in _RUN.finditer(window):
            for cut in range(run.start() + MAX_RUN_CHARS, run.end(), MAX_RUN_CHARS):
                yield window[start:cut]
                start = cut
        yield window[start:]


def _ranks(path: Path, data: bytes) -> Dict[bytes, int]:
    ranks: Dict[bytes, int] = {}
    for number, line in enumerate(data.splitlines(), 1):
        m = _LINE.fullmatch(line.strip())
        if m is None:
            if not line.strip():
                continue
            raise DataError(f"{path} line {number} is not '<base64 token> <rank>': not a tiktoken BPE file "
                            "(point data.tokenizer.model_path at a release's tiktoken.model)")
        try:
            token = base64.b64decode(m.group(1), validate=True)
        except binascii.Error:
            raise DataError(f"{path} line {number}: the token is not valid base64") from None
        ranks[token] = int(m.group(2))
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once (a damaged file?)")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(f"{path} lacks {len(missing)} of the 256 single bytes (first: {missing[0]}); a "
                        "byte-level BPE needs them all to encode any text")
    return ranks


def _token_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _specials(path: Path, num_base: int) -> tuple[Dict[str, int], int, int]:
    """(special token -> id, bos id or -1, eos id) from the ``tokenizer_config.json`` beside ``path``."""
    config_path = path.parent / CONFIG_NAME
    if not config_path.is_file():
        raise DataError(f"{path} is a tiktoken BPE file, and its special tokens ([EOS] ends every document) "
                        f"are named in {CONFIG_NAME}, which is missing beside it; copy the release's "
                        f"{CONFIG_NAME} into {path.parent}")
    try:
        config = json.loads(config_path.read_text())
        named = {int(i): t["content"] for i, t in config.get("added_tokens_decoder", {}).items()}
    except (ValueError, TypeError, KeyError) as e:
        raise DataError(f"{config_path} does not parse as a tokenizer config ({e}); restore the release's "
                        "copy") from None
    outside = sorted(i for i in named if not num_base <= i < num_base + NUM_SPECIAL)
    if outside:
        raise DataError(f"{config_path} names special token id {outside[0]}, outside the {NUM_SPECIAL} ids "
                        f"{num_base}..{num_base + NUM_SPECIAL - 1} that follow {path.name}'s {num_base} "
                        "tokens: the config belongs to another tokenizer")
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base, num_base + NUM_SPECIAL)}
    eos, bos = _token_name(config.get("eos_token")), _token_name(config.get("bos_token"))
    if eos not in specials:
        raise DataError(f"{config_path}'s eos_token {eos!r} is not one of its special tokens; documents are "
                        "separated by it, so it must name one (Kimi's base releases use '[EOS]')")
    return specials, specials.get(bos, -1), specials[eos]


class TiktokenBPE:
    """A loaded tiktoken BPE file with its special tokens (the interface of :class:`kimi.data.Tokenizer`)."""

    def __init__(self, path: Path, data: bytes):
        try:
            import tiktoken
        except ImportError:
            raise DataError(f"{path} is a tiktoken BPE file; reading it needs the tiktoken package "
                            "(pip install tiktoken, or reinstall kimi: it depends on it)") from None
        ranks = _ranks(path, data)
        specials, self.bos_id, self.eos_id = _specials(path, len(ranks))
        identity = json.dumps({"pattern": KIMI_PATTERN, "specials": sorted(specials.items(),
                                                                           key=lambda s: s[1]),
                               "bos": self.bos_id, "eos": self.eos_id}).encode()
        self.sha256 = hashlib.sha256(data + b"\0" + identity).hexdigest()
        self.files = [path, path.parent / CONFIG_NAME]
        self._enc = tiktoken.Encoding(path.name, pat_str=KIMI_PATTERN, mergeable_ranks=ranks,
                                      special_tokens=specials)
        self.vocab_size = len(ranks) + NUM_SPECIAL

    def encode(self, text: str) -> List[int]:
        return [i for piece in segments(text) for i in self._enc.encode_ordinary(piece)]

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        if all(len(t) <= MAX_RUN_CHARS for t in texts):
            return self._enc.encode_ordinary_batch(list(texts))
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids], errors="replace")
