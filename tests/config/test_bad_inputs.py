"""Bad inputs and faults a user can hit with `python train.py` and `python -m kimi.generate`, end to end.

Every case runs the command's entry point and checks what the user gets: (1) one `error: ...` line on
stderr with the words that say what is wrong, and no traceback; (2) the exit code (kimi/errors.py); (3) that
no checkpoint was lost: the bad command runs against a copy of a trained run, whose complete checkpoints must
still be there and still pass `checkpoint.verify` afterwards.

The trainer runs in-process through train.py's own @hydra.main (sys.argv patched), so Hydra's command-line
parsing, run_main and finish are on the path as they are for a user; `--config-path` is needed because
train.py is not imported as __main__. Three cases run real processes, to prove there is no traceback from
interpreter start to exit. tests/data/test_bad_data.py and tests/config/test_validation.py test the same kinds
of mistakes at the function level.

A case marked xfail(strict) shows a bug in the product; its reason says what is wrong.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import datasets
import huggingface_hub.constants
import pytest
import torch
from helpers import TINY_TRAINER as TINY
from hydra import compose, initialize_config_dir

from kimi import checkpoint
from kimi.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, EXIT_STOPPED
from kimi.config import register_configs
from kimi.trainer import Trainer

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
register_configs()
_spec = importlib.util.spec_from_file_location("train_script", ROOT / "train.py")
train_script = importlib.util.module_from_spec(_spec)
_before = signal.getsignal(signal.SIGTERM)
_spec.loader.exec_module(train_script)
# train.py installs its start-up SIGTERM handler when imported; this process is pytest's, whose later tests
# check which handler a Trainer leaves behind
signal.signal(signal.SIGTERM, _before)


# ---- fixtures ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def offline(tmp_path_factory):
    """No network; the Hugging Face and kimi caches in a temporary directory (JSON goes through datasets)."""
    home = tmp_path_factory.mktemp("hf")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("HF_HOME", str(home))
        mp.setenv("KIMI_CACHE_DIR", str(home / "kimi"))
        mp.setenv("OMP_NUM_THREADS", "1")  # for the real processes: tiny tensors, two shared cores
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield home


def argv(run: Path, data: list[str], *overrides: str) -> list[str]:
    """train.py's arguments; the overrides come last, and a later value of a key wins."""
    return [f"hydra.run.dir={run}", *data, *TINY, "trainer.eval_every=0", *overrides]


def trainer(run: Path, data: list[str], *overrides: str) -> Trainer:
    """A Trainer with train.py's config for these arguments (hydra.run.dir is trainer.run_dir here)."""
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*argv(run, data, *overrides)[1:], f"trainer.run_dir={run}"])
    return Trainer(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data) -> Path:
    """A finished run with complete checkpoints at steps 2 and 4 (muonclip); cases change only copies."""
    run = tmp_path_factory.mktemp("trained") / "run"
    trainer(run, data, "trainer.max_steps=4", "trainer.checkpoint_every=2").fit()
    assert [c.step for c in checkpoint.list_checkpoints(run / "checkpoints")] == [2, 4]
    return run


