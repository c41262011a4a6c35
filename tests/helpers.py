"""Helpers shared by test files (pytest puts tests/ on sys.path, so `from helpers import ...` works)."""

import re
import socket
from pathlib import Path

import datasets
import huggingface_hub.constants
import pytest

from kimi.config import ModelConfig

# a subprocess's environment entry that has Python list each module it imports on stderr (-X importtime)
IMPORT_TIMES = {"PYTHONPROFILEIMPORTTIME": "1"}


def imported(stderr: str, module: str) -> bool:
    """Whether a process run with IMPORT_TIMES imported `module` (its line in the stderr it wrote)."""
    return re.search(rf"\|\s+{re.escape(module)}$", stderr, re.M) is not None


# A model small enough for fp64 checks in milliseconds: KDA, MLA, KDA (3 blocks, 6 sublayers).
TINY_MODEL = dict(vocab_size=61, d_model=32, num_layers=3, mla_layers=[1], kda=dict(num_heads=2, head_dim=16),
                  mla=dict(num_heads=2, kv_lora_rank=16, qk_nope_head_dim=16, v_head_dim=16),
                  mlp=dict(hidden=48))


def tiny_model_cfg(**overrides) -> ModelConfig:
    # A section given as a dict adds to TINY_MODEL's: kda=dict(num_heads=4) keeps its head_dim of 16
    merged = {k: {**TINY_MODEL[k], **v} if isinstance(v, dict) and k in TINY_MODEL else v
              for k, v in overrides.items()}
    return ModelConfig(**{**TINY_MODEL, **merged})


# Overrides for a trainer run in seconds: a 2-block model on a generated corpus (see make_corpus).
TINY_TRAINER = [
    "model.d_model=32", "model.num_layers=2", "model.mla_every=2", "model.kda.num_heads=2",
    "model.kda.head_dim=16", "model.mla.num_heads=2", "model.mla.kv_lora_rank=16",
    "model.mla.qk_nope_head_dim=16", "model.mla.v_head_dim=16", "model.mlp.hidden=64",
    "model.attnres.block_size=2",
    "trainer.micro_batch_size=4", "trainer.seq_len=32", "trainer.eval_batches=2", "trainer.log_every=1",
    "trainer.sample_tokens=0", "trainer.threads=1", "optim.warmup_steps=2", "optim.lr=1e-2",
    "logging.wandb.mode=disabled", "data=files", "data.tokenizer.vocab_size=384", "data.val_fraction=0.1",
    "trainer.peak_flops=1e11",  # MFU's denominator given: measuring the CPU costs half a second per run
    "trainer.diag_every=0",  # diagnostics (a third of a second per run) where a test asks for them
    "logging.plot=false",  # the PNGs (matplotlib's import and a drawing: 0.6 s per process) where a test asks
]

# What every run of kimi.plan's measure=K needs besides the layout (tests/plan/test_plan_measure.py,
# tests/parallel/test_slurm.py): the CPU, short rows, no evaluation, checkpoint or sample
MEASURE_CPU = ["trainer.device=cpu", "trainer.seq_len=64", "data=files", "data.tokenizer.vocab_size=384",
               "data.val_fraction=0.1", "trainer.threads=1", "logging.wandb.mode=disabled",
               "trainer.eval_every=0", "trainer.checkpoint_every=0", "trainer.sample_tokens=0",
               "trainer.diag_every=0", "trainer.peak_flops=1e11", "trainer.resume=false",
               "optim.warmup_steps=1"]


def make_corpus(path: Path, docs: int = 24, sentences: int = 60) -> Path:
    """Deterministic English-like documents with enough structure for a model to learn quickly
    (kimi.data.synthetic)."""
    from kimi.data.synthetic import write_corpus

    return write_corpus(path, docs, sentences)


