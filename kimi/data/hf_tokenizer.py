"""A ``tokenizer.json`` as released with most open models, read by the ``tokenizers`` library.

Its special tokens decide where documents end: the EOS (and BOS) named by the ``tokenizer_config.json``
beside it when there is one (``eos_token``, ``bos_token``), else the first of the usual end-of-text names
among the file's own special tokens. Training text is encoded without the post-processor's additions
(``add_special_tokens=False``): the packer appends EOS itself.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

from kimi.errors import DataError, one_line

FILE_NAME = "tokenizer.json"
CONFIG_NAME = "tokenizer_config.json"
# Names of the end-of-text token in released tokenizers (GPT-2 and Qwen, Llama 3, Llama 2 and Mistral, ...).
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "[EOS]", "<|eot_id|>", "<|im_end|>")
BOS_NAMES = ("<|begin_of_text|>", "<s>", "<bos>", "[BOS]", "<|startoftext|>")


def is_tokenizer_json(data: bytes) -> bool:
    """Whether file bytes look like a tokenizers ``tokenizer.json`` (a JSON object with a ``model``)."""
    if not data.lstrip()[:1] == b"{":
        return False
    try:
        return isinstance(json.loads(data), dict) and "model" in json.loads(data)
    except ValueError:
        return False


def not_tokenizer_json(path: Path, data: bytes) -> str:
    """Why file bytes that are meant as a tokenizer.json (its name, or a leading '{') are not one."""
    try:
        parsed = json.loads(data)
    except ValueError as e:
        return (f"{path} is not a tokenizer.json: it is not valid JSON ({one_line(e)}); the file is damaged "
                "or cut short: fetch it again")
    missing = "entry" if isinstance(parsed, dict) else "object"
    return (f"{path} is not a tokenizer.json: it is JSON, but not the tokenizers library's format (no "
            f"'model' {missing}); use the tokenizer.json of a release")


def _name(value: Any) -> Optional[str]:
    return value.get("content") if isinstance(value, dict) else value


def _config(path: Path) -> Dict[str, Any]:
    config_path = path.parent / CONFIG_NAME
    if not config_path.is_file():
        return {}
    try:
        config = json.loads(config_path.read_text())
    except ValueError as e:
        raise DataError(f"{config_path} does not parse as a tokenizer config ({one_line(e)}); restore the "
                        "release's copy or remove it") from None
    return config if isinstance(config, dict) else {}


class HFTokenizerJSON:
    """A loaded ``tokenizer.json`` (the interface of :class:`kimi.data.Tokenizer`)."""

    def __init__(self, path: Path, data: bytes):
        from tokenizers import Tokenizer as _Tokenizer

        try:
            self._tok = _Tokenizer.from_str(data.decode("utf-8"))
        except Exception as e:  # noqa: BLE001 (the library raises a bare Exception for a malformed file)
            raise DataError(f"{path} does not load as a tokenizer.json ({one_line(e)}); point "
                            "data.tokenizer.model_path at a release's tokenizer.json") from None
        config = _config(path)
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        eos = _name(config.get("eos_token")) or next((n for n in EOS_NAMES if n in specials), None)
        bos = _name(config.get("bos_token")) or next((n for n in BOS_NAMES if n in specials), None)
        self.eos_id = self._tok.token_to_id(eos) if eos else None
        if self.eos_id is None:
            raise DataError(f"{path} names no end-of-text token (looked for {CONFIG_NAME}'s eos_token, then "
                            f"{', '.join(EOS_NAMES)}); documents are separated by it: put a {CONFIG_NAME} "
                            "with eos_token beside it")
        found = self._tok.token_to_id(bos) if bos else None
        self.bos_id = -1 if found is None else found
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        identity = json.dumps({"bos": self.bos_id, "eos": self.eos_id}).encode()
        self.sha256 = hashlib.sha256(data + b"\0" + identity).hexdigest()
        self.files = [path] + ([path.parent / CONFIG_NAME] if config else [])

    def encode(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> List[List[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)
