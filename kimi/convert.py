"""Checkpoints to and from Hugging Face `transformers`' Kimi Linear (`KimiLinearForCausalLM`), and Kimi K3's layout.

    python -m kimi.convert to-hf run=RUN_DIR out=HF_DIR [layout=release|save_pretrained|k3] [shard_gb=5]
                                 [mxfp4_experts=true | remote_code=true] [overwrite=true]
    python -m kimi.convert from-hf hf=HF_DIR run=RUN_DIR

key=value as every kimi command; the positional form with --flags (to-hf RUN_DIR HF_DIR --layout k3 ...,
from-hf HF_DIR RUN_DIR) is still read.

from-hf makes a new run directory from a transformers Kimi Linear directory: RUN_DIR/init (a weights-only
checkpoint, fp32), RUN_DIR/model/hf.yaml (the model settings) and RUN_DIR/tokenizer.model, a copy of the
directory's tokenizer: the tiktoken.model (+ tokenizer_config.json) Kimi's releases ship, a sentencepiece
tokenizer.model, or a tokenizer.json. It prints the train.py command that starts training from those weights
(step 0, fresh optimizer state: `trainer.init_from`, which defaults to RUN_DIR/init) on data tokenised by that
tokenizer; `python -m kimi.generate run=RUN_DIR` samples from it.

to-hf writes HF_DIR/config.json and model(-0000i-of-0000n).safetensors (+ the index when sharded) from a run
directory's newest complete checkpoint (or a checkpoint directory named directly), in the released
checkpoints' layout, which `transformers.AutoModelForCausalLM.from_pretrained(HF_DIR)` loads as
KimiLinearForCausalLM and mlx-lm's kimi_linear reads (`layout=save_pretrained`: the tensor names
transformers' save_pretrained writes, the dense first block's MLP under block_sparse_moe). A model whose
settings transformers' class cannot express (Attention Residuals, rotated MLA keys, a bias on KDA's output
gate: every preset but kimi_linear_48b_a3b) is written with its own modeling code instead (below); the other
layouts refuse it with the setting named. transformers fixes the eps of MLA's latent norm at 1e-6: a model
trained with another `model.mla_norm_eps` (default: `model.norm_eps`, 1e-5) converts, and its logits there
differ by that eps's effect (~4e-5 relative on a tiny model); train with `model.mla_norm_eps=1e-6` to match
exactly. from-hf (and in Python `load_hf(HF_DIR)`, our model in eval mode) reads either layout, one tensor at
a time; a missing directory, damaged safetensors, a tensor of another shape or a config.json lacking a key
is a one-line error naming it. The name and layout mapping is kimi.interop.hf.

layout=k3 writes Kimi K3's released layout (kimi.interop.k3: config.json with text_config, tensors under
`language_model.`, the depth-mixing sites' queries and key-norm weights, A_log zero-padded), which mlx-lm's
kimi_k3 reads; from-hf and load_hf read it (a config.json with text_config) as well as Kimi Linear's.

With its own modeling code (kimi.interop.remote), HF_DIR holds config.json (`auto_map`),
configuration_kimi.py, modeling_kimi.py and the kimi modules they import (our own model's code, its imports
made relative), and our tensors as safetensors: `AutoModelForCausalLM.from_pretrained(HF_DIR,
trust_remote_code=True)` runs our forward and our cached decoding (generate()); remote_code=true writes any model
so (our forward exactly, where transformers' class differs by its MLA latent norm eps). Either way to-hf
writes the run's tokenizer for `AutoTokenizer.from_pretrained(HF_DIR)` (kimi.interop.tokenizer_files:
tokenizer.json, tokenizer_config.json and the run's own file), and from-hf and load_hf read such a directory
back, bit for bit.

to-hf writes into a new folder beside HF_DIR and renames it into place when complete (kimi.interop.publish):
an HF_DIR holding files is replaced only with overwrite=true, and a failed write keeps the earlier export.
from-hf and load_hf never import a directory's Python files, and refuse file names (an index's weight_map,
links) that lead out of it (kimi.folders); docs/huggingface.md, "What a model folder may do".

mxfp4_experts=true (for a run trained with precision.qat=mxfp4_experts) writes every routed expert's weight as
MXFP4 (kimi/precision/mxfp4.py): NAME.weight_packed and NAME.weight_scale (uint8) in place of NAME.weight,
and config.json's "mxfp4_experts" says so. load_hf and from-hf read them back, dequantised: the forward of
the trained model (whose experts computed with exactly those values). transformers does not read them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import torch

from kimi.config import ModelConfig, check_sizes
from kimi.interop.hf import LAYOUTS, NotExpressible, file_map, in_layout, model_fields, release_config
from kimi.interop.k3 import Constant, is_k3, k3_config, k3_file_map, k3_model_fields
from kimi.interop.remote import is_remote, load_remote, save_remote, shard_files, write_shards
from kimi.model import KimiModel
from kimi.model.footprint import check_fits


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
        raise ValueError(f"tensor {name} has {flat.numel()} values where the config makes {numel}, and the rest "
                         "are not zero padding: the weights and config.json are of different models")
    return flat[:numel]


def _layout_of(config: dict):
    """(ModelConfig fields, file map of a ModelConfig) of a config.json: K3's layout or Kimi Linear's."""
    if is_k3(config):
        return k3_model_fields(config), k3_file_map
    return model_fields(config), file_map


def load_hf(directory: str | Path, dtype: torch.dtype = torch.float32) -> KimiModel:
    """Our model with the weights of a Kimi Linear directory (config.json + safetensors, as released or
    as save_pretrained writes it), in eval mode; tensors are read one at a time. Bad input raises ValueError
    with a one-line message."""
    directory = Path(directory)
    hf = read_hf_config(directory)
    if is_remote(hf):
        return load_remote(directory, hf, dtype)
    try:
        fields, mapping = _layout_of(hf)
        cfg = ModelConfig(**fields)
        check_sizes(cfg)
    except NotExpressible:
        raise
    except ValueError as e:
        raise ValueError(f"{directory / 'config.json'}: {e}") from None
    check_fits(cfg, dtype.itemsize, "cpu", f"{dtype} weights", "a machine with more memory")
    with torch.device("meta"):
        model = KimiModel(cfg)
    model = model.to_empty(device="cpu").to(dtype)
    if cfg.tie_embeddings:  # to_empty gives each module a tensor of its own: tie them again
        model.lm_head.weight = model.embed.weight
    model.init_buffers()
    own = model.state_dict()
    tensors = _LazyTensors(directory)
    done = set()
    with torch.no_grad():
        for theirs, mine, index, _ in mapping(cfg):
            if isinstance(mine, Constant):  # no tensor of ours comes from it (kimi.interop.k3)
                continue
            found = tensors.get(dict.fromkeys(in_layout(theirs, layout) for layout in LAYOUTS))
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
    entries = k3_file_map(model.cfg) if layout == "k3" else file_map(model.cfg, layout)
    for name, mine, index, shape in entries:
        if isinstance(mine, Constant):
            yield name, torch.full(mine.shape, mine.value, dtype=next(iter(state.values())).dtype)
            continue
        tensor = state[mine] if index is None else state[mine][index]
        tensor = _to_file_shape(tensor, shape).detach().cpu().contiguous()
        if mine == "lm_head.weight" and model.cfg.tie_embeddings:  # safetensors refuses two names for one storage
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
    tensor names transformers' save_pretrained writes instead (kimi.interop.hf.LAYOUTS). mxfp4_experts: the
    routed experts' weights as MXFP4 (module docstring)."""
    directory = Path(directory)
    cfg = model.cfg
    config = dict(k3_config(cfg) if layout == "k3" else release_config(cfg),  # refuses before writing
                  dtype=str(next(model.parameters()).dtype).removeprefix("torch."))
    if mxfp4_experts:
        if not cfg.moe_num_experts:
            raise ValueError("mxfp4_experts=true: this model has no routed experts (model.moe_num_experts=0)")
        config["mxfp4_experts"] = {"block_size": 32, "elements": "E2M1, two per uint8, even element in the "
                                   "low nibble", "scale": "E8M0 (uint8, 2^(s-127)) per block of the last dim"}
    directory.mkdir(parents=True, exist_ok=True)
    write_shards(_tensors(model, layout, mxfp4_experts), directory, shard_bytes)
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def from_hf(hf_dir: str | Path, run_dir: str | Path) -> list[str]:
    """Write a new run directory from a transformers directory (module docstring); returns the lines to
    print (what was written and the command that trains from it)."""
    import dataclasses

    from omegaconf import OmegaConf

    from kimi import checkpoint
    from kimi.config import ConfigError
    from kimi.data import Tokenizer
    from kimi.data.errors import DataError
    from kimi.folders import require_inside

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    if (run_dir / "init").exists() or checkpoint.list_checkpoints(run_dir / "checkpoints"):
        raise ConfigError(f"{run_dir} already holds a run or converted weights; from-hf writes a new run "
                          "dir: choose another, or move that one aside")
    model = load_hf(hf_dir)
    fields = dataclasses.asdict(model.cfg)
    extra, lines = {"source": str(hf_dir.resolve())}, []
    tokenizer = None
    # the first of these the directory holds, whatever it is: a directory or a damaged file is reported
    found = [hf_dir / name for name in ("tiktoken.model", "tokenizer.model", "tokenizer.json")
             if (hf_dir / name).exists() or (hf_dir / name).is_symlink()]
    if found:
        require_inside(hf_dir, found[0].name, None)  # a link that leads out of it is refused
        try:
            if not found[0].is_file():
                what = "a directory" if found[0].is_dir() else "not a regular file"
                raise DataError(f"it is {what}, not a tokenizer file")
            tokenizer = Tokenizer(found[0])
        except DataError as e:
            lines.append(f"[kimi] {found[0]} not copied: {e}; train with data.tokenizer.model_path=<a tokenizer>")
    if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"{found[0]} has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
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