@pytest.fixture
def run(trained, tmp_path) -> Path:
    """This case's own copy of the trained run."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy, ignore=shutil.ignore_patterns(".lock"))
    return copy


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def train_py(monkeypatch, capsys, data) -> Callable[..., Result]:
    """`python train.py hydra.run.dir=RUN <the module's corpus and tiny model> OVERRIDES...`, in-process."""
    def run(run_dir: Path, *overrides: str) -> Result:
        capsys.readouterr()
        monkeypatch.setattr(sys, "argv", ["train.py", f"--config-path={ROOT / 'conf'}",
                                          *argv(run_dir, data, *overrides)])
        root = logging.getLogger()
        handlers, level = root.handlers[:], root.level
        try:
            with pytest.raises(SystemExit) as stop:
                train_script.cli()
        finally:  # Hydra's job logging: a log file in the run dir and this test's captured stdout
            for handler in set(root.handlers) - set(handlers):
                handler.close()
            root.handlers[:] = handlers
            root.setLevel(level)
        out, err = capsys.readouterr()
        return Result(stop.value.code or 0, out, err)
    return run


@pytest.fixture
def generate_py(capsys) -> Callable[..., Result]:
    """`python -m kimi.generate ARGS...`, in-process."""
    from kimi.generate import main

    def run(*args: str) -> Result:
        capsys.readouterr()
        code = main(list(args))
        out, err = capsys.readouterr()
        return Result(code, out, err)
    return run


# ---- what every case checks ----------------------------------------------------------------------------

# Progress bars (tqdm on stderr, one update after each \r: datasets' and the tokenising pass's) come before
# the message and are not part of it.
PROGRESS = re.compile(r"^[\w ]+: .*\[\d\d:\d\d.*/s\]$")


def error_line(err: str, may_precede: tuple[str, ...] = ()) -> str:
    """The one `error:` line, last on stderr; before it only progress bars and lines starting with
    `may_precede`."""
    assert "Traceback" not in err, err
    lines = [line for line in err.strip().splitlines() if line and not PROGRESS.match(line)]
    assert lines and lines[-1].startswith("error: "), repr(err)
    assert all(line.startswith(may_precede) for line in lines[:-1]), repr(err)
    return lines[-1]


def expect(result: Result, code: int, words: tuple[str, ...], may_precede: tuple[str, ...] = ()) -> None:
    """The exit code, and the words: in the error line for a failure, on stdout for a handled fault (exit 0)
    or an early stop (exit 75), which leave stderr without an error."""
    assert result.code == code, (result.code, result.err[-3000:], result.out[-2000:])
    if code in (EXIT_OK, EXIT_STOPPED):
        assert "Traceback" not in result.err and "error:" not in result.err, result.err
        text = result.out
    else:
        text = error_line(result.err, may_precede)
    for word in words:
        assert word in text, (word, text)


def intact_checkpoints(run: Path) -> dict[int, bool]:
    """step -> whether it verifies, for every complete checkpoint of the run."""
    return {c.step: checkpoint.verify(c.path) == [] for c in checkpoint.list_checkpoints(run / "checkpoints")
            if c.complete}


def assert_checkpoints_intact(run: Path, before: dict[int, bool]) -> None:
    """Every checkpoint complete before is still complete, and still verifies if it did (a damaged one must
    stay too: deleting it is the user's call)."""
    after = intact_checkpoints(run)
    aside = {int(p.name[5:13]) for p in (run / "checkpoints").glob(f"step_*{checkpoint.DAMAGED}*")}
    for step, intact in before.items():
        if step in aside and not intact:  # a damaged one renamed by a resume, not deleted
            continue
        assert step in after, f"checkpoint {step} was lost: {sorted(after)}"
        assert after[step] or not intact, f"checkpoint {step} was intact and is now damaged"


def case(id: str, *values, bug: str | None = None):
    """A row of a case table; `bug` marks one that shows a bug (strict: a fix must update the table)."""
    return pytest.param(*values, id=id, marks=[pytest.mark.xfail(strict=True, reason=bug)] if bug else [])


NO_CUDA = [pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")]


# ---- damage to a run, as a failing disk or someone who can write the run dir would do it ----------------

def ckpt(run: Path, step: int) -> Path:
    return checkpoint.step_dir(run / "checkpoints", step)


def flip_byte(path: Path) -> None:
    f = next(p for p in sorted(path.iterdir()) if p.suffix == ".distcp")
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))


class Evidence:
    """Unpickling this creates a file: proof that loading a checkpoint ran code."""

    path = ""

    def __reduce__(self):
        return open, (self.path, "w")


