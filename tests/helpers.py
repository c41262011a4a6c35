"""Helpers shared by test files (pytest puts tests/ on sys.path, so `from helpers import ...` works)."""

from kimi.config import ModelConfig

# A model small enough for fp64 checks in milliseconds: KDA, MLA, KDA (3 blocks, 6 sublayers).
TINY_MODEL = dict(vocab_size=61, d_model=32, num_layers=3, mla_layers=[1], kda_num_heads=2, kda_head_dim=16,
                  mla_num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16, mlp_hidden=48)


def tiny_model_cfg(**overrides) -> ModelConfig:
    return ModelConfig(**{**TINY_MODEL, **overrides})
