"""Sampling from a trained run's model on the command line (the decoding itself: kimi/model/decode.py).

From a shell, on a run directory (or one checkpoint directory, <run>/checkpoints/step_N):

    python -m kimi.generate run=runs/exp1 prompt=ROMEO: max_new_tokens=100 temperature=0.8 top_k=50
    python -m kimi.generate run=runs/exp1 prompt_file=prompt.txt     # a long or multi-line prompt

Arguments are key=value, split at the first '='; the prompt is taken as written (prompt=ROMEO: is the text
"ROMEO:", prompt=yes the text "yes"), and one with spaces needs shell quotes: 'prompt=The king'. A bad
argument or run directory is one line on stderr and exit code 2 (kimi/errors.py); `--help` lists the keys.
torch and the model are imported where they are used, so `--help` and a malformed command line answer
without torch's start-up (seconds).
"""

from __future__ import annotations

import codecs
import difflib
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kimi.cli import key_value_main
from kimi.config import ConfigError
from kimi.errors import EXIT_OK


def find_checkpoint(path: str | Path) -> Path:
    """The checkpoint directory `path` names (checked intact), or a run directory's newest complete
    checkpoint, else the weights kimi.convert from-hf put in <run>/init."""
    from kimi import checkpoint
    from kimi.errors import RunError

    ckpt = Path(path)
    if (ckpt / checkpoint.COMPLETE).is_file():  # a checkpoint named directly: it must be intact
        problems = checkpoint.verify(ckpt)
        if problems:
            raise RunError(f"checkpoint {ckpt} is damaged: {'; '.join(problems[:3])}")
    else:
        latest = checkpoint.newest_intact(ckpt / "checkpoints", log=lambda line: print(line, file=sys.stderr))
        init = ckpt / "init"  # the weights kimi.convert from-hf writes, before any training
        if latest is None and (init / checkpoint.COMPLETE).is_file() and not checkpoint.verify(init):
            ckpt = init
        elif latest is None:
            raise FileNotFoundError(f"{ckpt} is neither a complete checkpoint nor a run dir with one "
                                    f"(looked for {ckpt / 'checkpoints'}/step_*/{checkpoint.COMPLETE})")
        else:
            ckpt = latest.path
    return ckpt


def run_of(ckpt: Path) -> Path:
    """The run directory a checkpoint directory (find_checkpoint's) belongs to."""
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def load_from_checkpoint(path: str | Path, device: str = "cpu", found: bool = False):
    """(model, tokenizer, step) from a checkpoint directory, or from a run directory (find_checkpoint;
    found=True: `path` is find_checkpoint's answer, not checked again). The model is rebuilt from the config
    saved in the checkpoint."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from kimi import checkpoint
    from kimi.config import ModelConfig, check_sizes
    from kimi.data import Tokenizer
    from kimi.errors import RunError
    from kimi.model import KimiModel
    from kimi.model.footprint import check_fits

    ckpt = Path(path) if found else find_checkpoint(path)
    saved = checkpoint.read_trainer_state(ckpt)
    cfg = ModelConfig(**saved["config"]["model"])
    try:  # sizes no model has: a damaged or forged checkpoint, refused like one
        check_sizes(cfg)
    except ConfigError as e:
        raise RunError(f"checkpoint {ckpt} is damaged: its config has {e}") from None
    for where in dict.fromkeys(["cpu", str(device)]):  # built in fp32 on the CPU, then moved to the device
        check_fits(cfg, 4, where, f"fp32 weights on {where}",
                   "device=cpu" if where != "cpu" else "a machine with more memory")
    model = KimiModel(cfg).to(device)
    state = get_model_state_dict(model)
    checkpoint.load_model(ckpt, state)
    set_model_state_dict(model, state)
    run = run_of(ckpt)
    run_copy = run / "tokenizer.model"  # the run's own copy
    if not run_copy.is_file() and "tokenizer_path" not in saved["extra"]:
        raise FileNotFoundError(f"{run} has no tokenizer.model: these weights came without a tokenizer "
                                "(kimi.convert from-hf copies one only when the source directory has one)")
    tokenizer = Tokenizer(run_copy if run_copy.is_file() else saved["extra"]["tokenizer_path"])
    return model.eval(), tokenizer, saved["step"]


USAGE = ("usage: python -m kimi.generate run=DIR [prompt=TEXT | prompt_file=PATH] [max_new_tokens=200] "
         "[temperature=0.8] [top_k=50] [seed=0] [device=cpu]")
HELP = f"""{USAGE}

Continue a prompt with the model of a run directory (its newest complete checkpoint) or of one checkpoint
directory (<run>/checkpoints/step_N). Each argument is key=value, split at the first '=', and the prompt is
taken as written: prompt=ROMEO: is the text "ROMEO:" and prompt=yes the text "yes". Quote a prompt with spaces
for the shell: 'prompt=The king'.

  run             run directory or checkpoint directory (required)
  prompt          text to continue (default ROMEO:)
  prompt_file     a UTF-8 text file whose whole content is the prompt, taken as written (a final newline
                  included); for long or multi-line prompts; not together with prompt=
  max_new_tokens  tokens to sample, >= 1 (default 200; fewer when the end-of-text token comes first)
  temperature     >= 0; 0 is greedy (default 0.8)
  top_k           sample among the k likeliest tokens; 0 is the whole vocabulary (default 50)
  seed            >= 0 (default 0)
  device          cpu, cuda, cuda:N (default cpu)