def replant(path: Path, payload: bytes) -> None:
    """Replace .metadata and fix its manifest entry, so that only the content itself can give it away."""
    (path / ".metadata").write_bytes(payload)
    marker = json.loads((path / checkpoint.COMPLETE).read_text())
    marker["files"][".metadata"] = [len(payload), checkpoint.manifest.crc32(path / ".metadata")]
    (path / checkpoint.COMPLETE).write_text(json.dumps(marker))


def plant_pickle(path: Path, evidence: Path) -> None:
    Evidence.path = str(evidence)
    replant(path, pickle.dumps(Evidence()))


# ---- train.py: config mistakes -------------------------------------------------------------------------
# (overrides, words of the error line). Each runs against a copy of the trained run: a bad config must be
# refused before the run dir is touched.

CONFIG = [
    case("unknown key with +", ["+trainer.max_stepz=3"],
         ["trainer.max_stepz is not a config key", "did you mean trainer.max_steps?"]),
    case("unknown top-level key", ["+bar=1"], ["bar is not a config key"]),
    case("unknown section key", ["+model.d_modle=64"],
         ["model.d_modle is not a config key", "model.d_model"]),
    case("unknown key without +", ["trainer.max_stepz=3"], ["trainer.max_stepz", "trainer.max_steps"]),
    case("text for a number", ["trainer.max_steps=ten"], ["trainer.max_steps", "ten"]),
    case("unknown preset", ["optim=sgd"], ["optim", "sgd", "adamw", "muonclip"]),
    case("precision fp4", ["trainer.precision=fp4"],
         ["trainer.precision='fp4' is invalid", "fp32|bf16|fp8|mxfp8"]),
    case("activation checkpointing", ["parallel.activation_checkpointing=some"],
         ["parallel.activation_checkpointing='some' is invalid", "none|full|selective"]),
    case("residual mode", ["model.residual=dense"], ["model.residual='dense' is invalid", "attnres_block"]),
    case("init_std huge", ["model.init_std=1e6"], ["model.init_std=1000000.0 is invalid", "(0, 1]"]),
    case("negative seed", ["trainer.seed=-1"], ["trainer.seed=-1 is invalid", "[0, 2**64)"]),
    case("lr zero", ["optim.lr=0"], ["optim.lr=0.0 is invalid", "> 0"]),
    case("lr infinite", ["optim.lr=inf"], ["optim.lr=inf is invalid", "finite"]),
    case("lr times decay", ["optim.lr=2", "optim.weight_decay=0.5"], ["optim.lr*optim.weight_decay", "< 1"]),
    case("max_steps zero", ["trainer.max_steps=0"], ["trainer.max_steps=0 is invalid", "positive"]),
    case("micro batch zero", ["trainer.micro_batch_size=0"], ["trainer.micro_batch_size=0 is invalid"]),
    case("norm_eps zero", ["model.norm_eps=0"], ["model.norm_eps=0.0 is invalid", "(0, 1)"]),
    case("timeout zero", ["trainer.collective_timeout_s=0"], ["trainer.collective_timeout_s=0.0 is invalid"]),
    case("keep no checkpoints", ["trainer.keep_checkpoints=0"],
         ["trainer.keep_checkpoints=0 is invalid", ">= 1"]),
    case("betas", ["optim.betas=[0.9]"], ["optim.betas=[0.9] is invalid", "two numbers"]),
    case("val_fraction one", ["data.val_fraction=1.0"], ["data.val_fraction=1.0 is invalid", "[0, 1)"]),
    case("files without data_files", ["data.data_files=null"], ["data.source=files needs a list"]),
    case("tp without processes", ["parallel.tp=2"],
         ["dp_replicate*dp_shard*cp*tp*pp", "1 process(es)", "torchrun"]),
    case("mla layer out of range", ["model.mla_layers=[7]"], ["model.mla_layers=[7] is invalid", "[0, 1]"]),
    case("empty sample prompt", ["trainer.sample_tokens=5", "trainer.sample_prompt="],
         ["trainer.sample_prompt='' is invalid", "trainer.sample_tokens=0"]),
    pytest.param(["trainer.device=cuda"], ["trainer.device='cuda' is invalid", "trainer.device=cpu"],
                 id="cuda without CUDA", marks=NO_CUDA),
    case("vocab below tokenizer", ["model.vocab_size=300"],
         ["model.vocab_size=300 is invalid", "data.tokenizer.vocab_size=384"]),
]


