"""A run's tokenizer as transformers' AutoTokenizer reads it: tokenizer.json (the `tokenizers` library's
pipeline) and tokenizer_config.json, beside the run's own file, which ``kimi.convert from-hf`` copies back.

* sentencepiece (what train.py trains): its tokenizer.model, and the tokenizer.json transformers derives
  from it following the model's own settings (no dummy prefix, identity normalisation, byte fallback);
* Kimi's tiktoken BPE: its tiktoken.model, tokenizer.json from transformers' tiktoken converter under Kimi's
  pre-split pattern with the 256 special tokens after the ranks, and one tokenizer_config.json that both
  transformers and kimi.data.tiktoken_bpe read (the special tokens' names, [EOS]);
* a tokenizer.json: itself, and its tokenizer_config.json.

Our tokenizer encodes text as text: ``[EOS]`` written in a document is not the end-of-text token. So the
config sets ``split_special_tokens``, and AutoTokenizer's ids equal ours; nothing is added around the text
unless a copied tokenizer.json's own post-processor adds it (then ``add_special_tokens=False`` matches).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from kimi.data import Tokenizer

CONFIG = "tokenizer_config.json"
JSON = "tokenizer.json"


def _fast_tokenizer(tokenizer: Tokenizer):
    """The `tokenizers` pipeline of a sentencepiece or tiktoken tokenizer, and tokenizer_config.json's names
    of its special tokens."""
    if tokenizer.kind == "sentencepiece":
        from sentencepiece import sentencepiece_model_pb2
        from transformers.convert_slow_tokenizer import SpmConverter

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(tokenizer.path.read_bytes())
        vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
        ids = {"unk_token": proto.trainer_spec.unk_id, "bos_token": tokenizer.bos_id,
               "eos_token": tokenizer.eos_id}
        names = {key: proto.pieces[i].piece for key, i in ids.items() if 0 <= i < len(proto.pieces)}
        return SpmConverter.build_tokenizer_from_spm_proto(proto, vocab), names
    from tokenizers import AddedToken
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from kimi.data.tiktoken_bpe import KIMI_PATTERN, NUM_SPECIAL

    fast = TikTokenConverter(vocab_file=str(tokenizer.path), pattern=KIMI_PATTERN).converted()
    first = tokenizer.vocab_size - NUM_SPECIAL  # the special ids follow the ranks; ours decodes them to names
    specials = {tokenizer.decode([i]): i for i in range(first, tokenizer.vocab_size)}
    fast.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    moved = [name for name, i in specials.items() if fast.token_to_id(name) != i]
    if moved:
        raise ValueError(f"{tokenizer.path}: transformers' converter put special token {moved[0]} at "
                         "another id than ours; the tokenizer.json would not match")
    by_id = {i: name for name, i in specials.items()}
    return fast, {key: by_id[i] for key, i in (("bos_token", tokenizer.bos_id),
                                               ("eos_token", tokenizer.eos_id))
                  if i in by_id}


def check_packages(tokenizer: Tokenizer) -> None:
    """Raise (one line) if converting `tokenizer` needs a package that is not installed: before anything is
    written."""
    import importlib.util

    needed = {"tokenizer.json": ("tokenizers",), "sentencepiece": ("transformers", "google.protobuf"),
              "tiktoken": ("transformers",)}[tokenizer.kind]
    missing = [name for name in needed if importlib.util.find_spec(name.split(".")[0]) is None
               or importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError(f"writing the {tokenizer.kind} tokenizer for transformers needs "
                         f"{', '.join(missing)}: pip install "
                         f"{' '.join(m.replace('google.', '') for m in missing)}")


def write_tokenizer(tokenizer: Tokenizer, directory: Path) -> list[str]:
    """Write `tokenizer` into `directory` for AutoTokenizer (module docstring); returns the file names."""
    directory = Path(directory)
    beside = tokenizer.path.parent / CONFIG
    config = {"tokenizer_class": "PreTrainedTokenizerFast",
              **(json.loads(beside.read_text()) if beside.is_file() else {})}
    if tokenizer.kind == "tokenizer.json":
        from tokenizers import Tokenizer as Fast

        fast, own_file = Fast.from_file(str(tokenizer.path)), None
        ids = (("bos_token", tokenizer.bos_id), ("eos_token", tokenizer.eos_id))
        names = {key: fast.id_to_token(i) for key, i in ids if i >= 0}
    else:
        fast, names = _fast_tokenizer(tokenizer)
        own_file = "tiktoken.model" if tokenizer.kind == "tiktoken" else "tokenizer.model"
        shutil.copyfile(tokenizer.path, directory / own_file)
    if own_file is None:
        shutil.copyfile(tokenizer.path, directory / JSON)
    else:
        fast.save(str(directory / JSON))
    config.update(names, split_special_tokens=True)
    (directory / CONFIG).write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return [JSON, CONFIG] + ([own_file] if own_file else [])
