"""The root of the structured configuration: the ``Config`` that assembles every section, its registration in
Hydra's ConfigStore, the typed config from a dict (a run's stored config.yaml, a checkpoint's) and back, and
the message for a key the schema lacks.

Each section's schema lives beside the code that owns it, torch-free: kimi/model/config.py (model.*),
kimi/data/config.py (data.*), kimi/optim/config.py (optim.*), kimi/parallel/config.py (parallel.*),
kimi/precision/config.py (precision.*); the run's own sections (trainer.*, logging.*), the vocabulary the
sections and their rules are written in (one_of, check, require, ...) and the pipeline's counts lie on the
config's ground floor, kimi/schema/, because floors below this module read them. Those modules import
nothing of this one; it re-exports their names, so ``from kimi.config import X`` works as it always has.

The root schema is stored as ``base_config``; ``conf/config.yaml`` lists it first in its defaults, so every
YAML preset and command-line override is merged into typed nodes and a misspelt key fails with Hydra's
"Key 'x' not in 'TrainerConfig'" before any work. Values that type-check but cannot work are caught by the one
validation pass, :func:`kimi.run.validation.validate`, which ``Trainer.__init__`` calls first (before any
data is downloaded or tokenised). Each section's own rules live with the code that owns it
(kimi/model/rules.py, kimi/data/rules.py, kimi/optim/rules.py, kimi/parallel/rules.py,
kimi/precision/rules.py, kimi/run/validation.py for the run's trainer and logging sections); the rules across
sections are kimi/parallel/rules.py's (sequence, context, expert and pipeline parallelism against the model
and the batch) and kimi/model/config.py's (the vocabulary against the tokenizer). Each failure is a one-line
:class:`ConfigError` that names the key(s) and how to fix it.

This module imports no torch (train.py refuses a misspelt key before the seconds of importing it): the
packages whose sections it assembles import their heavy modules only when first asked for. The registries
(data sources, optimizers, engines, precisions) fill the sections' tables of names when they are imported.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, Dict, List, Union

from omegaconf import DictConfig, OmegaConf

# The sections and the rules' vocabulary, re-exported: kimi.config.X as ever for the layers above (the
# trainer, kimi/run, the commands, tests and bench); the floors below import them from their owners.
from kimi.data.config import (DATA_FORMATS, DATA_SOURCES, PREPARE_EXECUTORS, DataConfig,  # noqa: F401
                              DataSourceConfig, TokenizerConfig)
from kimi.errors import ConfigError  # noqa: F401 (kimi.config.ConfigError, as ever)
from kimi.model.config import (ATTENTION_BACKENDS, ATTNRES_BACKENDS, KDA_BACKENDS, MLP_ACTIVATIONS,  # noqa: F401
                               MOE_BALANCE, MOE_IMPLS, RESIDUAL_MODES, SIZE_BOUNDS, ModelConfig,
                               announce_aliases, check_sizes, check_vocab, mixer_pattern, mla_layer_indices,
                               moe_layer_indices, resolve_aliases, resolve_vocab, schema_fields)
from kimi.model.sections import ALIASES
from kimi.optim.config import ADJUST_LR_FNS, NS_DTYPES, OPTIMIZERS, SCHEDULES, OptimConfig  # noqa: F401
from kimi.parallel.config import (AC_MODES, ENGINES, FAULT_TOLERANCE, DeepSpeedConfig,  # noqa: F401
                                  ParallelConfig, TorchftConfig)
from kimi.parallel.rules import (check_context_parallel, check_expert_parallel, check_pipeline,  # noqa: F401
                                 check_sequence_parallel, check_stage_split)
from kimi.precision.config import FP8_RECIPES, QAT_MODES, Fp8Config, PrecisionConfig  # noqa: F401
from kimi.schema.stages import StageConfig
from kimi.schema.pipeline import (PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, pipeline_microbatches,  # noqa: F401
                                  pipeline_stages, stages_per_rank)
from kimi.schema.run import (DEVICES, PRECISIONS, WANDB_MODES, LoggingConfig, ProfileConfig,  # noqa: F401
                             TrainerConfig, WandbConfig)
from kimi.schema.vocabulary import (check, check_choices, check_finite, check_positive, one_of,  # noqa: F401
                                    registered, require)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    # The run's stages, in order (kimi/run/stages.py, docs/stages.md); empty: one stage, this config
    stages: List[StageConfig] = field(default_factory=list)


def register_configs() -> None:
    """Store the schema as Hydra's base_config, once per process: each store builds the whole structured
    config again (0.1-0.2 s), and every command and composing test asks for it."""
    from hydra.core.config_store import ConfigStore

    cs = ConfigStore.instance()
    if "base_config.yaml" not in cs.repo:
        cs.store(name="base_config", node=Config)


# ---- keys the schema lacks ---------------------------------------------------------------------------------
def _schema_keys(schema: type, prefix: str = "") -> List[str]:
    """Every dotted key of the dataclass `schema`, its sections included (model, data.tokenizer, ...)."""
    keys = []
    for f in schema_fields(schema):
        key = f"{prefix}{f.name}"
        keys.append(key)
        default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        if is_dataclass(default):
            keys += _schema_keys(type(default), f"{key}.")
    return keys


def _closest_key(key: str, schema: type) -> str:
    """`: did you mean <key>?` for the known key whose last part is closest (in the same section first, then
    in any), else where the keys are listed. Whole dotted keys would match on their shared section alone."""
    section, _, leaf = key.rpartition(".")
    siblings = difflib.get_close_matches(leaf, [f.name for f in schema_fields(schema)], n=1)
    if siblings:
        return f": did you mean {section + '.' if section else ''}{siblings[0]}?"
    by_leaf: Dict[str, str] = {}
    for known in _schema_keys(Config):
        by_leaf.setdefault(known.rpartition(".")[2], known)
    anywhere = difflib.get_close_matches(leaf, list(by_leaf), n=1)
    if anywhere:
        return f": did you mean {by_leaf[anywhere[0]]}?"
    if schema is Config:
        return f" (the sections are {', '.join(f.name for f in fields(Config))})"
    return f" (the keys of {section} are the fields of {schema.__name__} in {_source_file(schema)})"


def _source_file(schema: type) -> str:
    """Where a section's dataclass is written, relative to the repository (kimi/model/config.py, ...)."""
    module = schema.__module__.replace(".", "/")
    return f"{module}.py"