@pytest.mark.parametrize("overrides,words", CONFIG)
def test_config_mistake(train_py, run, overrides, words):
    before = intact_checkpoints(run)
    expect(train_py(run, *overrides), EXIT_BAD_INPUT, tuple(words))
    assert_checkpoints_intact(run, before)
    assert (run / "exit_code").read_text() == "2\n"  # what the launch scripts exit with


# ---- train.py: data mistakes ---------------------------------------------------------------------------
# (files written into this case's corpus dir, overrides ("{corpus}" is that dir), words of the error line).
# The bad corpus gets its own cache dir, so that nothing of it is left for a later run to trust.

ROW = b'{"text": "The king loves the crown."}\n'
TEXT = b"The king loves the crown.\n"


def files(*names: str) -> str:
    return "data.data_files=[" + ",".join(f"'{{corpus}}/{name}'" for name in names) + "]"


DATA = [
    case("binary file", {"noise.txt": bytes(range(256)) * 16}, [files("noise.txt")],
         ["noise.txt", "looks binary"]),
    case("invalid UTF-8", {"latin1.txt": "one\ntwo\ncaf\xe9\n".encode("latin-1")}, [files("latin1.txt")],
         ["latin1.txt, line 3", "invalid UTF-8", "iconv"]),
    case("malformed JSONL", {"rows.jsonl": ROW + b"this is not json\n" + ROW}, [files("rows.jsonl")],
         ["rows.jsonl, line 2", "not valid JSON"]),
    case("null text field", {"rows.jsonl": ROW * 2 + b'{"text": null}\n'}, [files("rows.jsonl")],
         ["rows.jsonl, line 3", "'text'", "is null"]),
    case("missing text field", {"rows.jsonl": ROW + b'{"body": "x"}\n'}, [files("rows.jsonl")],
         ["rows.jsonl, line 2", "has no field 'text'", "data.text_field"]),
    case("number in a later file", {"a.jsonl": ROW * 3, "b.jsonl": ROW + b'{"text": 42}\n'},
         [files("a.jsonl", "b.jsonl")], ["b.jsonl, line 2", "a number"]),
    case("pattern matches nothing", {}, [files("nowhere/*.txt")], ["nothing matches", "nowhere/*.txt"]),
    case("directory", {"sub/doc.txt": TEXT}, [files("sub")], ["sub is a directory", "sub/*"]),
    case("empty file", {"empty.txt": b""}, [files("empty.txt")], ["empty.txt", "is empty"]),
    case("missing file", {}, [files("gone.txt")], ["gone.txt"]),
    case("text read as parquet", {"doc.txt": TEXT}, [files("doc.txt"), "data.format=parquet"],
         ["doc.txt", "Parquet"]),
    case("parquet that is not", {"rows.parquet": b"PAR1 this is not parquet"}, [files("rows.parquet")],
         ["rows.parquet", "not a readable Parquet file"]),
    case("tokenizer model missing", {}, ["data.tokenizer.model_path='{corpus}/gone.model'"],
         ["data.tokenizer.model_path=", "gone.model' does not exist"]),
    case("tokenizer model not one", {"fake.model": b"not a sentencepiece model\n"},
         ["data.tokenizer.model_path='{corpus}/fake.model'"],
         ["fake.model is neither a sentencepiece model"]),
]