def _to_hf(run: str, out: str, shard_gb: float, layout: str, mxfp4_experts: bool = False,
           remote_code: bool = False, overwrite: bool = False) -> int:
    from kimi.generate import load_from_checkpoint

    from kimi.interop.publish import check_target, fresh_folder
    from kimi.interop.tokenizer_files import check_packages, write_tokenizer

    if remote_code and (layout != "release" or mxfp4_experts):
        raise ValueError("remote_code=true writes our own tensors and modeling code: drop layout= / mxfp4_experts=")
    check_target(Path(out), overwrite, Path(run))  # before the checkpoint is read
    model, tokenizer, step = load_from_checkpoint(run)
    check_packages(tokenizer)
    why = "remote_code=true" if remote_code else None
    # written into a new folder, renamed to `out` once every file is there
    with fresh_folder(Path(out), overwrite, Path(run)) as directory:
        if why is None:
            try:
                save_hf(model, directory, int(shard_gb * 2**30), layout, mxfp4_experts)
            except NotExpressible as e:
                if layout != "release" or mxfp4_experts:  # those layouts are the native class's own
                    raise
                why = f"not for KimiLinearForCausalLM ({e})"
        if why is not None:
            special = {f"{k}_token_id": i for k, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))
                       if i >= 0}
            save_remote(model, directory, int(shard_gb * 2**30), special)
            print(f"[kimi] {why}: written with its own modeling code, which transformers runs with "
                  "trust_remote_code=True")
            layout = "remote code"
        files = write_tokenizer(tokenizer, directory)
    what = ("; routed experts as MXFP4, which transformers does not read" if mxfp4_experts
            else " in Kimi K3's layout" if layout == "k3" else "" if layout == "remote code"
            else " for KimiLinearForCausalLM")
    print(f"[kimi] wrote {out} (step {step}): config.json and safetensors{what} ({layout} layout), "
          f"and the tokenizer ({', '.join(files)})")
    return 0


