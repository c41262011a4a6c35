"""Every command keeps the one exit-code table (docs/runs.md, "Exit codes"; kimi/errors.py): a missing path
and an unknown key are bad input (2), a forged checkpoint a failure (1), each one `error:` line and no
traceback. Each command runs in-process through its own entry function (sys.argv patched where it reads
it), so the cases cost no interpreter start; tests/config/test_bad_inputs.py runs real processes for
train.py."""

import dataclasses
import json
import logging
import pickle
import shutil
import sys

import pytest
import torch
from helpers import TINY_TRAINER, corpus_overrides, make_corpus, tiny_model_cfg

from kimi.errors import EXIT_BAD_INPUT, EXIT_FAILED

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def forged(tmp_path_factory):
    """A weights-only checkpoint whose intact-looking metadata is a pickled reference to a function (what
    a checkpoint never holds: loading it would run code), its manifest updated to match."""
    from kimi import checkpoint
    from kimi.model import KimiModel

    cfg = tiny_model_cfg(vocab_size=400)
    ckpt = tmp_path_factory.mktemp("forged") / "ckpt"
    torch.manual_seed(0)
    checkpoint.save_weights(ckpt, KimiModel(cfg).state_dict(), {"model": dataclasses.asdict(cfg)}, {})
    payload = pickle.dumps(print)
    (ckpt / ".metadata").write_bytes(payload)
    marker = json.loads((ckpt / checkpoint.COMPLETE).read_text())
    marker["files"][".metadata"] = [len(payload), checkpoint.manifest.crc32(ckpt / ".metadata")]
    (ckpt / checkpoint.COMPLETE).write_text(json.dumps(marker))
    return ckpt


def run_argv(monkeypatch, entry, argv):
    """entry() with sys.argv = argv: its exit code (returned, or given to sys.exit)."""
    monkeypatch.setattr(sys, "argv", argv)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        return entry() or 0
    except SystemExit as stop:
        return stop.code or 0
    finally:  # Hydra's job logging (train.py): a log file in the run dir
        for handler in set(root.handlers) - set(handlers):
            handler.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def cases(tmp, forged):
    """(entry point, how it is called, the table's exit code) per command and mistake."""
    from kimi import summary, train
    from kimi.convert import main as convert
    from kimi.data.prepare.__main__ import cli as prepare
    from kimi.eval.cli import main as evaluate
    from kimi.generate import main as generate

    missing = tmp / "missing"
    out = ["logging.wandb.mode=disabled", "trainer.sample_tokens=0"]
    return [
        ("train", train.cli, ["train.py", f"hydra.run.dir={tmp / 'r1'}", "data=files",
                              f"data.data_files=[{missing}/a.txt]", *out], EXIT_BAD_INPUT),
        ("train", train.cli, ["train.py", f"hydra.run.dir={tmp / 'r2'}", "trainer.nope=1"], EXIT_BAD_INPUT),
        ("train", train.cli, ["train.py", f"hydra.run.dir={tmp / 'r2'}", "optim.lr=${nope}"], EXIT_BAD_INPUT),
        ("summary", summary.cli, ["summary", "optim.lr=${nope}"], EXIT_BAD_INPUT),
        ("prepare", prepare, ["prepare", "data=files", f"data.data_files=[{missing}/a.txt]"], EXIT_BAD_INPUT),
        ("prepare", prepare, ["prepare", "data.nope=1"], EXIT_BAD_INPUT),
        ("prepare", prepare, ["prepare", "data.text_field=${data.nope}"], EXIT_BAD_INPUT),
        ("summary", summary.cli, ["summary", "model.nope=1"], EXIT_BAD_INPUT),
        ("generate", lambda: generate(sys.argv[1:]), ["g", f"run={missing}"], EXIT_BAD_INPUT),
        ("generate", lambda: generate(sys.argv[1:]), ["g", f"run={tmp}", "nope=1"], EXIT_BAD_INPUT),
        ("generate", lambda: generate(sys.argv[1:]), ["g", f"run={forged}"], EXIT_FAILED),
        ("eval", lambda: evaluate(sys.argv[1:]), ["e", f"run={missing}"], EXIT_BAD_INPUT),
        ("eval", lambda: evaluate(sys.argv[1:]), ["e", f"run={tmp}", "nope=1"], EXIT_BAD_INPUT),
        ("eval", lambda: evaluate(sys.argv[1:]), ["e", f"run={forged}", "limit=1"], EXIT_FAILED),
        ("to-hf", lambda: convert(sys.argv[1:]), ["c", "to-hf", f"run={missing}", f"out={tmp / 'o1'}"],
         EXIT_BAD_INPUT),
        ("to-hf", lambda: convert(sys.argv[1:]), ["c", "to-hf", f"run={tmp}", f"out={tmp / 'o2'}", "nope=1"],
         EXIT_BAD_INPUT),
        ("to-hf", lambda: convert(sys.argv[1:]), ["c", "to-hf", f"run={forged}", f"out={tmp / 'o3'}"],
         EXIT_FAILED),
        ("from-hf", lambda: convert(sys.argv[1:]), ["c", "from-hf", f"hf={missing}", f"run={tmp / 'r3'}"],
         EXIT_BAD_INPUT),
        ("from-hf", lambda: convert(sys.argv[1:]), ["c", "from-hf", f"hf={tmp}", f"run={tmp / 'r4'}",
                                                    "nope=1"], EXIT_BAD_INPUT),
    ]


