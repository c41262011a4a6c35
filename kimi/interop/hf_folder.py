"""A model to and from a Hugging Face folder in any registered layout (kimi.interop.layouts), one tensor at a
time: `load_hf` reads a folder (Kimi Linear's layouts, K3's, or one with its own modeling code) into our
model, `save_hf` writes config.json and safetensors shards. `python -m kimi.convert` is their command line;
its docstring says what each layout holds and which errors are one line.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kimi.interop import layouts
from kimi.interop.hf import RENAMES, NotExpressible, in_layout
from kimi.interop.k3 import Constant
from kimi.interop.remote import empty_model, load_remote, shard_files, write_shards
from kimi.model import KimiModel
from kimi.model.config import ModelConfig, check_sizes


class _LazyTensors:
    """Tensors of a safetensors directory (one file, or shards and their index) by name, each read from disk
    when asked for and not kept."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self._where = {}
        for path in shard_files(directory):
            try:
                with safe_open(path, framework="pt") as f:
                    self._where.update({key: path for key in f.keys()})
            except Exception as e:  # safetensors' own error type: a damaged header or a short file
                raise ValueError(f"{path} is not a readable safetensors file ({e}): truncated or "
                                 "damaged (an interrupted download or copy?); fetch it again") from None

    def get(self, names) -> tuple[str, torch.Tensor] | None:
        """(the first of `names` the directory holds, its tensor), or None; NAME.weight may be held as MXFP4
        (NAME.weight_packed and NAME.weight_scale, mxfp4_experts=true), returned dequantised (fp32)."""
        from safetensors import safe_open

        for key in names:
            if key in self._where:
                with safe_open(self._where[key], framework="pt") as f:
                    return key, f.get_tensor(key)
            packed, scale = (key.removesuffix(".weight") + s for s in (".weight_packed", ".weight_scale"))
            if key.endswith(".weight") and packed in self._where and scale in self._where:
                from kimi.precision.mxfp4 import dequantize

                with safe_open(self._where[packed], framework="pt") as f, \
                        safe_open(self._where[scale], framework="pt") as g:
                    return packed, dequantize(f.get_tensor(packed), g.get_tensor(scale))
        return None


def read_hf_config(directory: Path) -> dict:
    """config.json of a Kimi Linear directory as it is: model_fields reads its layouts and names a missing
    key where transformers' AutoConfig would fill in its defaults (another model than the weights')."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: no such directory (give a local Kimi Linear directory; download a "
                         "Hub repository first, e.g. hf download REPO --local-dir DIR)")
    path = directory / "config.json"
    if not path.is_file():
        raise ValueError(f"{directory}: no config.json (a Kimi Linear directory has config.json and "
                         "safetensors weights)")
    return _read_json(path)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not valid JSON ({e}): damaged; fetch it again") from None


def _fits(found: torch.Size, expected: torch.Size) -> bool:
    """Whether a file tensor of shape `found` holds ours of shape `expected`: the same dims apart from 1s,
    or, for a vector of ours (A_log, dt_bias), any shape of its size (the releases and the loaders
    disagree on them: A_log as [H] or [1, 1, H, 1], dt_bias as [H*K] or [H, K]) or a longer vector (K3's
    zero-padded A_log; _unpad checks the padding)."""
    found_dims, dims = [d for d in found if d != 1], [d for d in expected if d != 1]
    if found.numel() == expected.numel():
        return found_dims == dims or len(dims) <= 1
    return len(dims) <= 1 and len(found_dims) <= 1 and found.numel() > expected.numel()


def _unpad(name: str, tensor: torch.Tensor, numel: int) -> torch.Tensor:
    """The first `numel` values of file tensor `name`, whose others must be the padding's zeros."""
    flat = tensor.reshape(-1)
    if flat[numel:].any():
        raise ValueError(f"tensor {name} has {flat.numel()} values where the config makes {numel}, and the "
                         "rest are not zero padding: the weights and config.json are of different models")
    return flat[:numel]


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32) -> KimiModel:
    """Our model with the weights of a Kimi Linear directory (config.json + safetensors, as released or
    as save_pretrained writes it), in eval mode; tensors are read one at a time. Bad input raises ValueError
    with a one-line message."""
    directory = Path(directory)
    hf = read_hf_config(directory)
    layout = layouts.of_config(hf)  # K3's, remote code's, else Kimi Linear's (either tensor naming)
    if layout.own_code:
        return load_remote(directory, hf, dtype)
    try:
        cfg = ModelConfig(**layout.model_fields(hf))
        check_sizes(cfg)
    except NotExpressible:
        raise
    except ValueError as e:
        raise ValueError(f"{directory / 'config.json'}: {e}") from None
    model = empty_model(cfg, dtype)
    own = model.state_dict()
    tensors = _LazyTensors(directory)
    done = set()
    with torch.no_grad():
        for theirs, mine, index, _ in layout.file_map(cfg):
            if isinstance(mine, Constant):  # no tensor of ours comes from it (kimi.interop.k3)
                continue
            found = tensors.get(dict.fromkeys(in_layout(theirs, renames) for renames in RENAMES))
            tied = cfg.tie_embeddings and mine == "lm_head.weight"  # the embedding, filled before
            if found is None and tied:
                continue
            if found is None:
                raise ValueError(f"{directory}: no tensor {theirs} (a Kimi Linear checkpoint of this config "
                                 "has one); is it a Kimi Linear directory, and its config.json this one's?")
            name, tensor = found
            target = own[mine] if index is None else own[mine][index]
            if not _fits(tensor.shape, target.shape):
                raise ValueError(f"{directory}: tensor {name} has shape {list(tensor.shape)}, config.json "
                                 f"makes it {list(target.shape)}: the weights and config.json are of "
                                 "different models (or the file is damaged)")
            if tied and not torch.equal(tensor.reshape(target.shape).to(dtype), target):
                raise ValueError(f"{directory}: config.json ties the embeddings (tie_word_embeddings), but "
                                 f"{name} is not model.embed_tokens.weight: set tie_word_embeddings false")
            target.copy_(_unpad(name, tensor, target.numel()).reshape(target.shape))
            done.add(mine)
    filled = {own[name].data_ptr() for name in done}  # a tied lm_head is the embedding, filled with it
    missing = {name for name, t in own.items() if t.data_ptr() not in filled}
    if missing:
        raise ValueError(f"{directory}: nothing filled {sorted(missing)[:5]}")
    return model.eval()


