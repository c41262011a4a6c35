"""Checkpoints to and from Hugging Face `transformers`' Kimi Linear (`KimiLinearForCausalLM`).

    python -m kimi.convert to-hf RUN_DIR HF_DIR [--shard-gb 5]
    python -m kimi.convert from-hf HF_DIR RUN_DIR

from-hf makes a new run directory from a transformers Kimi Linear directory: RUN_DIR/init (a weights-only
checkpoint, fp32), RUN_DIR/model/hf.yaml (the model settings) and RUN_DIR/tokenizer.model, a copy of the
directory's tokenizer: the tiktoken.model (+ tokenizer_config.json) Kimi's releases ship, or a sentencepiece
tokenizer.model. It prints the train.py command that starts training from those weights (step 0, fresh
optimizer state: `trainer.init_from`, which defaults to RUN_DIR/init) on data tokenised by that tokenizer;
`python -m kimi.generate run=RUN_DIR` samples from it.

writes HF_DIR/config.json and model(-0000i-of-0000n).safetensors (+ the index when sharded) from a run
directory's newest complete checkpoint (or a checkpoint directory named directly), which
`transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)` loads as KimiLinearForCausalLM. A model whose
settings transformers' class cannot express (Attention Residuals, rotated MLA keys, a bias on KDA's output
gate) is refused with the setting named. transformers fixes the eps of MLA's latent norm at 1e-6: a model
trained with another `model.mla_norm_eps` (default: `model.norm_eps`, 1e-5) converts, and its logits there
differ by that eps's effect (~4e-5 relative on a tiny model); train with `model.mla_norm_eps=1e-6` to match
exactly. In Python, `load_hf(HF_DIR)` builds our model (eval mode) from such a directory, as released or as
save_pretrained writes it, reading one tensor at a time. The name and layout mapping is kimi.interop.hf.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import torch

from kimi.config import ModelConfig
from kimi.interop.hf import file_map, hf_config, model_fields
from kimi.model import KimiModel

INDEX = "model.safetensors.index.json"


class _LazyTensors:
    """Tensors of a safetensors directory (one file, or shards and their index) by name, each read from disk
    when asked for and not kept."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / INDEX
        files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
                 else ["model.safetensors"])
        self._where = {}
        for name in files:
            with safe_open(directory / name, framework="pt") as f:
                self._where.update({key: directory / name for key in f.keys()})

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self._where[key], framework="pt") as f:
            return f.get_tensor(key)


