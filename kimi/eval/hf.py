"""The cross-check: a run's transformers export (`python -m kimi.convert to-hf`) scored by lm-eval's own `hf`
model, with the run's tokenizer as a transformers tokenizer that encodes exactly as ours does."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from kimi.config import ConfigError


def hf_tokenizer(tokenizer):
    """A PreTrainedTokenizerFast encoding as `tokenizer` (a kimi Tokenizer) does: a sentencepiece model
    rebuilt from its own settings (normaliser, whitespace, byte fallback, merges ranked by score), or the
    tokenizer.json itself. EOS is its EOS; no BOS, so lm-eval's hf model starts empty contexts from EOS as
    KimiLM does."""
    from transformers import PreTrainedTokenizerFast

    if tokenizer.kind == "sentencepiece":
        from transformers.convert_slow_tokenizer import SpmConverter, import_protobuf

        proto = import_protobuf().ModelProto()
        proto.ParseFromString(tokenizer.path.read_bytes())
        vocab = {piece.piece: i for i, piece in enumerate(proto.pieces)}
        backend = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=False)
        eos = proto.pieces[tokenizer.eos_id].piece
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos)
    if tokenizer.kind == "tokenizer.json":
        from tokenizers import Tokenizer as Backend

        backend = Backend.from_file(str(tokenizer.path))
        backend.post_processor = None  # ours encodes without the post-processor's additions
        eos = backend.id_to_token(tokenizer.eos_id)
        return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=eos)
    raise ConfigError(f"hf= needs a sentencepiece or tokenizer.json tokenizer; this run's is "
                      f"{tokenizer.kind} ({tokenizer.path}): score the export with lm_eval --model hf and "
                      "its own tokenizer")


@contextlib.contextmanager
def torch_kda():
    """transformers' Kimi Linear runs KDA with fla-core's GPU kernels whenever fla is importable: on CPU, its
    PyTorch functions (what each wraps) while the block runs."""
    try:
        from transformers.models.kimi_linear import modeling_kimi_linear as module
    except ImportError:
        yield
        return
    names = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")
    saved = {name: getattr(module, name) for name in names}
    try:
        for name, fn in saved.items():
            setattr(module, name, getattr(fn, "__wrapped__", fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(module, name, fn)


def read_config(hf_dir: str) -> dict:
    """config.json of an hf= directory; one line when it has none or it does not parse."""
    config = Path(hf_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"hf={hf_dir} has no config.json: give the directory kimi.convert to-hf "
                                "wrote")
    try:
        found = json.loads(config.read_text())
    except ValueError as e:
        raise ConfigError(f"hf={hf_dir}: {config} is not valid JSON ({e}): export the run again") from None
    if not isinstance(found, dict):
        raise ConfigError(f"hf={hf_dir}: {config} is not a JSON object: export the run again")
    return found


def check_folder(hf_dir: str, trust_remote_code: bool, trust_modified_code: bool) -> bool:
    """Whether loading the hf= directory runs its own code (config.json's auto_map), once the keys allow it
    (kimi.interop.trust.allow_code); weights its index names (or links) outside it are refused too
    (kimi.folders), transformers would read them. Each refusal a one-line ConfigError, nothing imported."""
    from kimi.interop.remote import INDEX, shard_files
    from kimi.interop.trust import allow_code

    directory = Path(hf_dir)
    remote = allow_code(directory, read_config(hf_dir), trust_remote_code, trust_modified_code)
    if any(os.path.lexists(directory / name) for name in (INDEX, "model.safetensors")):
        try:
            shard_files(directory)
        except ValueError as e:
            raise ConfigError(f"hf={hf_dir}: {e}") from None
    return remote


def hf_lm(hf_dir: str, tokenizer, batch_size: int, max_length: int, device: str,
          trust_remote_code: bool = False, trust_modified_code: bool = False):
    """lm-eval's HFLM on an exported directory (fp32). Its generation stops at the tokenizer's EOS, as ours
    does, when the export's generation config names none. A directory whose config.json maps its own
    modeling code (auto_map: to-hf's export of a model transformers has no class for) is loaded with that
    code, one sequence per call, only as the trust keys allow (check_folder)."""
    remote = check_folder(hf_dir, trust_remote_code, trust_modified_code)
    from lm_eval.models.huggingface import HFLM

    tok = hf_tokenizer(tokenizer)
    # the exported modeling code runs rows without padding, and lm-eval pads a batch of generations
    lm = HFLM(pretrained=hf_dir, tokenizer=tok, batch_size=1 if remote else batch_size, max_length=max_length,
              device=device, dtype="float32", trust_remote_code=remote)
    if lm.model.generation_config.eos_token_id is None:
        lm.model.generation_config.eos_token_id = tokenizer.eos_id
    return lm
