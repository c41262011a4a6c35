"""Checkpoints to and from Hugging Face `transformers`' Kimi Linear (`KimiLinearForCausalLM`), and Kimi K3's
layout.

    python -m kimi.convert to-hf run=RUN_DIR out=HF_DIR [layout=release|save_pretrained|k3] [shard_gb=5]
                                 [mxfp4_experts=true | remote_code=true] [overwrite=true]
    python -m kimi.convert from-hf hf=HF_DIR run=RUN_DIR

key=value as every kimi command; the positional form with --flags (to-hf RUN_DIR HF_DIR --layout k3 ...,
from-hf HF_DIR RUN_DIR) is deprecated: it is still read, and says on stderr the key=value command it stands
for. The layouts are kimi.interop.layouts' registry; reading and writing a folder, kimi.interop.hf_folder.

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
trained with another `model.mla.norm_eps` (default: `model.norm_eps`, 1e-5) converts, and its logits there
differ by that eps's effect (~4e-5 relative on a tiny model); train with `model.mla.norm_eps=1e-6` to match
exactly. from-hf (and in Python `load_hf(HF_DIR)`, our model in eval mode) reads either layout, one tensor at
a time; a missing directory, damaged safetensors, a tensor of another shape or a config.json lacking a key
is a one-line error naming it. The name and layout mapping is kimi.interop.hf.

layout=k3 writes Kimi K3's released layout (kimi.interop.k3: config.json with text_config, tensors under
`language_model.`, the depth-mixing sites' queries and key-norm weights, A_log zero-padded), which mlx-lm's
kimi_k3 reads; from-hf and load_hf read it (a config.json with text_config) as well as Kimi Linear's.

With its own modeling code (kimi.interop.remote), HF_DIR holds config.json (`auto_map`),
configuration_kimi.py, modeling_kimi.py and the kimi modules they import (our own model's code, its imports
made relative), and our tensors as safetensors: `AutoModelForCausalLM.from_pretrained(HF_DIR,
trust_remote_code=True)` runs our forward and our cached decoding (generate()); remote_code=true writes any
model so (our forward exactly, where transformers' class differs by its MLA latent norm eps). Either way to-hf
writes the run's tokenizer for `AutoTokenizer.from_pretrained(HF_DIR)` (kimi.interop.tokenizer_files:
tokenizer.json, tokenizer_config.json and the run's own file), and from-hf and load_hf read such a directory
back, bit for bit. For publishing it also writes generation_config.json (the tokenizer's ids, kimi.generate's
sampling defaults) and a model card, README.md (kimi.interop.model_card).

to-hf writes into a new folder beside HF_DIR and renames it into place when complete, its files 0644 and
folders 0755 whatever the umask (kimi.interop.publish):
an HF_DIR holding files is replaced only with overwrite=true, and a failed write keeps the earlier export.
from-hf and load_hf never import a directory's Python files, and refuse file names (an index's weight_map,
links) that lead out of it (kimi.folders); docs/huggingface.md, "What a model folder may do".

mxfp4_experts=true (for a run trained with precision.qat=mxfp4_experts) writes every routed expert's weight as
MXFP4 (kimi/precision/mxfp4.py): NAME.weight_packed and NAME.weight_scale (uint8) in place of NAME.weight,
and config.json's "mxfp4_experts" says so. load_hf and from-hf read them back, dequantised: the forward of
the trained model (whose experts computed with exactly those values). transformers does not read them.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kimi import lazy_getattr
from kimi.interop import layouts

if TYPE_CHECKING:  # for type checkers: the names __getattr__ below imports at run time
    from kimi.interop.hf_folder import load_hf, save_hf  # noqa: F401

__all__ = ["from_hf", "load_hf", "main", "save_hf", "to_hf"]  # load_hf and save_hf: kimi.interop.hf_folder


# load_hf and save_hf on first use: kimi.interop.hf_folder imports torch and the model, which --help and a
# malformed command line do without
__getattr__ = lazy_getattr(__name__, dict.fromkeys(["load_hf", "save_hf"], "kimi.interop.hf_folder"))


def from_hf(hf_dir: str | Path, run_dir: str | Path) -> list[str]:
    """Write a new run directory from a transformers directory (module docstring); returns the lines to
    print (what was written and the command that trains from it)."""
    from omegaconf import OmegaConf

    from kimi import checkpoint
    from kimi.config import ConfigError
    from kimi.model.config import model_dict
    from kimi.data import Tokenizer
    from kimi.errors import DataError
    from kimi.folders import require_inside
    from kimi.interop.hf_folder import load_hf

    hf_dir, run_dir = Path(hf_dir), Path(run_dir)
    if (run_dir / "init").exists() or checkpoint.list_checkpoints(run_dir / "checkpoints"):
        raise ConfigError(f"{run_dir} already holds a run or converted weights; from-hf writes a new run "
                          "dir: choose another, or move that one aside")
    model = load_hf(hf_dir)
    fields = model_dict(model.cfg)
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
            lines.append(f"[kimi] {found[0]} not copied: {e}; train with "
                         "data.tokenizer.model_path=<a tokenizer>")
    if tokenizer is not None and tokenizer.vocab_size > model.cfg.vocab_size:
        raise ValueError(f"{found[0]} has {tokenizer.vocab_size} tokens, more than the model's vocabulary "
                         f"({model.cfg.vocab_size}): it is not this model's tokenizer")
    run_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        extra["tokenizer_sha256"] = tokenizer.copy_to(run_dir / "tokenizer.model").sha256
    checkpoint.save_weights(run_dir / "init", model.state_dict(), {"model": fields}, extra)
    (run_dir / "model").mkdir(exist_ok=True)
    (run_dir / "model" / "hf.yaml").write_text(f"# {hf_dir}, converted by python -m kimi.convert from-hf\n"
                                               + OmegaConf.to_yaml({**fields, "name": "hf"}))
    data = f" data.tokenizer.model_path={run_dir / 'tokenizer.model'}" if tokenizer is not None else ""
    lines += [f"[kimi] wrote {run_dir}/init ({model.num_params():,} parameters, fp32) and "
              f"{run_dir}/model/hf.yaml",
              f"[kimi] train from it: python train.py --config-dir {run_dir} model=hf "
              f"hydra.run.dir={run_dir}{data}"]
    return lines


def to_hf(run: str, out: str, layout: str = layouts.DEFAULT, shard_gb: float = 5.0,
          mxfp4_experts: bool = False, remote_code: bool = False, overwrite: bool = False) -> int:
    """`to-hf` (module docstring), whichever grammar gave its arguments; prints what it wrote, returns 0."""
    from kimi import checkpoint
    from kimi.generate import GenerateArgs, find_checkpoint, load_from_checkpoint, run_of
    from kimi.interop.hf import NotExpressible
    from kimi.interop.hf_folder import save_hf
    from kimi.interop.model_card import write_generation_config, write_model_card
    from kimi.interop.publish import check_target, fresh_folder
    from kimi.interop.remote import save_remote
    from kimi.interop.tokenizer_files import check_packages, write_tokenizer

    if remote_code and (layout != layouts.DEFAULT or mxfp4_experts):
        raise ValueError("remote_code=true writes our own tensors and modeling code: drop layout= / "
                         "mxfp4_experts=")
    chosen = layouts.get(layout)
    check_target(Path(out), overwrite, Path(run))  # before the checkpoint is read
    ckpt = find_checkpoint(run)
    model, tokenizer, step = load_from_checkpoint(ckpt, found=True)
    check_packages(tokenizer)
    why = "remote_code=true" if remote_code else None
    # written into a new folder, renamed to `out` once every file is there
    with fresh_folder(Path(out), overwrite, Path(run)) as directory:
        if why is None:
            try:
                save_hf(model, directory, int(shard_gb * 2**30), layout, mxfp4_experts)
            except NotExpressible as e:
                if not chosen.falls_back or mxfp4_experts:  # the other layouts (and MXFP4) refuse
                    raise
                why = f"{chosen.falls_back} ({e})"
        if why is not None:
            special = {f"{k}_token_id": i for k, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))
                       if i >= 0}
            save_remote(model, directory, int(shard_gb * 2**30), special)
            print(f"[kimi] {why}: written with its own modeling code, which transformers runs with "
                  "trust_remote_code=True")
            chosen = layouts.REMOTE_CODE
        files = write_tokenizer(tokenizer, directory)
        # for publishing: transformers' sampling settings and a model card (neither is code: no trust record)
        sampling = GenerateArgs(run="")  # python -m kimi.generate's defaults
        card = [write_generation_config(directory, tokenizer, sampling.temperature, sampling.top_k),
                write_model_card(directory, model, checkpoint.read_trainer_state(ckpt)["config"], step,
                                 run_of(ckpt), _records(run_of(ckpt)), chosen.own_code, chosen.name)]
    what = "; routed experts as MXFP4, which transformers does not read" if mxfp4_experts else chosen.wrote
    print(f"[kimi] wrote {out} (step {step}): config.json and safetensors{what} ({chosen.name} layout), "
          f"the tokenizer ({', '.join(files)}), {' and '.join(card)}")
    return 0


def _records(run: Path) -> list:
    """The records of `run`'s metrics.jsonl (none when it has none): the model card's losses and scores."""
    from kimi.run.metrics import read_metrics

    return read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []


def _key_value(argv: list[str]) -> dict:
    """The key=value form's arguments of `to-hf` / `from-hf` (argv[0]), each required key checked."""
    from kimi.cli import keyvalue
    from kimi.config import ConfigError

    command, rest = argv[0], argv[1:]
    if command == "to-hf":
        keys = {"run": str, "out": str, "layout": keyvalue.one_of(*sorted(layouts.LAYOUTS)),
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


USAGE = {"to-hf": f"to-hf run=RUN_DIR out=HF_DIR [layout={'|'.join(layouts.LAYOUTS)}] [shard_gb=5] "
                  "[mxfp4_experts=true] [remote_code=true] [overwrite=true]",
         "from-hf": "from-hf hf=HF_DIR run=RUN_DIR"}


def _run(body) -> int:
    """body()'s exit code; a known problem is one line and the exit code kimi/errors.py gives its type (a
    forged checkpoint 1, as everywhere), a bad source directory or argument (ValueError) 2."""
    from kimi.errors import EXIT_BAD_INPUT, describe, exit_code_for

    try:
        return body()
    except Exception as e:  # noqa: BLE001 (anything unknown is re-raised below)
        code = exit_code_for(e)
        if code is None and isinstance(e, ValueError):
            code = EXIT_BAD_INPUT
        if code is None:
            raise
        print(f"error: {describe(e)}", file=sys.stderr, flush=True)
        return code


def _command(command: str, args: dict) -> int:
    """`to-hf` or `from-hf` with its arguments under their key=value names, from either grammar."""
    if command == "from-hf":
        print("\n".join(from_hf(args["hf"], args["run"])))
        return 0
    return to_hf(**args)


def main(argv: list[str] | None = None) -> int:
    """The command line: key=value (USAGE), or the deprecated positional form with --flags (argparse below),
    which says on stderr the key=value command it stands for."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(help_text(argv[0] if argv and argv[0] in USAGE else None))
        return 0
    if argv and argv[0] in USAGE and any("=" in a and not a.startswith("-") for a in argv[1:]):
        return _run(lambda: _command(argv[0], _key_value(argv)))
    parser, commands = _parser()
    args = vars(parser.parse_args(argv))
    command = args.pop("command")
    print("warning: the positional form of kimi.convert is deprecated; write "
          + _as_key_value(command, args, commands), file=sys.stderr, flush=True)
    return _run(lambda: _command(command, args))


def _as_key_value(command: str, args: dict, commands: dict) -> str:
    """The key=value command that parsed positional arguments `args` stand for, defaults left out."""
    import shlex

    words = [f"{key}={'true' if value is True else f'{value:g}' if isinstance(value, float) else value}"
             for key, value in args.items() if value != commands[command].get_default(key)]
    return " ".join(["python -m kimi.convert", command, *map(shlex.quote, words)])


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
    to_hf.add_argument("--layout", choices=sorted(layouts.LAYOUTS), default=layouts.DEFAULT,
                       help="tensor names: " + "; ".join(f"{name}: {layout.help}"
                                                         for name, layout in layouts.LAYOUTS.items()))
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
    from kimi.cli import keyvalue

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


if __name__ == "__main__":
    sys.exit(main())
