"""A to-hf export a user can publish (docs/huggingface.md, "What an export holds for publishing"):
generation_config.json with the run's token ids and kimi.generate's sampling defaults, a model card README.md
saying what was trained, on what data, for how long, with which losses and scores and how to load it, and
every file readable by others (0644 files, 0755 folders) whatever the umask."""

import dataclasses
import json
import os
import stat

import pytest
import torch
from helpers import corpus_overrides, tiny_model_cfg, train_run

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-step tiny run (Attention Residuals: exported with its own code), validated and saved at step 2
    and 4, and a kimi.eval report its user wrote into the run dir."""
    root = tmp_path_factory.mktemp("card")
    data = corpus_overrides(tmp_path_factory)
    train_run(root / "run", data, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.checkpoint_every=2")
    report = {"run": str(root / "run"), "step": 4, "tasks": ["kimi_cloze"], "limit": 5,
              "scores": {"kimi_cloze": {"acc": 0.4, "acc_stderr": 0.2}}}
    (root / "run" / "scores.json").write_text(json.dumps(report))
    return root / "run"


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _export(run, out, *extra):
    from kimi.convert import main

    old = os.umask(0o077)  # a private umask: the export must still be readable by others
    try:
        assert main(["to-hf", f"run={run}", f"out={out}", *extra]) == 0
    finally:
        os.umask(old)
    return out


def test_the_export_is_published_with_normal_modes(run, tmp_path):
    out = _export(run, tmp_path / "hf")
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(os.stat(p).st_mode)
             for p in [out, *out.rglob("*")]}
    assert modes["hf"] == 0o755 and modes["hf/README.md"] == modes["hf/generation_config.json"] == 0o644
    assert {m for name, m in modes.items() if name != "hf"} == {0o644}, modes


def test_generation_config_is_the_runs_tokens_and_kimi_generates_defaults(run, tmp_path):
    from transformers import GenerationConfig

    from kimi.data import Tokenizer
    from kimi.generate import GenerateArgs
    from kimi.interop.trust import code_changes

    out = _export(run, tmp_path / "hf")
    config = GenerationConfig.from_pretrained(out)
    tokenizer, defaults = Tokenizer(run / "tokenizer.model"), GenerateArgs(run="")
    assert (config.bos_token_id, config.eos_token_id) == (tokenizer.bos_id, tokenizer.eos_id)
    assert config.pad_token_id == tokenizer.eos_id  # no pad piece: finished rows are filled with EOS
    assert config.do_sample and config.temperature == defaults.temperature and config.top_k == defaults.top_k
    # no length of its own: a caller's max_length (lm-eval's) must not be overridden
    assert "max_new_tokens" not in json.loads((out / "generation_config.json").read_text())
    # neither file is code: the export's own-code record still matches
    assert code_changes(out, json.loads((out / "config.json").read_text())) == []


def test_the_card_says_what_was_trained_and_how_to_load_it(run, tmp_path):
    from kimi.generate import load_from_checkpoint

    card = (_export(run, tmp_path / "hf") / "README.md").read_text()
    model, _, step = load_from_checkpoint(run)
    last = _records(run)[-1]
    assert step == last["step"] == 4
    assert "| preset | model=tiny |" in card and f"| parameters | {model.num_params():,} |" in card
    assert "data.source=files: " in card and "doc00.txt" in card and "and 21 more files" in card
    assert "| steps | 4 of trainer.max_steps=4 |" in card and f"| tokens | {last['tokens']:,} " in card
    assert f"| last training loss | {last['loss']:.4f} (step 4) |" in card
    assert f"| last validation loss | {last['val_loss']:.4f} (step 4) |" in card
    assert "| kimi_cloze | acc | 0.4 | 4 | scores.json |" in card
    assert "from_pretrained(where, trust_remote_code=True)" in card  # the export carries its code


def test_a_checkpoint_named_directly_is_described_at_its_own_step(run, tmp_path):
    """Losses and scores after the exported checkpoint belong to later weights: the card leaves them out."""
    card = (_export(run / "checkpoints" / "step_00000002", tmp_path / "hf") / "README.md").read_text()
    at_2 = next(r for r in _records(run) if r.get("step") == 2 and "loss" in r)
    assert f"| last training loss | {at_2['loss']:.4f} (step 2) |" in card
    assert f"| last validation loss | {at_2['val_loss']:.4f} (step 2) |" in card
    assert "## Evaluation" not in card  # the report is of step 4


def test_a_native_export_needs_no_remote_code_to_load(tmp_path):
    """Weights from-hf wrote (no training, no metrics): the card says so, and loads without the key."""
    from kimi import checkpoint
    from kimi.data.tokenizer import train_tokenizer
    from kimi.model import KimiModel

    tokenizer = train_tokenizer(["The king loves the crown. " * 40, "My lord fears the night. " * 40], 300,
                                tmp_path / "spm" / "tokenizer.model")
    cfg = tiny_model_cfg(vocab_size=tokenizer.vocab_size, residual="standard", kda=dict(gate_bias=False),
                         mla=dict(rotary=False))
    torch.manual_seed(0)
    checkpoint.save_weights(tmp_path / "run" / "init", KimiModel(cfg).state_dict(),
                            {"model": dataclasses.asdict(cfg)}, {})
    tokenizer.copy_to(tmp_path / "run" / "tokenizer.model")
    card = (_export(tmp_path / "run", tmp_path / "native") / "README.md").read_text()
    assert not (tmp_path / "native" / "modeling_kimi.py").exists()
    assert "from_pretrained(where)" in card and "trust_remote_code" not in card
    assert "none recorded" in card and "| steps | 0 |" in card
