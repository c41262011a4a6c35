"""The tokenizer: a sentencepiece BPE trained on the training split, or a user's file (a sentencepiece
``.model``, the tiktoken BPE of Kimi's releases, :mod:`kimi.data.tiktoken_bpe`, or a ``tokenizer.json``,
:mod:`kimi.data.hf_tokenizer`, also named by the directory that holds it).

Training settings are chosen so that ``decode(encode(s)) == s`` for any string (except ones containing
sentencepiece's own meta symbol U+2581): identity normalisation, no whitespace collapsing, no dummy prefix,
and byte fallback for characters the vocabulary lacks. The same text always gives the same model bytes
(single trainer thread, no sampling), so the tokenizer hash is a stable cache key.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
from typing import Iterable, Iterator, List, Sequence, Union

import sentencepiece as spm

from kimi.data.sources import DataError
from kimi.data.hf_tokenizer import (FILE_NAME as TOKENIZER_JSON, HFTokenizerJSON, is_tokenizer_json,
                                   not_tokenizer_json)
from kimi.data.tiktoken_bpe import TiktokenBPE, is_tiktoken_file

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
# sentencepiece drops training sentences longer than max_sentence_length bytes; long lines are cut into
# chunks of at most this many characters (4 bytes each at worst) so none is lost.
_CHUNK_CHARS = 4096
_MAX_SENTENCE_BYTES = 4 * _CHUNK_CHARS


class _SentencePiece:
    """A sentencepiece model (the interface of :class:`Tokenizer`); its file bytes are its identity."""

    def __init__(self, path: Path, data: bytes):
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.files = [path]
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=data)
        except RuntimeError:  # sentencepiece's message is an internal source location, no help to a user
            raise DataError(f"{path} is neither a sentencepiece model (it does not parse) nor a tiktoken BPE "
                            "file; point data.tokenizer.model_path at a .model file written by sentencepiece "
                            "or at a Kimi release's tiktoken.model") from None
        self.vocab_size, self.eos_id, self.bos_id = (self._sp.get_piece_size(), self._sp.eos_id(),
                                                     self._sp.bos_id())

    def encode(self, text: str) -> List[int]:
        return self._sp.encode(text, out_type=int)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._sp.encode(list(texts), out_type=int)

    def decode(self, ids: Iterable[int]) -> str:
        return self._sp.decode([int(i) for i in ids])


def resolve_model_path(path: Path) -> Path:
    """The tokenizer file a path names: itself, or the tokenizer.json inside a directory (as releases
    ship)."""
    return path / TOKENIZER_JSON if path.is_dir() and (path / TOKENIZER_JSON).is_file() else path


class Tokenizer:
    """A loaded tokenizer file, sentencepiece or (as Kimi's releases ship) tiktoken BPE, told apart by its
    content; ``sha256`` identifies it in token-file metadata and checkpoints."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = resolve_model_path(Path(path))
        if not self.path.is_file():
            what = "is a directory without a tokenizer.json" if self.path.is_dir() else "does not exist"
            raise FileNotFoundError(f"tokenizer model {self.path} {what} (data.tokenizer.model_path must "
                                    "name a sentencepiece .model file, a tiktoken BPE file, a tokenizer.json "
                                    "or a directory holding one)")
        data = self.path.read_bytes()
        if is_tiktoken_file(data):
            self._impl, self.kind = TiktokenBPE(self.path, data), "tiktoken"
        elif is_tokenizer_json(data):
            self._impl, self.kind = HFTokenizerJSON(self.path, data), "tokenizer.json"
        elif self.path.suffix == ".json" or data.lstrip()[:1] == b"{":  # a sentencepiece model is neither
            raise DataError(not_tokenizer_json(self.path, data))
        else:
            self._impl, self.kind = _SentencePiece(self.path, data), "sentencepiece"
        self.sha256 = self._impl.sha256

    @property
    def vocab_size(self) -> int:
        return self._impl.vocab_size

    @property
    def eos_id(self) -> int:
        return self._impl.eos_id

    @property
    def bos_id(self) -> int:
        return self._impl.bos_id

    def encode(self, text: str) -> List[int]:
        return self._impl.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return self._impl.encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._impl.decode(ids)

    def copy_to(self, path: Union[str, os.PathLike]) -> "Tokenizer":
        """Copy the tokenizer's files so that ``path`` names the model file (a tiktoken file's config goes
        beside it, under its own name, and is written first: the model file marks the copy complete)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        model, *sidecars = self._impl.files
        for src, dst in [*((f, path.parent / f.name) for f in sidecars), (model, path)]:
            tmp = dst.with_name(f"{dst.name}.tmp-{os.getpid()}")
            tmp.write_bytes(src.read_bytes())
            os.replace(tmp, dst)
        return Tokenizer(path)

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.path)!r}, {self.kind}, vocab_size={self.vocab_size}, "
                f"sha256={self.sha256[:12]})")


def _training_sentences(texts: Iterable[str], max_chars: int) -> Iterator[str]:
    """Non-empty lines of the texts, long ones chunked, stopping after ``max_chars`` characters."""
    budget = max_chars
    for text in texts:
        for line in text.split("\n"):
            for start in range(0, len(line), _CHUNK_CHARS):
                piece = line[start:start + _CHUNK_CHARS][:budget]
                budget -= len(piece)
                yield piece
                if budget <= 0:
                    return


def train_tokenizer(texts: Iterable[str], vocab_size: int, out_path: Union[str, os.PathLike],
                    max_chars: int = 20_000_000) -> Tokenizer:
    """Train a BPE with ``vocab_size`` pieces on at most ``max_chars`` characters of ``texts``; write it to
    ``out_path`` atomically and return it loaded."""
    buf = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_training_sentences(texts, max_chars), model_writer=buf,
            model_type="bpe", vocab_size=vocab_size, byte_fallback=True,  # rare characters become byte pieces
            unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=-1,
            normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=False,
            allow_whitespace_only_pieces=True, max_sentence_length=_MAX_SENTENCE_BYTES,
            # Determinism: the merges depend on the thread count, and sampling would depend on a seed.
            num_threads=1, input_sentence_size=0, shuffle_input_sentence=False,
            minloglevel=2,  # warnings and errors only: training is otherwise a page of log lines
        )
    except RuntimeError as e:
        raise DataError(
            f"sentencepiece could not train a {vocab_size}-piece BPE tokenizer: {str(e).rstrip('.')}. "
            "A vocabulary must hold the 256 byte pieces, 3 special pieces and the common characters, and "
            "cannot exceed what the text supports: adjust data.tokenizer.vocab_size (lower it for a small "
            "corpus) or give more text (data.tokenizer.train_chars)") from e
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f"{out_path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(buf.getvalue())
    os.replace(tmp, out_path)
    return Tokenizer(out_path)