@pytest.mark.parametrize("written,overrides,words", DATA)
def test_data_mistake(train_py, run, tmp_path, written, overrides, words):
    corpus = tmp_path / "corpus"
    for name, content in written.items():
        (corpus / name).parent.mkdir(parents=True, exist_ok=True)
        (corpus / name).write_bytes(content)
    before = intact_checkpoints(run)
    overrides = [o.format(corpus=corpus) for o in overrides]
    expect(train_py(run, f"data.cache_dir={tmp_path / 'cache'}", *overrides), EXIT_BAD_INPUT, tuple(words))
    assert_checkpoints_intact(run, before)
    assert not list((tmp_path / "cache").rglob("*.bin"))  # no token file a later run could take for good


# ---- train.py: run-directory faults, resumes and stops --------------------------------------------------
# Each setup damages or occupies this case's copy of the trained run (steps 2 and 4) and returns the run dir
# to give the command; the stack holds what must outlive the command (a first trainer).

Setup = Callable[[Path, ExitStack, list], Path]


def as_is(run: Path, stack: ExitStack, data: list[str]) -> Path:
    return run


def run_dir_is_a_file(run: Path, stack: ExitStack, data: list[str]) -> Path:
    (run.parent / "file").write_text("x")
    return run.parent / "file"


def run_dir_under_a_file(run: Path, stack: ExitStack, data: list[str]) -> Path:
    return run_dir_is_a_file(run, stack, data) / "run"


def checkpoints_is_a_file(run: Path, stack: ExitStack, data: list[str]) -> Path:
    (run.parent / "fresh").mkdir()
    (run.parent / "fresh" / "checkpoints").write_text("x")
    return run.parent / "fresh"


def held_by_another_trainer(run: Path, stack: ExitStack, data: list[str]) -> Path:
    stack.callback(trainer(run, data).close)  # the first trainer keeps the run dir until the command is done
    return run


def damage(*steps: int) -> Setup:
    def setup(run: Path, stack: ExitStack, data: list[str]) -> Path:
        for step in steps:
            flip_byte(ckpt(run, step))
        return run
    return setup


def interrupted_save(run: Path, stack: ExitStack, data: list[str]) -> Path:
    (ckpt(run, 4) / checkpoint.COMPLETE).unlink()  # the marker is written last: that save did not finish
    return run


def planted_pickle(run: Path, stack: ExitStack, data: list[str]) -> Path:
    plant_pickle(ckpt(run, 4), run.parent / "code-ran")
    return run


def empty_metadata(run: Path, stack: ExitStack, data: list[str]) -> Path:
    replant(ckpt(run, 4), b"")
    return run


