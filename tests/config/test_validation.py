"""One validation pass (kimi.run.validation.validate) catches every impossible config before any work: per-key
values and rules across keys (parallel layout, tensor-parallel divisibility, pipeline stages and
micro-batches), each as a one-line ConfigError naming the key."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from kimi.config import (AC_MODES, ENGINES, PP_SCHEDULES, SINGLE_STAGE_SCHEDULES, Config, ConfigError,
                         pipeline_microbatches, pipeline_stages, register_configs, to_config)
from kimi.run.validation import validate

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
register_configs()


@functools.lru_cache(maxsize=None)
def _presets(groups: tuple[str, ...]) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["trainer.run_dir=unused", *groups])


def compose_cfg(*overrides: str) -> Config:
    """The config Hydra composes from conf/ for these overrides. Hydra composes each combination of preset
    groups (model=small, data=files, ...) once; the key=value overrides are then merged onto the typed result,
    as Hydra applies them, which keeps a hundred configs fast (a full composition takes ~70 ms)."""
    groups = tuple(o for o in overrides if "." not in o.split("=", 1)[0])
    keys = [o for o in overrides if "." in o.split("=", 1)[0]]
    return OmegaConf.to_object(OmegaConf.merge(_presets(groups), OmegaConf.from_dotlist(keys)))


PP2 = ["parallel.pp=2"]
FT = ["parallel.fault_tolerance=torchft"]
# (overrides, world, key the message must name); the default model is `tiny`: 4 blocks, 2 KDA and 2 MLA heads,
# mlp.hidden 384, vocab_size null (padded to a multiple of 64); micro_batch_size 16, seq_len 128.
IMPOSSIBLE = [
    # tensor parallelism: every split dimension divides by tp
    (["model.kda.num_heads=3", "parallel.tp=2"], 2, "model.kda.num_heads"),
    (["model.mla.num_heads=3", "parallel.tp=2"], 2, "model.mla.num_heads"),
    (["model.mlp.hidden=383", "parallel.tp=2"], 2, "model.mlp.hidden"),
    (["model.vocab_size=2049", "parallel.tp=2"], 2, "model.vocab_size"),
    (["model.pad_vocab_multiple=3", "parallel.tp=2"], 2, "model.pad_vocab_multiple"),
    (["model.kda.num_heads=4", "model.mla.num_heads=4", "model.pad_vocab_multiple=2", "parallel.tp=4"], 4,
     "model.pad_vocab_multiple"),
    # sequence parallelism
    (["parallel.tp=2", "parallel.sequence_parallel=true", "trainer.seq_len=127"], 2, "trainer.seq_len"),
    (["parallel.dp_shard=2", "parallel.sequence_parallel=true"], 2, "parallel.sequence_parallel"),
    # context parallelism: equal shards, each longer than the conv halo; what it does not take yet
    (["parallel.cp=3"], 3, "trainer.seq_len"),
    (["parallel.cp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "trainer.seq_len=130"], 4,
     "parallel.cp*tp"),
    (["parallel.cp=64", "trainer.seq_len=128"], 64, "model.conv_size"),
    (["parallel.cp=2", "model=moe_tiny", "model.moe.aux_loss_coef=0.01"], 2, "model.moe.aux_loss_coef"),
    (["parallel.cp=2", "parallel.compile=true"], 2, "parallel.compile"),
    (["parallel.cp=2", "parallel.engine=deepspeed"], 2, "parallel.cp=2"),
    (["parallel.cp=0"], 1, "parallel.cp"),
    # degrees vs processes
    (["parallel.cp=2"], 1, "parallel.dp_replicate*dp_shard*cp*tp*pp"),
    (["parallel.dp_shard=3"], 2, "parallel.dp_replicate*dp_shard*cp*tp*pp"),
    (["parallel.tp=2"], 1, "parallel.dp_replicate*dp_shard*cp*tp*pp"),
    (["parallel.dp_replicate=2", "parallel.dp_shard=2"], 8, "parallel.dp_replicate*dp_shard*cp*tp*pp"),
    # pipeline: blocks vs stages (plain and with virtual stages)
    ([*PP2, "model.num_layers=1", "model.mla_every=0"], 2, "parallel.pp"),
    ([*PP2, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=3"], 2,
     "parallel.pp_virtual_stages"),
    ([*PP2, "parallel.pp_schedule=zero_bubble", "parallel.pp_virtual_stages=4"], 2,
     "parallel.pp_virtual_stages"),
    # pp_split: wrong length, not rising, out of range, without a pipeline
    ([*PP2, "parallel.pp_split=[1,2]"], 2, "parallel.pp_split"),
    (["parallel.pp=3", "parallel.pp_split=[2,1]", "trainer.micro_batch_size=3"], 3, "parallel.pp_split"),
    ([*PP2, "parallel.pp_split=[4]"], 2, "parallel.pp_split"),
    ([*PP2, "parallel.pp_split=[0]"], 2, "parallel.pp_split"),
    ([*PP2, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_split=[2]"], 2, "parallel.pp_split"),
    (["parallel.pp_split=[2]"], 1, "parallel.pp_split"),
    # micro-batches through the pipeline
    ([*PP2, "parallel.pp_microbatches=3"], 2, "trainer.micro_batch_size"),
    (["parallel.pp=4", "parallel.pp_microbatches=2"], 4, "parallel.pp_microbatches"),
    ([*PP2, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_microbatches=5",
      "trainer.micro_batch_size=20"], 2, "parallel.pp_microbatches"),
    ([*PP2, "trainer.grad_accum_steps=2"], 2, "trainer.grad_accum_steps"),
    # a value outside its fixed set, for every such key
    (["model.residual=attnres_half"], 1, "model.residual"),
    (["model.kda.backend=cuda"], 1, "model.kda.backend"),
    (["model.attention.backend=flash"], 1, "model.attention.backend"),
    (["model.kda.backend=fla", "trainer.device=cpu"], 1, "model.kda.backend=fla"),
    (["model.attnres.backend=fused"], 1, "model.attnres.backend"),
    (["model.attnres.backend=fla", "trainer.device=cpu"], 1, "model.attnres.backend=fla"),
    (["optim.name=sgd"], 1, "optim.name"),
    (["optim.schedule=linear"], 1, "optim.schedule"),
    (["optim.ns_dtype=fp16"], 1, "optim.ns_dtype"),
    (["optim.adjust_lr_fn=spectral"], 1, "optim.adjust_lr_fn"),
    (["trainer.precision=fp16"], 1, "trainer.precision"),
    (["trainer.device=tpu"], 1, "trainer.device"),
    (["logging.wandb.mode=offlien"], 1, "logging.wandb.mode"),
    (["data.source=s3"], 1, "data.source"),
    (["data.format=csv"], 1, "data.format"),
    (["parallel.pp_schedule=dualpipe"], 1, "parallel.pp_schedule"),
    (["parallel.activation_checkpointing=some"], 1, "parallel.activation_checkpointing"),
    (["parallel.engine=megatron"], 1, "parallel.engine"),
    (["parallel.engine=deepspeed", "parallel.deepspeed.zero_stage=0"], 1, "parallel.deepspeed.zero_stage"),
    # fault tolerance across replica groups (torchft): its knobs, and what it does not take
    (["parallel.fault_tolerance=raft"], 1, "parallel.fault_tolerance"),
    ([*FT, "parallel.torchft.replica_group=2"], 1, "parallel.torchft.replica_group"),
    ([*FT, "parallel.torchft.min_replicas=3"], 1, "parallel.torchft.min_replicas"),
    ([*FT, "parallel.torchft.quorum_timeout_s=0"], 1, "parallel.torchft.quorum_timeout_s"),
    ([*FT, "parallel.engine=deepspeed"], 1, "parallel.engine=deepspeed"),
    ([*FT, *PP2], 2, "parallel.pp=2"),
    ([*FT, "parallel.dp_replicate=2"], 2, "parallel.dp_replicate=2"),
    ([*FT, "model=moe_tiny"], 1, "model.moe.num_experts"),
    ([*FT, "data.source=hf", "data.path=/data/d", "data.streaming=true"], 1,
     "data.streaming=true with parallel"),
    (["data.streaming=true"], 1, "only data.source=hf or files can be streamed"),
    # negative or zero sizes
    (["model.d_model=0"], 1, "model.d_model"),
    (["model.vocab_size=0"], 1, "model.vocab_size"),
    (["trainer.micro_batch_size=0"], 1, "trainer.micro_batch_size"),
    (["trainer.seq_len=-1"], 1, "trainer.seq_len"),
    (["parallel.tp=0"], 1, "parallel.tp"),
    (["parallel.pp_microbatches=-1"], 1, "parallel.pp_microbatches"),
    ([*PP2, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual_stages=0"], 2,
     "parallel.pp_virtual_stages"),
    (["optim.qk_clip_tau=-1"], 1, "optim.qk_clip_tau"),
    (["trainer.peak_flops=0"], 1, "trainer.peak_flops"),
    # model layout
    (["model.mla_layers=[4]"], 1, "model.mla_layers"),
    (["model.mla_layers=[1,1]"], 1, "model.mla_layers"),
    (["model.kda.backend=triton", "model.kda.head_dim=512"], 1, "model.kda.head_dim"),
    # data
    (["data.val_fraction=1.0"], 1, "data.val_fraction"),
    (["data.val_fraction=-0.1"], 1, "data.val_fraction"),
    (["data=files"], 1, "data.data_files"),
    (["data.val_split=validation"], 1, "data.val_split"),
    (["data=tinystories", "data.path=null"], 1, "data.path"),
    (["model.vocab_size=1000"], 1, "model.vocab_size"),  # the trained tokenizer has 2048 tokens
    # model numbers outside a sane range
    (["model.init_std=1e6"], 1, "model.init_std"),  # saturates everything: no gradient to train on
    (["model.init_std=0"], 1, "model.init_std"),
    (["model.init_std=nan"], 1, "model.init_std"),
    (["model.norm_eps=0"], 1, "model.norm_eps"),
    (["model.norm_eps=1"], 1, "model.norm_eps"),
    (["model.rope_theta=0"], 1, "model.rope_theta"),
    (["model.rope_theta=1"], 1, "model.rope_theta"),
    (["model.rope_theta=inf"], 1, "model.rope_theta"),
    (["model.conv_size=0"], 1, "model.conv_size"),
    (["model.conv_size=33", "trainer.seq_len=32"], 1, "model.conv_size=33 is longer than trainer.seq_len=32"),
    (["model.mla.q_lora_rank=-1"], 1, "model.mla.q_lora_rank"),
    (["model.mla_every=-1"], 1, "model.mla_every"),
    (["model.pad_vocab_multiple=0"], 1, "model.pad_vocab_multiple"),
    # trainer numbers
    (["trainer.seed=-1"], 1, "trainer.seed"),
    ([f"trainer.seed={2**64}"], 1, "trainer.seed"),
    (["trainer.sample_tokens=-1"], 1, "trainer.sample_tokens"),
    (["trainer.sample_prompt=''"], 1, "trainer.sample_prompt"),  # would fail after the whole run
    (["trainer.max_steps=0"], 1, "trainer.max_steps"),
    (["trainer.eval_every=-1"], 1, "trainer.eval_every"),
    (["trainer.eval_batches=0"], 1, "trainer.eval_batches"),
    (["trainer.checkpoint_every=-1"], 1, "trainer.checkpoint_every"),
    (["trainer.keep_checkpoints=0"], 1, "trainer.keep_checkpoints"),
    (["trainer.threads=-1"], 1, "trainer.threads"),
    (["trainer.stop_at_step=-1"], 1, "trainer.stop_at_step"),
    (["trainer.collective_timeout_s=0"], 1, "trainer.collective_timeout_s"),
    (["trainer.collective_timeout_s=inf"], 1, "trainer.collective_timeout_s"),
    (["trainer.peak_flops=nan"], 1, "trainer.peak_flops"),
    # optimizer numbers
    (["optim.lr=0"], 1, "optim.lr"),
    (["optim.lr=inf"], 1, "optim.lr"),
    (["optim.lr=nan"], 1, "optim.lr"),
    (["optim.weight_decay=-0.1"], 1, "optim.weight_decay"),
    (["optim.lr=0.5", "optim.weight_decay=2"], 1, "optim.lr*optim.weight_decay"),
    (["optim.eps=0"], 1, "optim.eps"),
    (["optim.betas=[0.9]"], 1, "optim.betas"),
    (["optim.betas=[0.9,1.0]"], 1, "optim.betas"),
    (["optim.grad_clip=-1"], 1, "optim.grad_clip"),
    (["optim.warmup_steps=-1"], 1, "optim.warmup_steps"),
    (["optim.min_lr_ratio=1.5"], 1, "optim.min_lr_ratio"),
    (["optim.decay_fraction=0"], 1, "optim.decay_fraction"),
    (["optim.momentum=1"], 1, "optim.momentum"),
    (["optim.ns_steps=0"], 1, "optim.ns_steps"),
    # data numbers
    (["data.num_proc=0"], 1, "data.num_proc"),
    (["data.val_fraction=nan"], 1, "data.val_fraction"),
    (["data.tokenizer.vocab_size=100"], 1, "data.tokenizer.vocab_size"),
    (["data.tokenizer.vocab_size=-1"], 1, "data.tokenizer.vocab_size"),
    (["data.tokenizer.train_chars=0"], 1, "data.tokenizer.train_chars"),
    # parallel degrees
    (["parallel.dp_replicate=0"], 1, "parallel.dp_replicate"),
    (["parallel.pp=0"], 1, "parallel.pp"),
    # CUDA graphs, on one GPU: of the compiled regions, or of the whole micro-batch
    (["parallel.cuda_graphs=yes"], 1, "parallel.cuda_graphs"),
    (["parallel.cuda_graphs=regions"], 1, "set parallel.compile=true as well"),
    (["parallel.cuda_graphs=step", "trainer.device=cpu"], 1, "trainer.device=cpu"),
    (["parallel.cuda_graphs=regions", "parallel.compile=true", "parallel.dp_shard=2"], 2,
     "parallel.dp_shard=2"),
    (["parallel.cuda_graphs=step", "parallel.tp=2", "parallel.pp=2"], 4,
     "with parallel.tp=2, parallel.pp=2 set parallel.cuda_graphs=none"),
    (["parallel.cuda_graphs=step", "data.varlen=true"], 1, "data.varlen=true"),
    (["parallel.cuda_graphs=step", "parallel.engine=deepspeed"], 1, "without parallel.cuda_graphs=step"),
]


def test_compose_helper_is_hydra_composition():
    overrides = ["model=small", "data=files", "data.data_files=[a.txt,b.txt]", "parallel.pp_split=[1,2]",
                 "data.path=null", "trainer.peak_flops=0", "parallel.sequence_parallel=true",
                 "optim.name=sgd"]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        full = OmegaConf.to_object(compose("config", overrides=["trainer.run_dir=unused", *overrides]))
    assert compose_cfg(*overrides) == full


@pytest.mark.parametrize("overrides,world,key", IMPOSSIBLE, ids=[" ".join(o) for o, _, _ in IMPOSSIBLE])
def test_impossible_config_names_its_key_in_one_line(overrides, world, key):
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, world=world)
    message = str(err.value)
    assert "\n" not in message
    assert key in message, message


def test_the_messages_other_tests_match_are_unchanged():
    def message(world, *overrides):
        with pytest.raises(ConfigError) as err:
            validate(compose_cfg("trainer.micro_batch_size=4", *overrides), world=world)
        return str(err.value)

    assert message(2, "parallel.dp_shard=3").startswith(
        "parallel.dp_replicate*dp_shard*cp*tp*pp = 1*3*1*1*1 = 3 but 2 process(es)")
    assert message(2, "parallel.tp=2", "model.mla.num_heads=3").startswith(
        "model.mla.num_heads=3 is not divisible by parallel.tp=2")
    assert message(2, "parallel.pp=2", "parallel.pp_microbatches=3").startswith(
        "trainer.micro_batch_size=4 does not split into")
    assert message(2, "parallel.dp_shard=2", "parallel.sequence_parallel=true").startswith(
        "parallel.sequence_parallel=true needs parallel.tp > 1")
    assert message(1, "model.residual=attnres_half") == (
        "model.residual='attnres_half' is invalid: choose one of standard|attnres_full|attnres_block")


LAYOUT = ("parallel.dp_replicate*dp_shard*cp*tp*pp = {} but {} process(es) were launched; the product must "
          "equal the number of processes: {}")


@pytest.mark.parametrize("overrides,world,message", [
    # no dp_shard fixes it: name the degrees to change and the processes this layout needs
    (["parallel.tp=3"], 2,
     LAYOUT.format("1*1*1*3*1 = 3", 2, "launch torchrun --nproc_per_node 3 for this layout, or change "
                                     "parallel.tp so that the product is 2")),
    (["parallel.tp=2"], 1,
     LAYOUT.format("1*1*1*2*1 = 2", 1, "launch torchrun --nproc_per_node 2 for this layout, or change "
                                     "parallel.tp so that the product is 1")),
    (["parallel.pp=2", "parallel.tp=2"], 2,
     LAYOUT.format("1*1*1*2*2 = 4", 2, "launch torchrun --nproc_per_node 4 for this layout, or change "
                                     "parallel.tp and/or parallel.pp so that the product is 2")),
    (["parallel.dp_replicate=3"], 2,
     LAYOUT.format("3*1*1*1*1 = 3", 2, "launch torchrun --nproc_per_node 3 for this layout, or change "
                                     "parallel.dp_replicate so that the product is 2")),
    # a dp_shard makes the product the number of processes
    (["parallel.dp_shard=3"], 4,
     LAYOUT.format("1*3*1*1*1 = 3", 4, "set parallel.dp_shard=4 for 4 processes, or launch torchrun "
                                     "--nproc_per_node 3 for this layout")),
    (["parallel.tp=2"], 4,
     LAYOUT.format("1*1*1*2*1 = 2", 4, "set parallel.dp_shard=2 for 4 processes, or launch torchrun "
                                     "--nproc_per_node 2 for this layout")),
    (["parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2"], 4,
     LAYOUT.format("2*2*1*2*1 = 8", 4, "set parallel.dp_shard=1 for 4 processes, or launch torchrun "
                                     "--nproc_per_node 8 for this layout")),
])
def test_layout_hint_makes_the_product_the_number_of_processes(overrides, world, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(*overrides), world=world)
    assert str(err.value) == message
    fix = message.split("set ", 1)[1].split(" for ", 1)[0] if ": set " in message else None
    if fix:  # the suggested dp_shard does validate on this many processes
        validate(compose_cfg(*overrides, fix), world=world)


@pytest.mark.parametrize("override,message", [
    ("model.init_std=1e6", "model.init_std=1000000.0 is invalid: must be in (0, 1] (0.02 is usual)"),
    ("model.norm_eps=0", "model.norm_eps=0.0 is invalid: must be in (0, 1) (1e-5 or 1e-6 is usual)"),
    ("model.rope_theta=0.5", "model.rope_theta=0.5 is invalid: must be > 1 (10000 is usual)"),
    ("trainer.seed=-1", "trainer.seed=-1 is invalid: must be an integer in [0, 2**64)"),
    ("trainer.sample_prompt=''", "trainer.sample_prompt='' is invalid: must be non-empty when "
                                 "trainer.sample_tokens > 0 (set trainer.sample_tokens=0 for no sample)"),
    ("trainer.profile.steps=[3,2]", "trainer.profile.steps=[3, 2] is invalid: must be [first, last] training "
                                    "steps with 1 <= first <= last <= trainer.max_steps (600), e.g. [5,6]; "
                                    "null: no profile"),
    ("trainer.profile.steps=[0,1]", "trainer.profile.steps=[0, 1] is invalid: must be [first, last] training "
                                    "steps with 1 <= first <= last <= trainer.max_steps (600), e.g. [5,6]; "
                                    "null: no profile"),
    ("optim.lr=inf", "optim.lr=inf is invalid: must be a finite number"),
    ("optim.eps=0", "optim.eps=0.0 is invalid: must be > 0 (1e-8 is usual)"),
    ("optim.weight_decay=400", "optim.lr*optim.weight_decay = 0.003*400.0 = 1.2 is invalid: must be < 1 "
                               "(each step multiplies the weights by 1 - lr*weight_decay); lower "
                               "optim.weight_decay"),
])
def test_range_messages_name_key_value_and_range(override, message):
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg(override), world=1)
    assert str(err.value) == message


def _compose_with(*overrides: str) -> DictConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=["trainer.run_dir=unused", *overrides])


@pytest.mark.parametrize("override,message", [
    ("+trainer.max_stepz=3", "trainer.max_stepz is not a config key: did you mean trainer.max_steps?"),
    ("+data.tokenizer.vocab_sise=512",
     "data.tokenizer.vocab_sise is not a config key: did you mean data.tokenizer.vocab_size?"),
    ("+logging.wandb.projct=x",
     "logging.wandb.projct is not a config key: did you mean logging.wandb.project?"),
    ("+trainer.lr=1", "trainer.lr is not a config key: did you mean optim.lr?"),
    ("+max_steps=3", "max_steps is not a config key: did you mean trainer.max_steps?"),
    ("+model.foo=1",
     "model.foo is not a config key (the keys of model are the fields of ModelConfig in "
     "kimi/model/config.py)"),
    ("+bar=1", "bar is not a config key (the sections are model, data, optim, trainer, logging, parallel, "
               "precision, stages)"),
])
def test_keys_added_with_plus_are_refused(override, message):
    # Hydra's `+` adds a key even to the structured schema; to_config must not drop it without a word
    with pytest.raises(ConfigError) as err:
        to_config(_compose_with(override))
    assert str(err.value) == message


def test_known_keys_still_merge():
    assert to_config(_compose_with("++trainer.max_steps=7")).trainer.max_steps == 7
    plain = to_config({"trainer": {"max_steps": 5}, "data": {"tokenizer": {"vocab_size": 512}}})
    assert (plain.trainer.max_steps, plain.data.tokenizer.vocab_size) == (5, 512)
    with pytest.raises(ConfigError, match=r"^data\.tokenizer\.vocab is not a config key: did you mean "):
        to_config({"data": {"tokenizer": {"vocab": 512}}})


@pytest.mark.parametrize("overrides,world", [
    ([], 1),
    (["model=small", "parallel.tp=2"], 2),
    (["model=1b", "parallel.tp=2"], 2),
    (["model=1b", "parallel.dp_replicate=2", "parallel.dp_shard=2", "parallel.tp=2",
      "parallel.sequence_parallel=true", "parallel.activation_checkpointing=selective"], 8),
    (["parallel.pp=2"], 2),
    (["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"], 2),  # 2 x 2 stages on 4 blocks
    (["parallel.pp=2", "parallel.pp_schedule=zero_bubble", "parallel.pp_microbatches=4"], 2),
    (["parallel.pp=2", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=1",
      "parallel.pp_split=[1]"], 2),
    (["parallel.pp=4", "parallel.pp_split=[1,2,3]"], 4),
    (["optim=adamw", "optim.qk_clip_tau=100"], 1),
    (["optim=adamw", "optim.qk_clip_tau=0"], 1),
    (["data=tinystories"], 1),
    (["data=files", "data.data_files=[a.txt]", "data.format=text"], 1),
    (["model.residual=standard", "model.mla_layers=[0,3]", "trainer.precision=bf16",
      "trainer.device=cpu"], 1),
    (["model.kda.backend=triton", "model.kda.head_dim=256"], 1),
    (["logging.wandb.mode=disabled", "parallel.engine=torch"], 1),
    (["parallel.compile=true", "parallel.cuda_graphs=regions", "trainer.device=cuda"], 1),
    (["parallel.cuda_graphs=step", "trainer.device=cuda", "model=moe_tiny"], 1),
    ([*FT, "parallel.dp_shard=2", "parallel.tp=2", "parallel.torchft.replica_group=2",
      "parallel.torchft.replica_groups=3", "parallel.torchft.min_replicas=2"], 4),
])
def test_workable_presets_pass(overrides, world):
    validate(compose_cfg(*overrides), world=world)


def test_fault_tolerance_without_torchft_names_the_extra(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^parallel\.fault_tolerance=torchft needs the torchft package.*"
                                          r"pip install -e '\.\[ft\]'") as err:
        validate(compose_cfg(*FT), world=1)
    assert "\n" not in str(err.value)


def test_attnres_triton_needs_cuda_or_the_interpreter(monkeypatch):
    """model.attnres.backend=triton on a CPU run is refused in one line, unless Triton runs interpreted
    (tests)."""
    cfg = compose_cfg("model.attnres.backend=triton", "trainer.device=cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    validate(cfg, world=1)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ConfigError, match=r"^model.attnres.backend=triton is invalid with "
                                          r"trainer.device=cpu.*set model.attnres.backend=auto$"):
        validate(cfg, world=1)


def test_world_defaults_to_world_size(monkeypatch):
    cfg = compose_cfg("parallel.dp_shard=2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    validate(cfg)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ConfigError, match="but 1 process"):
        validate(cfg)


def test_fixed_choice_keys_stay_plain_strings():
    cfg = compose_cfg("model.residual=standard", "parallel.pp_schedule=gpipe")
    assert type(cfg.model.residual) is str and cfg.model.residual == "standard"
    assert type(cfg.parallel.engine) is str and cfg.parallel.engine == "torch"
    choice_keys = []

    def walk(node, prefix):
        for f in dataclasses.fields(node):
            if "choices" in f.metadata:
                choice_keys.append(f"{prefix}.{f.name}")
            elif dataclasses.is_dataclass(getattr(node, f.name)):
                walk(getattr(node, f.name), f"{prefix}.{f.name}")

    for section in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(getattr(cfg, section.name)):  # not stages, a list
            walk(getattr(cfg, section.name), section.name)
    assert sorted(choice_keys) == sorted([
        "model.residual", "model.kda.backend", "model.moe.impl", "optim.name", "optim.schedule",
        "optim.ns_dtype", "optim.adjust_lr_fn", "trainer.precision", "trainer.device", "logging.wandb.mode",
        "data.source", "data.format", "data.prepare_executor", "parallel.activation_checkpointing",
        "parallel.pp_schedule", "parallel.engine", "parallel.cuda_graphs",
        "parallel.fault_tolerance", "precision.fp8.recipe", "precision.qat", "model.mlp.activation",
        "model.moe.balance", "model.attention.backend", "model.attnres.backend"])
    import kimi.parallel.engine_rules  # noqa: F401 (the engines' registry fills kimi.config.ENGINES)

    assert tuple(ENGINES) == ("torch", "deepspeed") and AC_MODES == ("none", "full", "selective")
    assert PP_SCHEDULES == ("gpipe", "1f1b", "interleaved_1f1b", "zero_bubble")
    assert SINGLE_STAGE_SCHEDULES == ("gpipe", "1f1b")


def test_pipeline_helpers():
    cfg = compose_cfg()
    assert (pipeline_stages(cfg.parallel), pipeline_microbatches(cfg)) == (1, 1)
    cfg = compose_cfg("parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                      "parallel.pp_virtual_stages=3")
    assert (pipeline_stages(cfg.parallel), pipeline_microbatches(cfg)) == (6, 2)
    cfg = compose_cfg("parallel.pp=4", "parallel.pp_schedule=1f1b", "parallel.pp_microbatches=8")
    assert (pipeline_stages(cfg.parallel), pipeline_microbatches(cfg)) == (4, 8)


@pytest.mark.parametrize("world,overrides,key", [
    ("1", ["parallel.tp=2"], "parallel.dp_replicate*dp_shard*cp*tp*pp"),
    ("2", ["model.kda.num_heads=3", "parallel.tp=2"], "model.kda.num_heads"),
    ("1", ["+trainer.max_stepz=3"], "trainer.max_stepz"),
])
def test_trainer_fails_before_tokenisation(tmp_path, monkeypatch, world, overrides, key):
    from kimi.trainer import Trainer

    # Trainer validates first thing, so with WORLD_SIZE=2 it never reaches the process group either
    monkeypatch.setenv("WORLD_SIZE", world)
    cache = tmp_path / "untouched-cache"
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"trainer.run_dir={tmp_path / 'run'}", "data=files",
                                           f"data.data_files=[{tmp_path / 'missing.txt'}]",
                                           f"data.cache_dir={cache}", *overrides])
    with pytest.raises(ConfigError) as err:
        Trainer(cfg)
    assert key in str(err.value) and "\n" not in str(err.value)
    assert not cache.exists() and not (tmp_path / "run").exists()


# ---- warnings: a config that works, but likely not as meant ----------------------------------------------
@pytest.mark.parametrize("overrides,words", [
    (["optim.warmup_steps=50", "trainer.max_steps=20"],
     "optim.warmup_steps=50 is more than trainer.max_steps=20: the learning rate never reaches optim.lr "
     "(at most 40% of it)"),
    (["data.num_proc=3"], "data.num_proc=3 is more than the 2 cores this process may use"),
])
def test_a_likely_mistake_is_one_warning_line_not_an_error(monkeypatch, capsys, overrides, words):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)  # a 2-core machine
    monkeypatch.delenv("RANK", raising=False)
    validate(compose_cfg(*overrides))
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1 and out[0].startswith(f"[kimi] warning: {words}"), out
    monkeypatch.setenv("RANK", "1")  # once per run: rank 0's
    validate(compose_cfg(*overrides))
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("overrides", [["optim.warmup_steps=20", "trainer.max_steps=20"], ["data.num_proc=2"],
                                       []])
def test_a_fitting_setting_warns_nothing(monkeypatch, capsys, overrides):
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.delenv("RANK", raising=False)
    validate(compose_cfg(*overrides))
    assert capsys.readouterr().out == ""