Exit codes: 0 done, 2 bad arguments or run directory, 1 failure."""


@dataclass
class GenerateArgs:
    run: str
    prompt: str = "ROMEO:"
    prompt_file: str | None = None  # where prompt was read from, when prompt_file= was given
    max_new_tokens: int = 200
    temperature: float = 0.8
    top_k: int = 50
    seed: int = 0
    device: str = "cpu"


class UsageError(ConfigError):
    """A malformed command line (unknown key, no '=', no run=): main prints the usage line before it."""


def _int(key: str, text: str, low: int, high: int | None, allowed: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value >= high):
        raise ConfigError(f"{key}={text!r} is invalid: {allowed}")
    return value


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"temperature={text!r} is invalid: must be a number >= 0 (0 = greedy)")
    return value


def _device(text: str) -> str:
    """A torch device this machine has: torch.device alone accepts cuda:7 on a machine without CUDA."""
    import torch

    try:
        device = torch.device(text)
    except RuntimeError:
        raise ConfigError(f"device={text!r} is invalid: give cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return text
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu
    if backend is None or not hasattr(backend, "is_available") or not backend.is_available():
        raise ConfigError(f"device={text!r} is invalid: this machine has no {device.type} device; "
                          "use device=cpu")
    count = backend.device_count() if hasattr(backend, "device_count") else 1
    if device.index is not None and device.index >= count:
        raise ConfigError(f"device={text!r} is invalid: this machine has {count} {device.type} device(s), "
                          f"{device.type}:0 to {device.type}:{count - 1}")
    return text


def _prompt(text: str) -> str:
    if not text:
        raise ConfigError("prompt='' is invalid: give the text to continue, e.g. prompt=ROMEO:")
    return text


def _prompt_file(text: str) -> str:
    """The file's text (UTF-8; a byte-order mark is dropped); any problem reading it is one line."""
    if not text:
        raise ConfigError("prompt_file='' is invalid: give the path of a UTF-8 text file")
    path = Path(text).expanduser()
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"prompt_file={text}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"prompt_file={text}: is a directory; give a text file") from None
    except OSError as e:
        raise ConfigError(f"prompt_file={text}: cannot read it ({e.strerror or type(e).__name__})") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        prompt = data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start
        line = data[:at].count(b"\n") + 1
        raise ConfigError(f"prompt_file={text} is not UTF-8 text ({e.reason} at byte {at}, line {line}); "
                          "save it as UTF-8") from None
    if not prompt:
        raise ConfigError(f"prompt_file={text} is empty: put the text to continue in it")
    return prompt


_PARSERS = {
    "run": str,
    "prompt": _prompt,
    "prompt_file": _prompt_file,
    "max_new_tokens": lambda t: _int("max_new_tokens", t, 1, None, "must be an integer >= 1"),
    "temperature": _temperature,
    "top_k": lambda t: _int("top_k", t, 0, None, "must be an integer >= 0 (0 = the whole vocabulary)"),
    "seed": lambda t: _int("seed", t, 0, 2**64, "must be an integer in [0, 2**64)"),
    "device": _device,
}


def split_known(arg: str, keys) -> tuple[str, str]:
    """(key, value) of a key=value argument whose key is one of `keys`; UsageError (with the closest key)
    otherwise."""
    key, eq, text = arg.partition("=")
    if not eq:
        raise UsageError(f"{arg!r} is not key=value")
    if key not in keys:
        close = difflib.get_close_matches(key, list(keys), n=1)
        hint = f": did you mean {close[0]}?" if close else f" (keys: {', '.join(keys)})"
        raise UsageError(f"unknown key {key!r}{hint}")
    return key, text


def parse_args(argv: list[str]) -> GenerateArgs:
    """key=value arguments, split at the first '='. Values stay strings until their own parser: a general
    one (OmegaConf.from_cli) turns prompt=ROMEO: into a mapping and prompt=yes into True. prompt_file is read
    last, once the command line is known to be well formed."""
    values: dict[str, Any] = {}
    prompt_file: str | None = None
    for arg in argv:
        key, text = split_known(arg, _PARSERS)
        if key in values or (key == "prompt_file" and prompt_file is not None):
            raise UsageError(f"{key} is given twice")
        if key == "prompt_file":
            prompt_file = text
        else:
            values[key] = _PARSERS[key](text)
    if not values.get("run"):
        raise UsageError("run= is missing: give a run directory or a checkpoint directory")
    if prompt_file is not None:
        if "prompt" in values:
            raise UsageError("prompt= and prompt_file= are both given: give one of them")
        values.update(prompt=_prompt_file(prompt_file), prompt_file=prompt_file)
    return GenerateArgs(**values)


def _generate(args: GenerateArgs) -> int:
    import torch

    from kimi.model.decode import generate

    run = Path(args.run)
    if not run.exists():
        raise FileNotFoundError(f"run={args.run}: no such directory")
    if not run.is_dir():
        raise NotADirectoryError(f"run={args.run}: not a directory (give a run or checkpoint directory)")
    model, tokenizer, step = load_from_checkpoint(args.run, args.device)
    ids = tokenizer.encode(args.prompt)
    if not ids:
        given = f"prompt_file={args.prompt_file}" if args.prompt_file else f"prompt={args.prompt!r}"
        raise ConfigError(f"{given} is invalid: it encodes to no tokens; give some text")
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    new = generate(model, ids, args.max_new_tokens, args.temperature, args.top_k, tokenizer.eos_id, generator)
    print(f"[kimi] step {step} checkpoint, {len(new)} tokens:\n{args.prompt}{tokenizer.decode(new)}",
          flush=True)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """The command line (see HELP); returns the exit code, every known problem printed as one line."""
    return key_value_main(argv, HELP, USAGE, parse_args, _generate, UsageError)


if __name__ == "__main__":
    sys.exit(main())
