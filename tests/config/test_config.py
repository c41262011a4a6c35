"""The Hydra config tree: presets compose, sizes are what their names say, bad values name their key."""

import os
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from kimi.config import Config, ConfigError, ModelConfig, mla_layer_indices, register_configs
from kimi.run.validation import validate
from kimi.model import KimiModel

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
register_configs()


def compose_cfg(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["trainer.run_dir=unused", *overrides])
    return OmegaConf.to_object(cfg)


@pytest.mark.parametrize("preset,low,high", [("tiny", 1e6, 3e6), ("small", 110e6, 140e6),
                                             ("1b", 0.9e9, 1.3e9), ("48b_dense", 45e9, 51e9)])
def test_presets_have_their_advertised_size(preset, low, high):
    cfg = compose_cfg(f"model={preset}")
    validate(cfg)
    m = cfg.model
    if m.vocab_size is None:  # 48b_dense sets Kimi Linear's 163840
        m.vocab_size = {"tiny": 2048}.get(preset, 32000)
    with torch.device("meta"):  # no memory, no init cost: only shapes (48B builds in ~1 s)
        n = KimiModel(m).num_params()
    assert low <= n <= high, f"{preset}: {n / 1e6:.1f}M"
    # 3:1 KDA:MLA; Kimi Linear 48B's 27 blocks also end on an MLA block (1-based 4, 8, ..., 24, 27)
    expected = [i for i in range(m.num_layers) if i % 4 == 3] + ([26] if preset == "48b_dense" else [])
    assert mla_layer_indices(m) == expected


def test_defaults_are_the_documented_ones():
    cfg = compose_cfg()
    assert (cfg.model.name, cfg.data.name, cfg.optim.name) == ("tiny", "shakespeare", "muonclip")
    assert cfg.model.residual == "attnres_block" and cfg.model.mla.qk_rope_head_dim == 0  # NoPE MLA
    assert cfg.logging.wandb.mode is None and cfg.logging.wandb.project is None  # wandb's variables, else:
    from kimi.run.wandb_run import wandb_mode

    assert "WANDB_MODE" in os.environ or wandb_mode(cfg.logging.wandb) == "offline"


def test_the_old_flat_model_keys_still_read_with_one_line(capsys):
    """model.kda_num_heads and the other keys that moved into sections (kimi/model/sections.py) still
    compose, on the command line and in a stored config.yaml, to the config the new keys give; one line names
    them; what is stored and what --help lists are the new keys alone."""
    from kimi.cli.conf_dir import compose as compose_overrides
    from kimi.cli.config_help import keys_help
    from kimi.config import config_dict, to_config
    from kimi.model.config import _ANNOUNCED
    from kimi.model.sections import ALIASES

    _ANNOUNCED.clear()
    run = ["trainer.run_dir=unused", "model=moe_tiny"]
    new = to_config(compose_overrides([*run, "model.kda.num_heads=2", "model.moe.num_experts=8"]))
    capsys.readouterr()
    old = to_config(compose_overrides([*run, "model.kda_num_heads=2", "model.moe_num_experts=8"]))
    err = capsys.readouterr().err
    assert old == new and new.model.kda.num_heads == 2 and new.model.moe.num_experts == 8
    assert err.count("\n") == 1 and "model.kda_num_heads -> model.kda.num_heads" in err, err
    stored = config_dict(new)
    assert not set(ALIASES) & set(stored["model"]) and stored["model"]["kda"]["num_heads"] == 2
    flat = {**{k: v for k, v in stored["model"].items() if not isinstance(v, dict)},
            **{old: stored["model"][new.split(".")[0]][new.split(".")[1]] for old, new in ALIASES.items()}}
    assert to_config({**stored, "model": flat}) == new  # a config.yaml written before the sections
    assert ModelConfig(kda_num_heads=3).kda.num_heads == 3 == ModelConfig(kda={"num_heads": 3}).kda.num_heads
    shown = keys_help(None, only=("model",))
    assert "model.kda.num_heads" in shown and "kda_num_heads" not in shown


def _typed_tree(value):
    """value with every leaf paired with its type and every dict's keys in order: equal only if both are."""
    if isinstance(value, dict):
        return [(k, _typed_tree(v)) for k, v in value.items()]
    if isinstance(value, list):
        return ["list", *map(_typed_tree, value)]
    return (type(value).__name__, value)


@pytest.mark.parametrize("overrides", [[f"{key}={p.stem}"] for group, key in [("model", "model"),
                                                                              ("experiment", "+experiment"),
                                                                              ("recipe", "recipe")]
                                       for p in sorted((ROOT / "conf" / group).glob("*.yaml"))])