def unknown_key(key: str) -> str:
    """The message for a dotted key the schema lacks, with the closest known key."""
    schema, parts = Config, key.split(".")
    for part in parts[:-1]:
        f = {f.name: f for f in fields(schema)}.get(part)
        default = f.default_factory() if f is not None and callable(f.default_factory) else None
        if not is_dataclass(default):
            break
        schema = type(default)
    return f"{key} is not a config key{_closest_key(key, schema)}"


def _check_known_keys(given: Dict[str, Any], schema: type, prefix: str = "") -> None:
    """Refuse a key the schema lacks. Hydra's `+key=value` adds keys even to a structured config, and
    OmegaConf.to_object then drops them without a word: `+trainer.max_stepz=3` would train 600 steps."""
    names = {f.name: f for f in fields(schema)}
    for name, value in given.items():
        key = f"{prefix}{name}"
        if name not in names:
            raise ConfigError(f"{key} is not a config key{_closest_key(key, schema)}")
        default = names[name].default_factory() if callable(names[name].default_factory) else None
        if is_dataclass(default) and isinstance(value, dict):
            _check_known_keys(value, type(default), f"{key}.")


# ---- the typed config from a dict and back -----------------------------------------------------------------
def to_config(cfg: Union[Config, DictConfig, Dict[str, Any]]) -> Config:
    """A typed :class:`Config` from a Hydra DictConfig, a plain dict, or a Config (returned as is).
    A key the schema lacks is a ConfigError naming it (and the closest key, if one is close)."""
    if isinstance(cfg, Config):
        return cfg
    # unresolved: interpolations such as ${hydra:runtime.output_dir} only resolve inside a Hydra job
    given = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else cfg
    _check_known_keys(given, Config)
    if isinstance(cfg, DictConfig) and OmegaConf.get_type(cfg) is Config:
        # composed against the schema already (conf/config.yaml's base_config): merging it in again costs
        # 70-140 ms a start and changes nothing; ModelConfig moves the old flat keys itself
        announce_aliases([old for old in ALIASES if given["model"].get(old) is not None])
        return OmegaConf.to_object(cfg)
    merged = OmegaConf.merge(OmegaConf.structured(Config), cfg)
    announce_aliases(resolve_aliases(merged.model))  # the old flat keys, moved to their sections
    return OmegaConf.to_object(merged)


def config_dict(cfg: Config) -> Dict[str, Any]:
    """The resolved config as plain containers (for checkpoints, wandb and comparisons), without the model
    section's old flat keys (null once resolved)."""
    try:
        out = _plain(cfg)
    except _Unresolved:
        out = OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
    for old in ALIASES:
        out["model"].pop(old, None)
    return out


class _Unresolved(Exception):
    pass


def _plain(value: Any) -> Any:
    """OmegaConf.to_container(OmegaConf.structured(value), resolve=True), the same containers in the same key
    order, by walking the dataclasses: OmegaConf takes 50-170 ms for a Config, and every start of a run asks
    for it three times (the checkpoint, the run's config file, wandb). A string still holding an
    interpolation raises _Unresolved (OmegaConf resolves it)."""
    if is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, str) and "${" in value:
        raise _Unresolved
    return value