STEP = "{run}/checkpoints/step_0000000"  # + the step
KEEP = "trainer.keep_checkpoints=9"  # runs that save: no rotation, so every old checkpoint must stay
# (setup, overrides, exit code, words: of the error line, or of stdout for exit 0 and 75)
RUN_DIR = [
    case("run dir is a file", run_dir_is_a_file, [], EXIT_BAD_INPUT, ["file is a file, not a directory"]),
    case("run dir under a file", run_dir_under_a_file, [], EXIT_BAD_INPUT,
         ["file/run", "is a file, not a directory"]),
    case("checkpoints is a file", checkpoints_is_a_file, [], EXIT_BAD_INPUT,
         ["fresh/checkpoints is a file", "move it away"]),
    case("fresh run in a used run dir", as_is, ["trainer.resume=false"], EXIT_BAD_INPUT,
         ["trainer.resume=false, but run dir", "holds checkpoints", "trainer.overwrite=true"]),
    case("second trainer on the run dir", held_by_another_trainer, [], EXIT_BAD_INPUT,
         [f"is in use by another trainer (pid {os.getpid()} on host"]),
    case("resume with another optimizer", as_is, ["optim=adamw"], EXIT_BAD_INPUT,
         ["cannot resume from", "with optim=adamw", "it was trained with optim=muonclip"]),
    case("resume with another model", as_is, ["model.d_model=48"], EXIT_BAD_INPUT,
         ["cannot resume from", "the model differs", "model.d_model: checkpoint 32 vs now 48"]),
    case("resume with another tokenizer", as_is, ["model.vocab_size=384", "data.tokenizer.vocab_size=320"],
         EXIT_BAD_INPUT, ["cannot resume from", "it was trained with tokenizer"]),
    case("resume with another micro-batch", as_is, ["trainer.max_steps=6", "trainer.micro_batch_size=2"],
         EXIT_BAD_INPUT, ["the loader state was saved reading 4 windows", "trainer.micro_batch_size=4"]),
    case("resume with another seq_len", as_is, ["trainer.max_steps=6", "trainer.seq_len=16"], EXIT_BAD_INPUT,
         ["the loader state was saved with seq_len=32", "resume with the same trainer.seq_len"]),
    case("damaged newest checkpoint", damage(4), ["trainer.max_steps=5", KEEP], EXIT_OK,
         [f"skipping damaged checkpoint {STEP}4: ", "checksum", f"resumed from {STEP}2 at step 2"]),
    case("interrupted newest save", interrupted_save, ["trainer.max_steps=5", KEEP], EXIT_OK,
         [f"skipping incomplete checkpoint {STEP}4", f"resumed from {STEP}2 at step 2"]),
    case("every checkpoint damaged", damage(2, 4), ["trainer.max_steps=5"], EXIT_FAILED,
         ["no intact checkpoint in", "step_00000002, step_00000004", "restore them"]),
    case("planted pickle", planted_pickle, ["trainer.max_steps=5"], EXIT_FAILED,
         [f"refusing to load checkpoint {STEP}4", "not written by kimi"]),
    case("planted empty metadata", empty_metadata, ["trainer.max_steps=5"], EXIT_FAILED,
         [f"refusing to load checkpoint {STEP}4"]),
    # lr=1e30 (weight decay off: lr*weight_decay >= 1 is refused) blows the weights up in step 5's update, so
    # step 6's loss is not finite and that step stops before its update. A forward hook cannot reach a
    # model built inside the command.
    case("loss becomes nan", as_is, ["trainer.max_steps=8", "optim.lr=1e30", "optim.weight_decay=0"],
         EXIT_FAILED, ["at step 6: stopping before the update", f"the last complete checkpoint is {STEP}4",
                       "lower optim.lr"]),
    case("stop_at_step", as_is, ["trainer.max_steps=8", "trainer.stop_at_step=5", KEEP], EXIT_STOPPED,
         [f"stopped at step 5 (trainer.stop_at_step=5); checkpoint {STEP}5",
          "To go on, run the same command with trainer.stop_at_step raised (or dropped"]),
    case("finished run rerun", as_is, ["trainer.max_steps=4"], EXIT_OK,
         ["run already complete at step 4 (trainer.max_steps=4)", "raise trainer.max_steps"]),
]


@pytest.mark.parametrize("setup,overrides,code,words", RUN_DIR)
def test_run_dir_fault(train_py, run, data, setup, overrides, code, words):
    with ExitStack() as stack:
        run_dir = setup(run, stack, data)
        before = intact_checkpoints(run)
        result = train_py(run_dir, *overrides)
    expect(result, code, tuple(w.format(run=run) for w in words))
    assert_checkpoints_intact(run, before)
    assert not (run.parent / "code-ran").exists()  # the planted pickle ran no code
    if run_dir.is_dir():
        assert (run_dir / "exit_code").read_text() == f"{code}\n"


def test_stopped_run_rerun_says_so_and_exits_0(train_py, run):
    """A job sliced by trainer.stop_at_step, rerun with the same command: nothing to train, and exit 0, not
    75 (launch/slurm.sbatch requeues on 75: the job would requeue itself forever); the message says to raise
    stop_at_step."""
    command = ["trainer.max_steps=8", "trainer.stop_at_step=5", KEEP]
    expect(train_py(run, *command), EXIT_STOPPED, ("stopped at step 5 (trainer.stop_at_step=5)",))
    before = intact_checkpoints(run)
    expect(train_py(run, *command), EXIT_OK,
           ("already at step 5, at or past trainer.stop_at_step=5", "Raise or remove trainer.stop_at_step"))
    assert intact_checkpoints(run) == before == {2: True, 4: True, 5: True}
    assert (run / "exit_code").read_text() == "0\n"