def test_every_command_keeps_the_exit_code_table(monkeypatch, capsys, tmp_path, forged, tmp_path_factory):
    wrong = []
    for name, entry, argv, expected in cases(tmp_path, forged):
        capsys.readouterr()
        code = run_argv(monkeypatch, entry, argv)
        err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        errors = [line for line in err if line.startswith("error: ")]
        if code != expected or len(errors) != 1 or any("Traceback" in line for line in err):
            wrong.append((name, argv[1:], code, err[-3:]))
    assert not wrong, "\n".join(map(str, wrong))


def test_train_refuses_a_forged_checkpoint_to_start_from_as_a_failure(monkeypatch, capsys, tmp_path, forged,
                                                                        tmp_path_factory):
    from kimi import train

    data = corpus_overrides(tmp_path_factory)
    argv = ["train.py", f"hydra.run.dir={tmp_path / 'run'}", *data, *TINY_TRAINER,
            "model.vocab_size=400", f"trainer.init_from={forged}"]
    capsys.readouterr()
    assert run_argv(monkeypatch, train.cli, argv) == EXIT_FAILED
    err = capsys.readouterr().err  # the data's progress bars come before
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "refusing to load" in errors[0] and "Traceback" not in err, err
    shutil.rmtree(tmp_path / "run", ignore_errors=True)


def test_eval_with_more_few_shot_examples_than_the_task_has_is_one_line(tmp_path, capsys):
    from kimi import checkpoint
    from kimi.data.tokenizer import train_tokenizer
    from kimi.eval.cli import main as evaluate
    from kimi.model import KimiModel

    corpus = make_corpus(tmp_path / "corpus", docs=3)
    tokenizer = train_tokenizer([p.read_text() for p in sorted(corpus.glob("*.txt"))], 300,
                                tmp_path / "spm" / "tokenizer.model")
    cfg = tiny_model_cfg(vocab_size=tokenizer.vocab_size)
    run = tmp_path / "run"
    checkpoint.save_weights(run / "init", KimiModel(cfg).state_dict(), {"model": dataclasses.asdict(cfg)}, {})
    tokenizer.copy_to(run / "tokenizer.model")
    capsys.readouterr()
    assert evaluate([f"run={run}", "tasks=kimi_cloze", "limit=1", "num_fewshot=100000"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "num_fewshot=100000" in errors[0] and "Traceback" not in err, err