def _key_value(argv: list[str]) -> dict:
    """The key=value form's arguments of `to-hf` / `from-hf` (argv[0]), each required key checked."""
    from kimi import keyvalue
    from kimi.config import ConfigError

    command, rest = argv[0], argv[1:]
    if command == "to-hf":
        keys = {"run": str, "out": str, "layout": keyvalue.one_of(*sorted([*LAYOUTS, "k3"])),
                "shard_gb": keyvalue.positive_float, "mxfp4_experts": keyvalue.boolean,
                "remote_code": keyvalue.boolean, "overwrite": keyvalue.boolean}
        required = ("run", "out")
    else:
        keys, required = {"hf": str, "run": str}, ("hf", "run")
    args = keyvalue.parse(rest, keys, f"python -m kimi.convert {command}")
    missing = [k for k in required if k not in args]
    if missing:
        raise ConfigError(f"kimi.convert {command}: give {' and '.join(k + '=...' for k in missing)} "
                          f"({USAGE[command]})")
    return args


USAGE = {"to-hf": "to-hf run=RUN_DIR out=HF_DIR [layout=release|save_pretrained|k3] [shard_gb=5] "
                  "[mxfp4_experts=true] [remote_code=true] [overwrite=true]",
         "from-hf": "from-hf hf=HF_DIR run=RUN_DIR"}