def test_rotation_keeps_the_intact_checkpoint_over_a_damaged_one(train_py, run):
    """Resuming past a damaged newest checkpoint and saving again must leave trainer.keep_checkpoints (2)
    intact checkpoints: otherwise one more damaged file leaves nothing to resume from."""
    flip_byte(ckpt(run, 4))
    expect(train_py(run, "trainer.max_steps=5"), EXIT_OK, (f"skipping damaged checkpoint {ckpt(run, 4)}",))
    intact = [step for step, ok in intact_checkpoints(run).items() if ok]
    assert intact == [2, 5], intact_checkpoints(run)


# ---- python -m kimi.generate ----------------------------------------------------------------------------
# "{run}" in the arguments is the directory the setup returns; every case reads or names a copy of the
# trained run, which must come out of it intact.

def missing(run: Path, stack: ExitStack, data: list[str]) -> Path:
    return run.parent / "nowhere"


def empty_dir(run: Path, stack: ExitStack, data: list[str]) -> Path:
    (run.parent / "empty").mkdir()
    return run.parent / "empty"


def only_interrupted_saves(run: Path, stack: ExitStack, data: list[str]) -> Path:
    for step in (2, 4):
        (ckpt(run, step) / checkpoint.COMPLETE).unlink()
    return run


def damaged_tokenizer(run: Path, stack: ExitStack, data: list[str]) -> Path:
    (run / "tokenizer.model").write_bytes(b"not a sentencepiece model")
    return run


def newest_named_directly(run: Path, stack: ExitStack, data: list[str]) -> Path:
    flip_byte(ckpt(run, 4))
    return ckpt(run, 4)


USAGE = ("usage: python -m kimi.generate",)  # printed before the error of a malformed command line
SKIPPING = ("[kimi] skipping ",)  # each checkpoint passed over, before the error
RUN = ["run={run}"]
# (setup, arguments, exit code, words: of the error line, or of stdout for exit 0; lines allowed before it)
GENERATE = [
    case("missing run dir", missing, RUN, EXIT_BAD_INPUT, ["run=", "nowhere: no such directory"], ()),
    case("run is a file", run_dir_is_a_file, RUN, EXIT_BAD_INPUT, ["file: not a directory"], ()),
    case("run dir without checkpoints", empty_dir, RUN, EXIT_BAD_INPUT,
         ["empty is neither a complete checkpoint nor a run dir with one"], ()),
    case("only interrupted saves", only_interrupted_saves, RUN, EXIT_BAD_INPUT,
         ["neither a complete checkpoint nor a run dir with one"], SKIPPING),
    case("checkpoints dir given", as_is, ["run={run}/checkpoints"], EXIT_BAD_INPUT,
         ["checkpoints is neither a complete checkpoint nor a run dir with one"], ()),
    case("no run", as_is, ["prompt=ROMEO:"], EXIT_BAD_INPUT, ["run= is missing"], USAGE),
    case("unknown key", as_is, [*RUN, "temprature=0.5"], EXIT_BAD_INPUT,
         ["unknown key 'temprature': did you mean temperature?"], USAGE),
    case("not key=value", as_is, [*RUN, "ROMEO:"], EXIT_BAD_INPUT, ["'ROMEO:' is not key=value"], USAGE),
    case("negative max_new_tokens", as_is, [*RUN, "max_new_tokens=-5"], EXIT_BAD_INPUT,
         ["max_new_tokens='-5' is invalid", ">= 1"], ()),
    case("negative temperature", as_is, [*RUN, "temperature=-1"], EXIT_BAD_INPUT,
         ["temperature='-1' is invalid", ">= 0"], ()),
    case("negative top_k", as_is, [*RUN, "top_k=-1"], EXIT_BAD_INPUT, ["top_k='-1' is invalid"], ()),
    case("empty prompt", as_is, [*RUN, "prompt="], EXIT_BAD_INPUT, ["prompt='' is invalid"], ()),
    pytest.param(as_is, [*RUN, "device=cuda"], EXIT_BAD_INPUT,
                 ["device='cuda' is invalid", "no cuda device", "device=cpu"], (), id="cuda without CUDA",
                 marks=NO_CUDA),
    case("unknown device", as_is, [*RUN, "device=tpu"], EXIT_BAD_INPUT, ["device='tpu' is invalid"], ()),
    case("damaged newest checkpoint", damage(4), [*RUN, "max_new_tokens=3"], EXIT_OK,
         ["[kimi] step 2 checkpoint"], ()),
    case("damaged checkpoint named", newest_named_directly, [*RUN, "max_new_tokens=3"], EXIT_FAILED,
         ["step_00000004 is damaged", "checksum"], ()),
    case("every checkpoint damaged", damage(2, 4), RUN, EXIT_FAILED,
         ["no intact checkpoint in", "step_00000002, step_00000004"], SKIPPING),
    case("planted pickle", planted_pickle, RUN, EXIT_FAILED,
         ["refusing to load checkpoint", "step_00000004", "not written by kimi"], ()),
    case("planted empty metadata", empty_metadata, RUN, EXIT_FAILED,
         ["refusing to load checkpoint", "step_00000004"], ()),
    case("damaged tokenizer copy", damaged_tokenizer, RUN, EXIT_BAD_INPUT,
         ["tokenizer.model is neither a sentencepiece model"], ()),
]