def test_the_stored_config_is_omegaconfs_own(overrides):
    """config_dict walks the dataclasses itself (OmegaConf takes 50-170 ms a call, three calls a start): the
    same containers, leaf types and key order as OmegaConf's, for every preset, experiment and recipe, and
    for a config built in Python with a tuple where the schema has a list. to_config of a config composed
    against the schema skips merging the schema in again: the same Config."""
    import dataclasses

    from kimi.config import config_dict, to_config
    from kimi.cli.conf_dir import compose as compose_overrides
    from kimi.model.sections import ALIASES

    def omegaconfs(cfg):
        out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
        return {**out, "model": {k: v for k, v in out["model"].items() if k not in ALIASES}}

    composed = compose_overrides(["trainer.run_dir=unused", *overrides])
    cfg = to_config(composed)  # composed against the schema: not merged with it again
    assert cfg == OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), composed))
    assert _typed_tree(config_dict(cfg)) == _typed_tree(omegaconfs(cfg))
    def tagged(*tags):
        return dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, wandb=dataclasses.replace(
            cfg.logging.wandb, tags=tags)))

    assert _typed_tree(config_dict(tagged("a", "b"))) == _typed_tree(omegaconfs(tagged("a", "b")))
    assert config_dict(tagged("a", "b"))["logging"]["wandb"]["tags"] == ["a", "b"]
    # a string that still holds an interpolation is resolved, as OmegaConf resolves it
    seeded = config_dict(tagged("seed ${trainer.seed}"))
    assert seeded == omegaconfs(tagged("seed ${trainer.seed}"))
    assert seeded["logging"]["wandb"]["tags"] == [f"seed {cfg.trainer.seed}"]


def test_unknown_key_is_rejected_by_the_schema():
    with pytest.raises(Exception, match="kda_heads"):
        compose_cfg("model.kda_heads=8")


@pytest.mark.parametrize("field,value,key", [
    ("residual", "attnres_half", "model.residual"),
    ("mla.qk_rope_head_dim", 3, "model.mla.qk_rope_head_dim"),
    ("attnres.block_size", 0, "model.attnres.block_size"),
    ("mla_layers", [0, 9], "model.mla_layers"),
    ("kda.num_heads", 0, "model.kda.num_heads"),
])
def test_impossible_model_values_name_their_key(field, value, key):
    cfg = Config()
    *sections, leaf = field.split(".")
    node = cfg.model
    for section in sections:
        node = getattr(node, section)
    setattr(node, leaf, value)
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as err:
        validate(cfg)
    assert "invalid" in str(err.value)


def test_mla_pattern_helpers():
    assert mla_layer_indices(ModelConfig(num_layers=8, mla_every=4)) == [3, 7]
    assert mla_layer_indices(ModelConfig(num_layers=3, mla_every=0)) == []
    assert mla_layer_indices(ModelConfig(num_layers=3, mla_every=1)) == [0, 1, 2]
    assert mla_layer_indices(ModelConfig(num_layers=5, mla_layers=[4, 1])) == [1, 4]


@pytest.mark.parametrize("overrides,message", [
    (["parallel.dp_shard=2", "parallel.ep=2"], "parallel.ep=2 needs a mixture-of-experts model"),
    (["model=moe_tiny", "parallel.dp_shard=3", "parallel.ep=2"],
     "parallel.ep=2 does not divide parallel.dp_shard=3"),
    (["model=moe_tiny", "parallel.dp_shard=6", "parallel.ep=3"],
     "model.moe.num_experts=8 is not divisible by parallel.ep=3"),
    (["model=moe_tiny", "parallel.ep=0"], "parallel.ep"),
])
def test_expert_parallel_layouts_that_cannot_work_say_why(overrides, message):
    cfg = compose_cfg(*overrides)
    world = cfg.parallel.dp_replicate * cfg.parallel.dp_shard * cfg.parallel.tp * cfg.parallel.pp
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world=world)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.dp_shard=2", "parallel.compile=true"], "without parallel.compile=true: reset those"),
    (["parallel.dp_shard=2", "parallel.activation_checkpointing=full"],
     "parallel.activation_checkpointing=full"),
    (["parallel.dp_replicate=2"], "without parallel.dp_replicate=2"),
    (["parallel.deepspeed.reduce_bucket_size=0"], "parallel.deepspeed.reduce_bucket_size=0 is invalid"),
])
def test_deepspeed_layouts_that_cannot_work_say_why(overrides, message):
    cfg = compose_cfg("parallel.engine=deepspeed", *overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg, world=cfg.parallel.dp_replicate * cfg.parallel.dp_shard)


def test_deepspeed_engine_without_deepspeed_installed_says_how(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "deepspeed" else real(name, *a))
    with pytest.raises(ConfigError,
                       match=r"needs the deepspeed package, which is not installed: pip install"):
        validate(compose_cfg("parallel.engine=deepspeed"), world=1)