def read_hf_config(directory: Path) -> dict:
    """The transformers config of a directory as a dict: through transformers when installed (which also
    reads the released checkpoints' own config layout), else config.json as it is."""
    try:
        from transformers import AutoConfig
    except ImportError:
        return json.loads((directory / "config.json").read_text())
    return AutoConfig.from_pretrained(directory).to_dict()


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32) -> KimiModel:
    """Our model with the weights of a transformers Kimi Linear directory (config.json + safetensors, as
    released or as save_pretrained writes it), in eval mode; tensors are read one at a time."""
    directory = Path(directory)
    cfg = ModelConfig(**model_fields(read_hf_config(directory)))
    with torch.device("meta"):
        model = KimiModel(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    model.init_buffers()
    own = model.state_dict()
    tensors = _LazyTensors(directory)
    done = set()
    with torch.no_grad():
        for theirs, mine, index, _ in file_map(cfg):
            if theirs not in tensors:
                raise ValueError(f"{directory}: no tensor {theirs} (a Kimi Linear checkpoint of this config "
                                 "has one); is it a transformers Kimi Linear directory?")
            target = own[mine] if index is None else own[mine][index]
            target.copy_(tensors[theirs].reshape(target.shape))
            done.add(mine)
    missing = set(own) - done
    if missing:
        raise ValueError(f"{directory}: nothing filled {sorted(missing)[:5]}")
    return model.eval()


def save_hf(model: KimiModel, directory: str | Path, shard_bytes: int = 5 * 2**30) -> Path:
    """config.json and safetensors shards of `model` that transformers loads as KimiLinearForCausalLM."""
    from safetensors.torch import save_file

    directory = Path(directory)
    cfg = model.cfg
    config = dict(hf_config(cfg), model_type="kimi_linear", architectures=["KimiLinearForCausalLM"],
                  dtype=str(next(model.parameters()).dtype).removeprefix("torch."))  # refuses before writing
    directory.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    shards, current, size = [], {}, 0
    for name, mine, index, shape in file_map(cfg):
        tensor = state[mine] if index is None else state[mine][index]
        tensor = (tensor.reshape(shape) if shape else tensor).contiguous()
        if current and size + tensor.numel() * tensor.element_size() > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor.detach().cpu()
        size += tensor.numel() * tensor.element_size()
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = ("model.safetensors" if len(shards) == 1
                else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors")
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX).write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def from_hf(hf_dir: str | Path, run_dir: str | Path) -> list[str]:
    """Write a new run directory from a transformers directory (module docstring); returns the lines to
    print (what was written and the command that trains from it)."""
    import dataclasses

    from omegaconf import OmegaConf

    from kimi import checkpoint
    from kimi.cli import RunError
    from kimi.data import Tokenizer
    from kimi.data.errors import DataError

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    if (run_dir / "init").exists() or checkpoint.list_checkpoints(run_dir / "checkpoints"):
        raise RunError(f"{run_dir} already holds a run or converted weights; from-hf writes a new run dir: "
                       "choose another, or move that one aside")
    model = load_hf(hf_dir)
    fields = dataclasses.asdict(model.cfg)
    extra, lines = {"source": str(hf_dir.resolve())}, []
    tokenizer = None
    found = [hf_dir / name for name in ("tiktoken.model", "tokenizer.model") if (hf_dir / name).is_file()]
    if found:
        try:
            tokenizer = Tokenizer(found[0])
        except DataError as e:
            lines.append(f"[kimi] {found[0]} not copied: {e}; train with data.tokenizer.model_path=<a tokenizer>")
    if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:
        raise RunError(f"{found[0]} has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                       f"({model.cfg.vocab_size}): it is not this model's tokenizer")
    run_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        extra["tokenizer_sha256"] = tokenizer.copy_to(run_dir / "tokenizer.model").sha256
    checkpoint.save_weights(run_dir / "init", model.state_dict(), {"model": fields}, extra)
    (run_dir / "model").mkdir(exist_ok=True)
    (run_dir / "model" / "hf.yaml").write_text(
        f"# {hf_dir}, converted by python -m kimi.convert from-hf\n" + OmegaConf.to_yaml({**fields, "name": "hf"}))
    data = f" data.tokenizer.model_path={run_dir / 'tokenizer.model'}" if tokenizer is not None else ""
    lines += [f"[kimi] wrote {run_dir}/init ({model.num_params():,} parameters, fp32) and {run_dir}/model/hf.yaml",
              f"[kimi] train from it: python train.py --config-dir {run_dir} model=hf hydra.run.dir={run_dir}{data}"]
    return lines


def _to_hf(run: str, out: str, shard_gb: float) -> int:
    from kimi.generate import load_from_checkpoint

    model, _, step = load_from_checkpoint(run)
    save_hf(model, out, int(shard_gb * 2**30))
    print(f"[kimi] wrote {out} (step {step}): config.json and safetensors for KimiLinearForCausalLM")
    return 0


def main(argv: list[str] | None = None) -> int:
    import argparse

    from kimi.cli import RunError
    from kimi.interop.hf import NotExpressible

    parser = argparse.ArgumentParser(prog="python -m kimi.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_hf = sub.add_parser("to-hf", help="a run dir's newest complete checkpoint -> a transformers directory")
    to_hf.add_argument("run")
    to_hf.add_argument("out")
    to_hf.add_argument("--shard-gb", type=float, default=5.0, help="largest safetensors file (GiB)")
    from_hf_cmd = sub.add_parser("from-hf", help="a transformers directory -> a new run dir that trains from it")
    from_hf_cmd.add_argument("hf_dir")
    from_hf_cmd.add_argument("run_dir")
    args = parser.parse_args(argv)
    try:
        if args.command == "from-hf":
            print("\n".join(from_hf(args.hf_dir, args.run_dir)))
            return 0
        return _to_hf(args.run, args.out, args.shard_gb)
    except (NotExpressible, FileNotFoundError, ValueError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