def _tensors(model: KimiModel, layout: str, mxfp4_experts: bool):
    """(file name, tensor) of every tensor save_hf writes, the routed experts' as MXFP4 if asked."""
    state = model.state_dict()
    for name, mine, index, shape in layouts.get(layout).file_map(model.cfg):
        if isinstance(mine, Constant):
            yield name, torch.full(mine.shape, mine.value, dtype=next(iter(state.values())).dtype)
            continue
        tensor = state[mine] if index is None else state[mine][index]
        tensor = _to_file_shape(tensor, shape).detach().cpu().contiguous()
        # safetensors refuses two names for one storage
        if mine == "lm_head.weight" and model.cfg.tie_embeddings:
            tensor = tensor.clone()
        if mxfp4_experts and ".experts.w_" in mine:
            from kimi.precision.mxfp4 import quantize

            packed, scale = quantize(tensor)
            yield name.removesuffix(".weight") + ".weight_packed", packed
            yield name.removesuffix(".weight") + ".weight_scale", scale
        else:
            yield name, tensor


def _to_file_shape(tensor: torch.Tensor, shape) -> torch.Tensor:
    """Our tensor as the file holds it: reshaped, or a vector zero-padded to a longer one (K3's A_log)."""
    if not shape:
        return tensor
    if len(shape) == 1 and shape[0] > tensor.numel():
        return torch.cat([tensor.reshape(-1), tensor.new_zeros(shape[0] - tensor.numel())])
    return tensor.reshape(shape)


def save_hf(model: KimiModel, directory: str | Path, shard_bytes: int = 5 * 2**30,
            layout: str = "release", mxfp4_experts: bool = False) -> Path:
    """config.json and safetensors shards of `model` in the released checkpoints' layout, which
    transformers loads as KimiLinearForCausalLM (and vLLM, mlx-lm read); layout="save_pretrained": the
    tensor names transformers' save_pretrained writes instead; layout="k3": Kimi K3's (kimi.interop.layouts
    holds them by name). mxfp4_experts: the routed experts' weights as MXFP4 (kimi.convert's docstring)."""
    directory = Path(directory)
    cfg = model.cfg
    config = dict(layouts.get(layout).config(cfg),  # refuses before writing
                  dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    if mxfp4_experts:
        if not cfg.moe.num_experts:
            raise ValueError("mxfp4_experts=true: this model has no routed experts (model.moe.num_experts=0)")
        config["mxfp4_experts"] = {"block_size": 32, "elements": "E2M1, two per uint8, even element in the "
                                   "low nibble", "scale": "E8M0 (uint8, 2^(s-127)) per block of the last dim"}
    directory.mkdir(parents=True, exist_ok=True)
    write_shards(_tensors(model, layout, mxfp4_experts), directory, shard_bytes)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
