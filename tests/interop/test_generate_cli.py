"""`python -m kimi.generate`: arguments are parsed literally, and every bad argument or run directory is one
line on stderr with exit code 2 (kimi/errors.py), in-process through kimi.generate.main."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import TINY_TRAINER, make_corpus
from hydra import compose, initialize_config_dir

from kimi import checkpoint
from kimi.errors import EXIT_BAD_INPUT, EXIT_OK
from kimi.config import ConfigError, register_configs
from kimi.generate import USAGE, GenerateArgs, UsageError, main, parse_args

ROOT = Path(__file__).resolve().parents[2]
register_configs()


def fails(capsys, argv: list[str]) -> str:
    """main(argv) exits with 2 and says why on stderr; returns the `error:` line."""
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    notices = [line for line in err if line.startswith("[kimi] skipping")]  # checkpoints passed over
    assert len(errors) == 1 and set(err) <= {USAGE, errors[0], *notices}, err
    return errors[0]


@pytest.mark.unit
def test_values_are_taken_literally():
    assert parse_args(["run=r", "prompt=ROMEO:"]).prompt == "ROMEO:"
    assert parse_args(["run=r", "prompt=yes"]).prompt == "yes"
    assert parse_args(["run=r", "prompt=a=b {c: 1} [2]"]).prompt == "a=b {c: 1} [2]"
    assert parse_args(["run=r", "prompt=42"]).prompt == "42"
    assert parse_args(["run=runs/exp=1"]).run == "runs/exp=1"


@pytest.mark.unit
def test_numbers_are_parsed_and_defaults_kept():
    args = parse_args(["run=r", "max_new_tokens=7", "temperature=0", "top_k=0", "seed=3", "device=cpu"])
    assert args == GenerateArgs(run="r", max_new_tokens=7, temperature=0.0, top_k=0, seed=3, device="cpu")
    assert parse_args(["run=r"]) == GenerateArgs(run="r")


@pytest.mark.unit
@pytest.mark.parametrize("argv,usage,message", [
    ([], True, "run= is missing"),
    (["prompt=ROMEO:"], True, "run= is missing"),
    (["run="], True, "run= is missing"),
    (["run=r", "tokens=3"], True, "unknown key 'tokens': did you mean max_new_tokens?"),
    (["run=r", "colour=red"], True, "unknown key 'colour' (keys: run, prompt, prompt_file, max_new_tokens"),
    (["run=r", "prompt_fle=p.txt"], True, "unknown key 'prompt_fle': did you mean prompt_file?"),
    (["run=r", "ROMEO:"], True, "'ROMEO:' is not key=value"),
    (["run=r", "seed=1", "seed=2"], True, "seed is given twice"),
    (["run=r", "prompt="], False, "prompt='' is invalid: give the text to continue"),
    (["run=r", "max_new_tokens=-5"], False, "max_new_tokens='-5' is invalid: must be an integer >= 1"),
    (["run=r", "max_new_tokens=0"], False, "max_new_tokens='0' is invalid: must be an integer >= 1"),
    (["run=r", "max_new_tokens=abc"], False, "max_new_tokens='abc' is invalid: must be an integer >= 1"),
    (["run=r", "max_new_tokens=2.5"], False, "max_new_tokens='2.5' is invalid"),
    (["run=r", "temperature=-1"], False, "temperature='-1' is invalid: must be a number >= 0 (0 = greedy)"),
    (["run=r", "temperature=nan"], False, "temperature='nan' is invalid"),
    (["run=r", "temperature=hot"], False, "temperature='hot' is invalid"),
    (["run=r", "top_k=-1"], False, "top_k='-1' is invalid: must be an integer >= 0 (0 = the whole "
                                   "vocabulary)"),
    (["run=r", "seed=-1"], False, "seed='-1' is invalid: must be an integer in [0, 2**64)"),
    (["run=r", f"seed={2**64}"], False, "is invalid: must be an integer in [0, 2**64)"),
    (["run=r", "device=gpu"], False, "device='gpu' is invalid: give cpu, cuda or cuda:N"),
    (["run=r", "device=meta"], False, "device='meta' is invalid: this machine has no meta device"),
])
def test_bad_argument_is_one_line_and_exit_2(capsys, argv, usage, message):
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(USAGE + "\n") == usage, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: ") and message in line, err


# ---- prompt_file= ---------------------------------------------------------------------------------------
@pytest.mark.unit
def test_prompt_file_is_read_as_written(tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("ROMEO:\nBut soft, what light — through yonder window?\n", encoding="utf-8")
    args = parse_args(["run=r", f"prompt_file={path}"])
    assert args.prompt == "ROMEO:\nBut soft, what light — through yonder window?\n"
    assert args.prompt_file == str(path)
    path.write_bytes(b"\xef\xbb\xbfa=b {c: 1}")  # a byte-order mark is not part of the text
    assert parse_args([f"prompt_file={path}", "run=r"]).prompt == "a=b {c: 1}"
    assert parse_args(["run=r"]).prompt_file is None


@pytest.mark.unit
@pytest.mark.parametrize("content,usage,message", [
    (None, False, "prompt_file={path}: no such file"),
    ("dir", False, "prompt_file={path}: is a directory; give a text file"),
    (b"ROMEO:\n caf\xe9\n", False,
     "prompt_file={path} is not UTF-8 text (invalid continuation byte at byte 11, line 2); save it as "
     "UTF-8"),
    (b"\xff\xfeR\x00O\x00", False,
     "prompt_file={path} is not UTF-8 text (invalid start byte at byte 0, line 1)"),
    (b"", False, "prompt_file={path} is empty: put the text to continue in it"),
    (b"\xef\xbb\xbfab\n\xff", False,  # after a byte-order mark: bytes still count from the file's start
     "prompt_file={path} is not UTF-8 text (invalid start byte at byte 6, line 2)"),
])
def test_bad_prompt_file_is_one_line_and_exit_2(capsys, tmp_path, content, usage, message):
    path = tmp_path / "prompt.txt"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_bytes(content)
    line = fails(capsys, [f"run={tmp_path}", f"prompt_file={path}"])
    assert line.startswith("error: " + message.format(path=path)), line


@pytest.mark.unit
@pytest.mark.parametrize("argv,message", [
    # exclusive with prompt=, checked before the file is read (this one does not exist)
    (["run=r", "prompt=ROMEO:", "prompt_file=missing.txt"], "prompt= and prompt_file= are both given"),
    (["run=r", "prompt_file=missing.txt", "prompt=ROMEO:"], "prompt= and prompt_file= are both given"),
    (["run=r", "prompt_file=a.txt", "prompt_file=b.txt"], "prompt_file is given twice"),
    (["prompt_file=missing.txt"], "run= is missing"),
])
def test_prompt_file_usage_mistakes(capsys, argv, message):
    assert main(argv) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith(USAGE + "\n"), err
    assert err.strip().splitlines()[-1].startswith("error: " + message), err


@pytest.mark.unit
def test_empty_prompt_file_path(capsys):
    assert fails(capsys, ["run=r", "prompt_file="]) == (
        "error: prompt_file='' is invalid: give the path of a UTF-8 text file")


@pytest.mark.unit
def test_help_names_prompt_file(capsys):
    assert "prompt_file=PATH" in USAGE
    assert main(["--help"]) == EXIT_OK
    assert "\n  prompt_file " in capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.skipif(torch.cuda.is_available(), reason="the machine has CUDA")
def test_cuda_without_cuda_is_one_line(capsys):
    assert "device='cuda' is invalid: this machine has no cuda device; use device=cpu" in fails(
        capsys, ["run=r", "device=cuda"])


@pytest.mark.unit
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_index_past_the_devices_is_one_line(capsys):
    n = torch.cuda.device_count()
    assert f"this machine has {n} cuda device(s)" in fails(capsys, ["run=r", f"device=cuda:{n}"])


@pytest.mark.unit
def test_parse_errors_are_config_errors():
    # run_main turns ConfigError into exit code 2; UsageError additionally gets the usage line
    with pytest.raises(UsageError):
        parse_args(["run=r", "x"])
    with pytest.raises(ConfigError) as err:
        parse_args(["run=r", "top_k=-1"])
    assert not isinstance(err.value, UsageError)


@pytest.mark.unit
def test_help_prints_usage_and_exits_0(capsys):
    assert main(["--help"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith(USAGE) and "prompt=ROMEO:" in out
    assert main(["run=r", "-h"]) == EXIT_OK


@pytest.mark.unit
def test_missing_run_dir(capsys, tmp_path):
    assert fails(capsys, [f"run={tmp_path / 'nope'}"]) == f"error: run={tmp_path / 'nope'}: no such directory"


@pytest.mark.unit
def test_run_that_is_a_file(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    assert "not a directory" in fails(capsys, [f"run={tmp_path / 'file'}"])


@pytest.mark.unit
def test_run_dir_without_checkpoints(capsys, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    assert str(tmp_path) in fails(capsys, [f"run={tmp_path}"])


@pytest.mark.unit
def test_incomplete_checkpoints(capsys, tmp_path):
    # a save cut off before its COMPLETE marker: as the run dir and as the checkpoint dir itself
    step = tmp_path / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"cut off")
    assert str(tmp_path) in fails(capsys, [f"run={tmp_path}"])
    assert str(step) in fails(capsys, [f"run={step}"])


# ---- on a real (tiny) run ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    from kimi.trainer import Trainer

    tmp = tmp_path_factory.mktemp("generate")
    corpus = make_corpus(tmp / "corpus", docs=12, sentences=40)
    files = ",".join(str(p) for p in sorted(corpus.glob("*.txt")))
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"trainer.run_dir={tmp / 'run'}", f"data.data_files=[{files}]",
                                           f"data.cache_dir={tmp / 'cache'}", *TINY_TRAINER,
                                           "trainer.max_steps=1", "trainer.eval_every=0"])
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("HF_HOME", str(tmp / "hf"))
        Trainer(cfg).fit()
    return tmp / "run"


@pytest.mark.e2e
def test_literal_prompt_on_a_run(run, capsys):
    assert main([f"run={run}", "prompt=ROMEO:", "max_new_tokens=3", "temperature=0"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("[kimi] step 1 checkpoint") and "\nROMEO:" in out
    step = checkpoint.latest_complete(run / "checkpoints").path
    assert main([f"run={step}", "prompt=yes", "max_new_tokens=2", "top_k=0", "seed=5"]) == EXIT_OK
    assert "\nyes" in capsys.readouterr().out


@pytest.mark.e2e
def test_checkpoint_cut_off_given_directly(run, capsys, tmp_path):
    step = checkpoint.latest_complete(run / "checkpoints").path
    cut = tmp_path / "checkpoints" / step.name
    shutil.copytree(step, cut)
    (cut / checkpoint.COMPLETE).unlink()
    assert str(cut) in fails(capsys, [f"run={cut}", "max_new_tokens=2"])


@pytest.mark.e2e
def test_prompt_file_on_a_run(run, capsys, tmp_path):
    path = tmp_path / "prompt.txt"
    path.write_text("ROMEO:\nThe king loves", encoding="utf-8")
    assert main([f"run={run}", f"prompt_file={path}", "max_new_tokens=3", "temperature=0"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("[kimi] step 1 checkpoint") and "\nROMEO:\nThe king loves" in out
    # the same text given with prompt= samples the same tokens
    argv = [f"run={run}", "prompt=ROMEO:\nThe king loves", "max_new_tokens=3", "temperature=0"]
    assert main(argv) == EXIT_OK
    assert capsys.readouterr().out == out
