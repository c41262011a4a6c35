"""Export of any model with its own modeling code (transformers' trust_remote_code, as Moonshot releases its
models), and the way back.

A directory holds config.json (model_type kimi_hybrid, ``auto_map`` naming configuration_kimi.KimiConfig and
modeling_kimi.KimiForCausalLM, our model settings under ``kimi_model``), our kimi modules as flat Python
files (kimi.interop.remote_code) and our tensors as safetensors, each under its name in our model prefixed
by ``model.`` (a tied LM head is the embedding and is not stored). So

    AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)

runs our forward and our cached decoding, and load_remote reads the tensors back bit for bit (without
importing the directory's code). ``kimi_code.json`` records the code as written (kimi.interop.trust), so that
loaders tell our own export apart from one whose code was changed since.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Iterable, Tuple

import torch

from kimi.folders import require_inside
from kimi.interop.remote_code import write_sources
from kimi.interop.trust import write_record
from kimi.model import KimiModel
from kimi.model.config import ModelConfig, check_sizes, model_dict
from kimi.model.footprint import check_fits

MODEL_TYPE = "kimi_hybrid"
PREFIX = "model."
INDEX = "model.safetensors.index.json"
AUTO_MAP = {"AutoConfig": "configuration_kimi.KimiConfig",
            "AutoModelForCausalLM": "modeling_kimi.KimiForCausalLM"}


def is_remote(config: dict) -> bool:
    """Whether a config.json is of an export with our modeling code."""
    return config.get("model_type") == MODEL_TYPE


def write_shards(tensors: Iterable[Tuple[str, torch.Tensor]], directory: Path, shard_bytes: int) -> list[str]:
    """Tensors as safetensors files of at most shard_bytes each (one tensor may exceed it), with the index
    transformers reads when there are several; returns the file names."""
    from safetensors.torch import save_file

    shards, current, size = [], {}, 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = tensor, size + nbytes
    shards.append(current)
    files = (["model.safetensors"] if len(shards) == 1
             else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(files, shards):
        save_file(shard, str(directory / file), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        weight_map = {name: file for file, shard in zip(files, shards) for name in shard}
        (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total},
                                                   "weight_map": weight_map},
                                                  indent=2))
    return files


def _stored(model: KimiModel) -> dict[str, torch.Tensor]:
    """Our tensors as the files hold them: every persistent one under its name, a tied head left out."""
    state = model.state_dict()
    if model.cfg.tie_embeddings:
        del state["lm_head.weight"]
    return state


def save_remote(model: KimiModel, directory: str | Path, shard_bytes: int = 5 * 2**30,
                special_ids: dict | None = None) -> list[str]:
    """Write `model` as an export with its own modeling code (module docstring) into `directory`;
    special_ids: the tokenizer's bos_token_id / eos_token_id, which generate() stops at. Returns the files."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    cfg = model.cfg
    config = {"architectures": ["KimiForCausalLM"], "model_type": MODEL_TYPE, "auto_map": AUTO_MAP,
              "kimi_model": model_dict(cfg), "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
              "num_hidden_layers": cfg.num_layers, "tie_word_embeddings": cfg.tie_embeddings,
              "dtype": str(next(model.parameters()).dtype).removeprefix("torch."), **(special_ids or {})}
    files = write_sources(directory)
    files.append(write_record(directory, AUTO_MAP))
    stored = _stored(model)
    files += write_shards(((PREFIX + name, t.detach().cpu().contiguous()) for name, t in stored.items()),
                          directory, shard_bytes)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return files + ["config.json"]


def shard_files(directory: Path) -> list[Path]:
    """The safetensors files of a directory: those its index's weight_map names (each inside the directory,
    kimi.folders), else model.safetensors; one-line ValueErrors for a bad index or a missing file."""
    index = directory / INDEX
    names = ["model.safetensors"]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (ValueError, AttributeError) as e:
            raise ValueError(f"{index} is not valid JSON ({e}): damaged; fetch it again") from None
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map (tensor name -> file): damaged; fetch it again")
        names = sorted(set(map(str, weight_map.values())))
    files = []
    for name in names:
        path = require_inside(directory, name, index if index.is_file() else None)
        if not path.is_file():
            named = f" (named by {INDEX})" if index.is_file() else ""
            raise ValueError(f"{directory}: no {name}{named}: the weights are missing; copy or download them "
                             "into it")
        files.append(path)
    return files


def _files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    where = {}
    for path in shard_files(directory):
        try:
            with safe_open(path, framework="pt") as f:
                where.update(dict.fromkeys(f.keys(), path))
        except Exception as e:  # safetensors' own error type: a damaged header or a short file
            raise ValueError(f"{path} is not a readable safetensors file ({e}): damaged; fetch it "
                             "again") from None
    return where


def empty_model(cfg: ModelConfig, dtype: torch.dtype) -> KimiModel:
    """cfg's model on the CPU in `dtype`, its weights allocated but not set (a folder's tensors fill them),
    after checking that it fits the machine's memory."""
    check_fits(cfg, dtype.itemsize, "cpu", f"{dtype} weights", "a machine with more memory")
    with torch.device("meta"):
        model = KimiModel(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    if cfg.tie_embeddings:  # to_empty gives each module a tensor of its own: tie them again
        model.lm_head.weight = model.embed.weight
    model.init_buffers()
    return model


def load_remote(directory: str | Path, config: dict, dtype: torch.dtype = torch.float32) -> KimiModel:
    """Our model, in eval mode, from an export with our modeling code whose config.json is `config`; tensors
    are read one at a time."""
    from safetensors import safe_open

    directory = Path(directory)
    fields = config.get("kimi_model")
    known = {f.name for f in dataclasses.fields(ModelConfig)}
    if not isinstance(fields, dict) or set(fields) - known:
        extra = sorted(set(fields or {}) - known) if isinstance(fields, dict) else "none"
        raise ValueError(f"{directory / 'config.json'}: kimi_model is not this kimi's model settings "
                         f"(unknown: {extra}); read it with the kimi version that exported it")
    cfg = ModelConfig(**fields)
    try:
        check_sizes(cfg)
    except ValueError as e:
        raise ValueError(f"{directory / 'config.json'}: kimi_model: {e}") from None
    model = empty_model(cfg, dtype)
    own = _stored(model)
    where = _files(directory)
    expected = {PREFIX + name for name in own}
    if set(where) != expected:
        odd = sorted(set(where) ^ expected)
        raise ValueError(f"{directory}: the weights do not match config.json's kimi_model: {odd[:3]} is "
                         f"{'missing' if odd[0] in expected else 'unexpected'}; are they of this config?")
    with torch.no_grad():
        for name, target in own.items():
            with safe_open(where[PREFIX + name], framework="pt") as f:
                tensor = f.get_tensor(PREFIX + name)
            if tensor.shape != target.shape:
                raise ValueError(f"{directory}: tensor {PREFIX + name} has shape {list(tensor.shape)}, "
                                 f"config.json makes it {list(target.shape)}: the weights and config.json "
                                 "are of different models")
            target.copy_(tensor)
    return model.eval()