def _run(body) -> int:
    """body()'s exit code; a known problem is one line and the exit code kimi/cli.py gives its type (a forged
    checkpoint 1, as everywhere), a bad source directory or argument (ValueError) 2."""
    from kimi.cli import EXIT_BAD_INPUT, describe, exit_code_for

    try:
        return body()
    except Exception as e:  # noqa: BLE001: anything unknown is re-raised below
        code = exit_code_for(e)
        if code is None and isinstance(e, ValueError):
            code = EXIT_BAD_INPUT
        if code is None:
            raise
        print(f"error: {describe(e)}", file=sys.stderr, flush=True)
        return code


def main(argv: list[str] | None = None) -> int:
    """The command line: key=value (USAGE), or the positional form with --flags (argparse below)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(argv[0] if argv and argv[0] in USAGE else None))
        return 0
    if argv and argv[0] in USAGE and any("=" in a and not a.startswith("-") for a in argv[1:]):
        def body() -> int:
            args = _key_value(argv)
            if argv[0] == "from-hf":
                print("\n".join(from_hf(args["hf"], args["run"])))
                return 0
            return _to_hf(args["run"], args["out"], args.get("shard_gb", 5.0), args.get("layout", "release"),
                          args.get("mxfp4_experts", False), args.get("remote_code", False),
                          args.get("overwrite", False))

        return _run(body)
    return _flags_main(argv)


def _parser():
    """The older positional form with --flags; its arguments' help is also --help's key=value table."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kimi.convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    to_hf = sub.add_parser("to-hf", usage=f"python -m kimi.convert {USAGE['to-hf']}",
                           help="a run dir's newest complete checkpoint -> a transformers directory")
    to_hf.add_argument("run", help="run directory (its newest complete checkpoint) or checkpoint directory")
    to_hf.add_argument("out", help="the transformers directory to write (HF_DIR)")
    to_hf.add_argument("--shard-gb", type=float, default=5.0,
                       help="largest safetensors file (GiB; default 5)")
    to_hf.add_argument("--layout", choices=sorted([*LAYOUTS, "k3"]), default="release",
                       help="tensor names: the released Kimi Linear checkpoints' (default; what every loader "
                            "reads), the ones transformers' save_pretrained writes (dense MLP under "
                            "block_sparse_moe), or Kimi K3's (kimi_k3: text_config, language_model.)")
    to_hf.add_argument("--mxfp4-experts", action="store_true",
                       help="routed experts' weights as MXFP4 (a run trained with "
                            "precision.qat=mxfp4_experts)")
    to_hf.add_argument("--remote-code", action="store_true",
                       help="our own modeling code (trust_remote_code) even where transformers' Kimi Linear "
                            "expresses the model: our forward exactly (its MLA latent norm eps is fixed)")
    to_hf.add_argument("--overwrite", action="store_true",
                       help="replace the export already in HF_DIR, once the new one is complete")
    from_hf_cmd = sub.add_parser("from-hf", usage=f"python -m kimi.convert {USAGE['from-hf']}",
                                 help="a transformers directory -> a new run dir that trains from it")
    from_hf_cmd.add_argument("hf", help="a transformers Kimi Linear (or Kimi K3) directory")
    from_hf_cmd.add_argument("run", help="the new run directory to write")
    return parser, {"to-hf": to_hf, "from-hf": from_hf_cmd}


def help_text(command: str | None) -> str:
    """--help in the key=value form: the usage, and each argument of `command` (both when None) as its key
    (the --flag's name with _) with the help the parser gives it."""
    from kimi import keyvalue

    usage = ("\n\n".join(__doc__.split("\n\n")[:3]) if command is None
             else f"usage: python -m kimi.convert {USAGE[command]}")
    parts = [usage, ""]
    _, commands = _parser()
    for name, sub in commands.items():
        if command in (None, name):
            rows = [(a.dest, f"true: {a.help}" if a.nargs == 0 else
                     f"{'|'.join(a.choices)}: {a.help}" if a.choices else a.help)
                    for a in sub._actions if a.dest != "help"]
            parts += [f"{name}:", keyvalue.table(rows), ""]
    return "\n".join(parts) + "\nExit codes: 0 done, 2 bad arguments or directory, 1 failure."


def _flags_main(argv: list[str]) -> int:
    args = _parser()[0].parse_args(argv)

    def body() -> int:
        if args.command == "from-hf":
            print("\n".join(from_hf(args.hf, args.run)))
            return 0
        return _to_hf(args.run, args.out, args.shard_gb, args.layout, args.mxfp4_experts, args.remote_code,
                      args.overwrite)

    return _run(body)


if __name__ == "__main__":
    sys.exit(main())
