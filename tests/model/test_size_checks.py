"""Sizes are checked before anything is allocated (kimi/model/footprint.py, kimi.config.SIZE_BOUNDS): a
typo in a size is one line with the config-error exit code in seconds, not an allocator's traceback or
minutes of building; so is a model too large for the device; the estimate is the model's exact count."""

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import torch
from helpers import ROOT, corpus_overrides, run_cfg, tiny_model_cfg

from kimi.errors import EXIT_BAD_INPUT, EXIT_FAILED
from kimi.config import SIZE_BOUNDS, ConfigError
from kimi.model import KimiModel
from kimi.model.footprint import SKIP_ENV, check_fits, estimate_params

pytestmark = pytest.mark.unit

def test_every_preset_is_within_the_bounds_and_its_estimate_is_its_count():
    from helpers import preset

    from kimi.config import check_sizes

    names = sorted(p.stem for p in (ROOT / "conf" / "model").glob("*.yaml"))
    assert {"tiny", "moe_tiny", "k3_tiny", "kimi_k3"} <= set(names)
    for name in names:
        cfg = preset(name, 163840)  # with the largest released vocabulary
        check_sizes(cfg)
        two_mtp = dataclasses.replace(cfg.mtp, layers=2)
        variants = [cfg] + ([dataclasses.replace(cfg, mtp=two_mtp, tie_embeddings=True),
                             dataclasses.replace(cfg, residual="standard")] if name == "moe_tiny" else [])
        for m in variants:
            with torch.device("meta"):
                assert estimate_params(m) == KimiModel(m).num_params(), (name, m)


def _keyword(key: str, value) -> dict:
    """tiny_model_cfg's keyword for model.<key>: a section's key (mla.num_heads) as that section's dict."""
    section, _, name = key.rpartition(".")
    return {section: {name: value}} if section else {key: value}


@pytest.mark.parametrize("key", ["d_model", "num_layers", "vocab_size", "mla.num_heads", "moe.num_experts",
                                 "mlp.hidden", "kda.head_dim"])
def test_a_size_past_its_bound_is_one_line_naming_the_key_and_the_released_model(key):
    from kimi.model.rules import validate_model

    bound = SIZE_BOUNDS[key][0]
    validate_model(tiny_model_cfg(vocab_size=400))  # the rest of the config is fine
    with pytest.raises(ConfigError) as e:
        validate_model(tiny_model_cfg(**{"vocab_size": 400, **_keyword(key, bound + 1)}))
    message = str(e.value)
    assert "\n" not in message and f"model.{key}={bound + 1}" in message and "Kimi" in message


def test_a_model_too_large_for_the_device_is_refused_with_its_estimate(monkeypatch):
    huge = tiny_model_cfg(vocab_size=2**21, d_model=65536, num_layers=1024, mla_every=0)
    start = time.perf_counter()
    with pytest.raises(ConfigError) as e:
        check_fits(huge, 4, "cpu", "fp32 weights", "a machine with more memory")
    assert time.perf_counter() - start < 10  # arithmetic, not a build of 1024 blocks
    params = estimate_params(huge)
    message = str(e.value)
    assert "\n" not in message and f"{params:,} parameters" in message and SKIP_ENV in message
    assert check_fits(huge, 4, "cpu", "", "", skip=True) == 4 * params  # the switch lets it through
    monkeypatch.setenv(SKIP_ENV, "1")
    assert check_fits(huge, 4, "cpu", "", "", shards=8) == 4 * params // 8
    monkeypatch.delenv(SKIP_ENV)
    small = tiny_model_cfg(vocab_size=400)
    assert check_fits(small, 16, "cpu", "", "") == 16 * estimate_params(small)


def test_the_trainer_refuses_before_it_touches_the_run_dir(tmp_path_factory, tmp_path):
    from kimi.trainer import Trainer

    data = corpus_overrides(tmp_path_factory)
    wide = ["model.d_model=65536", "model.num_layers=512", "model.mlp.hidden=1048576"]
    with pytest.raises(ConfigError, match="trainer.skip_size_check=true") as e:
        Trainer(run_cfg(tmp_path / "run", data, *wide))
    assert "fp32 weights, gradients and optimizer state" in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing written, no data prepared


@pytest.mark.slow
def test_train_py_refuses_a_size_typo_in_seconds(tmp_path):
    """The config-error exit code and one line, where a million layers took minutes of building and
    d_model=1048576 ended in the allocator's traceback."""
    for override in ("model.num_layers=1000000", "model.d_model=1048576"):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "train.py", override, f"hydra.run.dir={tmp_path / 'run'}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        took = time.perf_counter() - start
        err = done.stderr.strip().splitlines()
        assert done.returncode == EXIT_BAD_INPUT and len(err) == 1, (override, done.stderr[-2000:])
        assert err[0].startswith(f"error: {override} is invalid")
        assert took < 60, took  # seconds of start-up on a loaded machine, not minutes of building


def _hf_folder(path, **changes):
    from kimi.interop.hf import release_config

    path.mkdir()
    expressible = tiny_model_cfg(vocab_size=400, residual="standard", kda=dict(gate_bias=False))
    config = {**release_config(expressible), **changes}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_from_hf_refuses_a_huge_config_json_before_reading_weights(tmp_path, capsys):
    from kimi.convert import main

    typo = _hf_folder(tmp_path / "typo", hidden_size=1048576)
    assert main(["from-hf", f"hf={typo}", f"run={tmp_path / 'run'}"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model.d_model=1048576 is invalid" in err[0] and "config.json" in err[0], err
    wide = _hf_folder(tmp_path / "wide", hidden_size=65536, vocab_size=2**21)
    assert main(["from-hf", f"hf={wide}", f"run={tmp_path / 'run'}"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit" in err[0], err
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_whose_config_has_impossible_sizes_is_refused_as_damaged(tmp_path, capsys):
    from kimi import checkpoint
    from kimi.generate import main

    cfg = tiny_model_cfg(vocab_size=400)
    forged = tmp_path / "forged"  # intact files whose config says a million layers: not what was saved
    config = {**dataclasses.asdict(cfg), "num_layers": 1000000}
    checkpoint.save_weights(forged, KimiModel(cfg).state_dict(), {"model": config}, {})
    start = time.perf_counter()
    assert main([f"run={forged}", "max_new_tokens=2"]) == EXIT_FAILED
    assert time.perf_counter() - start < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0] and "model.num_layers=1000000" in err[0], err
