"""The precision section's rules, with trainer.precision's (kimi.run.validation runs them before any data
work).
Whether the GPU has the format's matmuls is asked when the engine converts the model
(kimi.precision.emulated), once there is a device."""

from __future__ import annotations

import importlib.util

from kimi.schema.pipeline import pipeline_microbatches
from kimi.schema.vocabulary import RootConfig as Config
from kimi.schema.vocabulary import check, check_choices, require
# fills kimi.config.PRECISIONS, trainer.precision's choices, before check_choices reads them
from kimi.precision.registry import names_where, precision_for

TORCHAO_MISSING = ("{what} needs torchao, which is not installed: pip install -e '.[fp8]' (the fp8 extra), "
                   "or use trainer.precision=bf16 without precision.qat")


def validate_precision(cfg: Config) -> None:
    p, t, m, par = cfg.precision, cfg.trainer, cfg.model, cfg.parallel
    check_choices(p, "precision")
    check(p.keep_end_blocks >= 0, "precision.keep_end_blocks", p.keep_end_blocks, "must be >= 0")
    check(p.min_features >= 0, "precision.min_features", p.min_features, "must be >= 0")
    if p.fp8.fsdp_all_gather:
        _check_fsdp_all_gather(cfg)
    kind = precision_for(t.precision)
    low = kind.converts
    asked = [f"trainer.precision={t.precision}"] * low + [f"precision.qat={p.qat}"] * (p.qat is not None)
    if not asked:
        return
    what = " and ".join(asked)
    require(importlib.util.find_spec("torchao") is not None, TORCHAO_MISSING.format(what=what))
    require(par.engine == "torch",
            f"{what} is not supported by parallel.engine={par.engine} (its ZeRO keeps its own bf16 copies of "
            "the weights): use parallel.engine=torch, or trainer.precision=bf16 without precision.qat")
    if low:
        require(par.tp == 1, f"trainer.precision={t.precision} does not work with parallel.tp={par.tp} yet "
                             "(torchao's float8 tensor-parallel styles are not wired in): use parallel.tp=1 "
                             "or trainer.precision=bf16")
        require(t.device != "cpu" or p.emulate is not False,
                f"precision.emulate=false needs CUDA for trainer.precision={t.precision}: set "
                "precision.emulate=null (emulated on CPU) or trainer.device=cuda")
    if low:
        # the weight gradient's GEMM reduces over the tokens of one forward: fp8 GEMMs take multiples of 16
        # there, and MXFP8's blocks of 32 run along them
        tokens = t.micro_batch_size // pipeline_microbatches(cfg) * (t.seq_len // par.cp)
        multiple = kind.ALIGN
        require(tokens % multiple == 0,
                f"trainer.precision={t.precision} needs the tokens of one forward (micro_batch_size/pipeline "
                f"micro-batches * seq_len/cp = {tokens}) to be a multiple of {multiple}: change "
                "trainer.micro_batch_size or trainer.seq_len")
    if p.qat == "mxfp4_experts":
        require(m.moe.num_experts > 0, "precision.qat=mxfp4_experts needs a mixture-of-experts model "
                                       "(model.moe.num_experts > 0, e.g. model=moe_tiny): set "
                                       "precision.qat=null")
        require(m.d_model % 32 == 0 and m.moe.hidden % 32 == 0,
                "precision.qat=mxfp4_experts quantises the experts' weights in blocks of 32 along their "
                f"inputs: model.d_model={m.d_model} and model.moe.hidden={m.moe.hidden} must be multiples "
                "of 32")


def _check_fsdp_all_gather(cfg: Config) -> None:
    p, t, par = cfg.precision, cfg.trainer, cfg.parallel
    key, off = "precision.fp8.fsdp_all_gather=true", "or set precision.fp8.fsdp_all_gather=false"
    gathers = "|".join(names_where(lambda kind: kind.FSDP_GATHER))
    require(precision_for(t.precision).FSDP_GATHER,
            f"{key} gathers the weights of {gathers} projections, which trainer.precision={t.precision} has "
            f"none of: set trainer.precision={gathers} {off}")
    require(p.fp8.recipe == "tensorwise",
            f"{key} needs precision.fp8.recipe=tensorwise, not {p.fp8.recipe} (torchao gathers a weight in "
            f"fp8 only with one scale per tensor): set precision.fp8.recipe=tensorwise {off}")
    require(par.engine == "torch",
            f"{key} is FSDP2's, not parallel.engine={par.engine}'s: set parallel.engine=torch {off}")
    require(par.dp_shard * par.cp > 1,
            f"{key} needs FSDP2 to shard the weights (parallel.dp_shard * parallel.cp > 1, here "
            f"{par.dp_shard * par.cp}): set parallel.dp_shard to the data-parallel ranks {off}")