@pytest.mark.parametrize("setup,args,code,words,may_precede", GENERATE)
def test_generate_mistake(generate_py, run, data, setup, args, code, words, may_precede):
    with ExitStack() as stack:
        target = setup(run, stack, data)
    before = intact_checkpoints(run)
    expect(generate_py(*(a.format(run=target) for a in args)), code, tuple(words), may_precede)
    assert_checkpoints_intact(run, before)
    assert not (run.parent / "code-ran").exists()


# ---- real processes: no traceback anywhere, from interpreter start to exit -------------------------------

def real(*args: str) -> Result:
    """`python train.py ARGS...`, or `python -m kimi.generate ...` for args starting with -m."""
    cmd = [sys.executable, *args] if args[:1] == ("-m",) else [sys.executable, str(ROOT / "train.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    return Result(proc.returncode, proc.stdout, proc.stderr)


def test_real_process_bad_data(run, tmp_path):
    bad = tmp_path / "noise.txt"
    bad.write_bytes(bytes(range(256)) * 16)
    before = intact_checkpoints(run)
    result = real(*argv(run, [f"data.data_files=['{bad}']", f"data.cache_dir={tmp_path / 'cache'}"]))
    expect(result, EXIT_BAD_INPUT, (str(bad), "looks binary"))
    assert_checkpoints_intact(run, before)
    assert (run / "exit_code").read_text() == "2\n"


def test_real_process_nan(run, data):
    before = intact_checkpoints(run)
    result = real(*argv(run, data, "trainer.max_steps=8", "optim.lr=1e30", "optim.weight_decay=0"))
    expect(result, EXIT_FAILED,
           ("stopping before the update", f"the last complete checkpoint is {ckpt(run, 4)}"))
    assert_checkpoints_intact(run, before)
    assert (run / "exit_code").read_text() == "1\n"


def test_real_process_generate_refuses_a_planted_pickle(run):
    evidence = run.parent / "code-ran"
    plant_pickle(ckpt(run, 4), evidence)
    before = intact_checkpoints(run)
    expect(real("-m", "kimi.generate", f"run={run}", "max_new_tokens=3"), EXIT_FAILED,
           (f"refusing to load checkpoint {ckpt(run, 4)}",))
    assert not evidence.exists()
    assert_checkpoints_intact(run, before)