def offline_caches(home: Path):
    """(A fixture body) no network, and every cache (HF and kimi) under `home`; yields home."""
    with pytest.MonkeyPatch.context() as mp:
        for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
            mp.setenv(var, "1")
        mp.setenv("HF_HOME", str(home))
        mp.setenv("HF_DATASETS_CACHE", str(home / "datasets"))
        mp.setenv("KIMI_CACHE_DIR", str(home / "kimi"))
        # datasets reads these at import time, which has already happened: patch the live values too.
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield home


ROOT = Path(__file__).resolve().parents[1]


def corpus_overrides(tmp_path_factory) -> list:
    """data.* overrides for a generated corpus (make_corpus) and a token cache of its own."""
    corpus = make_corpus(tmp_path_factory.mktemp("corpus"))
    files = ",".join(str(p) for p in sorted(corpus.glob("*.txt")))
    return [f"data.data_files=[{files}]", f"data.cache_dir={tmp_path_factory.mktemp('cache')}"]


def run_cfg(run: Path, data: list, *overrides: str):
    """train.py's config for a tiny run in `run` (no periodic validation), composed as Hydra would."""
    from hydra import compose, initialize_config_dir

    from kimi.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[f"trainer.run_dir={run}", *data, *TINY_TRAINER,
                                            "trainer.eval_every=0", *overrides])


def preset(name: str, vocab: int) -> ModelConfig:
    """conf/model/<name>.yaml's ModelConfig, as train.py composes it, for a vocabulary of `vocab`."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from kimi.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        model = compose("config", overrides=[f"model={name}"]).model
    return ModelConfig(**{**OmegaConf.to_container(model, resolve=True), "vocab_size": vocab})


def fill_randomly(module, std: float, seed: int = 0):
    """Every parameter of `module` drawn anew (norm weights near 1, the rest normal(0, std)), so that gates
    and caps act when it is compared with another implementation; returns the module."""
    import torch

    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else std * torch.randn_like(p))
    return module


def train_run(run: Path, data: list, *overrides: str):
    """Trainer(run_cfg(...)).fit(); returns the trainer."""
    from kimi.trainer import Trainer

    trainer = Trainer(run_cfg(run, data, *overrides))
    trainer.fit()
    return trainer


def copy_run(trained: Path, tmp_path: Path) -> Path:
    """A copy of a run dir (without its lock file) to change in one test."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns(".lock"))
    return run


# Text for a small Kimi-style tiktoken BPE: Latin, Han glued to Latin, digits, punctuation, accents.
MIXED_TEXT = ("The quick brown fox jumps over the lazy dog. It's 2026; we've 12345 tokens! "
              "月之暗面的模型Kimi训练了很长的上下文。中文和English混合mixedText在一起，文abc文abc。"
              "\tcafé naïve Ünïcödé\r\n  indented\n\n")
GPT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"""
               r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


def write_kimi_tiktoken(directory: Path, vocab: int = 400) -> Path:
    """A tiktoken.model + tokenizer_config.json laid out as Kimi's releases lay them out (special tokens
    [BOS], [EOS], <|im_end|> right after the ranks, [UNK] and [PAD] last), trained with tiktoken's
    teaching BPE under GPT's pattern, so that some tokens cross from Han into Latin letters."""
    import base64
    import json

    import tiktoken._educational as edu

    ranks = edu.bpe_train(MIXED_TEXT * 4, vocab, GPT_PATTERN, visualise=None)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tiktoken.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    n = len(ranks)
    names = {n: "[BOS]", n + 1: "[EOS]", n + 2: "<|im_end|>", n + 254: "[UNK]", n + 255: "[PAD]"}
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(i): {"content": c, "special": True} for i, c in names.items()},
        "bos_token": "[BOS]", "eos_token": {"content": "[EOS]"}}, indent=1))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def worker_pid(tag: str, local_rank: int) -> int | None:
    """The pid of the training process started with KIMI_TEST_TAG=tag and this LOCAL_RANK (a torchrun agent
    has no LOCAL_RANK)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            env = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"KIMI_TEST_TAG={tag}".encode() in env and f"LOCAL_RANK={local_rank}".encode() in env:
            return int(entry.name)
    return None
