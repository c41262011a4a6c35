"""torchtitan's Llama 3 trainer (torchtitan==0.3.0) as a dense peer: a Llama of our shape trained in one
process for --warmup + --steps steps on our cached Shakespeare (else kimi/'s source) with a BPE tokenizer
made from it, offline; prints and returns {tokens_per_s, mfu, peak_mem_bytes, step_s, device, ...}.
Its packages live in a directory of their own, not our venv (it pins datasets<4.8): `make titan-site` puts
them in .venv/titan (pip install --no-deps --target, the Makefile's TITAN_SPECS); --site or $TITAN_SITE
names another, and none is needed where torchtitan is importable already (make gpu-check's site). The child
is this file under torchtitan's own `--module __main__ --config titan_config`. Without CUDA the device is
shimmed to CPU (gloo) and attention is SDPA under the BlockMask (FlexAttention has no CPU backward).
mfu is torchtitan's: 6N + 12 L H d T FLOPs per token (no causal halving) over its datasheet peak.

    python bench/titan_peer.py --like dense_1b --batch 4 --seq-len 4096 --steps 10 --bf16
    python bench/titan_peer.py --batch 2 --seq-len 64 --steps 3    # CPU dry run, 2 layers of 64 (~20 s)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SPEC_ENV, TAG = "TITAN_PEER_SPEC", "TITAN_PEER_METRICS "
UNUSABLE = "TITAN_PEER_UNUSABLE "  # the child's line when torchtitan does not import


def like(preset: str, overrides: list[str], seq_len: int | None) -> dict:
    """The shape of one of our all-attention presets."""
    from kimi.config import mixer_pattern
    from kimi.summary import compose_config, vocab_note
    cfg = compose_config([f"model={preset}", *overrides])
    vocab_note(cfg)
    m, seq_len = cfg.model, seq_len or cfg.trainer.seq_len
    heads, pattern = m.mha.num_heads, mixer_pattern(m)
    head_dim = m.mha.head_dim or m.d_model // heads
    if {*pattern, m.residual} != {"A", "standard"} or head_dim * heads != m.d_model:
        sys.exit(f"model={preset} is not Llama-shaped: blocks {pattern}, {m.residual} residual")
    return dict(layers=m.num_layers, dim=m.d_model, heads=heads, kv_heads=m.mha.kv_heads or heads,
                ffn_dim=m.mlp.hidden, vocab=m.vocab_size, rope_theta=m.rope_theta, tied=m.tie_embeddings,
                seq_len=seq_len)


def titan_config():
    """torchtitan's config function: the Trainer.Config for $TITAN_PEER_SPEC."""
    from datasets import load_dataset
    from torchtitan.components import checkpoint, loss, metrics, optimizer, validate
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.hf_datasets import DatasetConfig, text_datasets
    from torchtitan.models import llama3 as L
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.trainer import Trainer
    s = json.loads(os.environ[SPEC_ENV])
    dim, vocab = s["dim"], s["vocab"]

    def flavor(attn_backend: str, tp_gemm_backend: str = "default"):
        rope = ComplexRoPE.Config(dim=dim // s["heads"], max_seq_len=s["seq_len"], theta=s["rope_theta"])
        return L.Llama3Model.Config(
            dim=dim, vocab_size=vocab, enable_weight_tying=s["tied"],
            tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim,
                                            param_init=L._EMBEDDING_INIT),
            norm=RMSNorm.Config(normalized_shape=dim, param_init=L._NORM_INIT),
            lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=L._output_linear_init(dim)),
            layers=L._build_llama3_layers(
                fuse_qkv=True, n_layers=s["layers"], dim=dim, n_heads=s["heads"], n_kv_heads=s["kv_heads"],
                hidden_dim=s["ffn_dim"], rope=rope, attn_backend=attn_backend,
                tp_gemm_backend=tp_gemm_backend))

    L.llama3_configs["peer"] = flavor
    text_datasets.DATASETS["peer_text"] = DatasetConfig(
        path=s["data"], sample_processor=lambda x: x["text"],
        loader=lambda p: load_dataset("json", data_files=p, split="train"))
    ac = {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[s["ac"]]
    return Trainer.Config(
        model_spec=L.model_registry("peer"), hf_assets_path=s["tokenizer"], dump_folder=s["dump"],
        loss=loss.ChunkedLossWrapper.Config(loss_fn=loss.CrossEntropyLoss.Config(global_vocab_size=vocab)),
        optimizer=optimizer.default_adamw(lr=3e-4),
        lr_scheduler=optimizer.LRSchedulersContainer.Config(warmup_steps=1),
        # a step of `batch` rows in micro-batches of `micro_batch` (gradient accumulation), as ours trains
        training=TrainingConfig(local_batch_size=s.get("micro_batch", s["batch"]),
                                global_batch_size=s["batch"], seq_len=s["seq_len"], steps=s["total_steps"],
                                disable_cuda_graphs=True, mixed_precision_param=s["dtype"]),
        dataloader=text_datasets.HuggingFaceTextDataLoader.Config(dataset="peer_text"),
        metrics=metrics.MetricsProcessor.Config(log_freq=1, disable_color_printing=True),
        checkpoint=checkpoint.CheckpointManager.Config(enable=False), activation_checkpoint=ac,
        validator=validate.Validator.Config(enable=False), compile=CompileConfig(enable=s["compile"]))


def shims() -> None:
    """What torchtitan imports that this torch or this machine lacks: torch.distributed.set_timeout (older
    torch), tensorboard (not installed; the metrics go to stdout)."""
    if not hasattr(torch.distributed, "set_timeout"):
        torch.distributed.set_timeout = torch.distributed.distributed_c10d._set_pg_timeout
    sys.modules["torch.utils.tensorboard"] = types.SimpleNamespace(SummaryWriter=None)


def child() -> None:
    """torchtitan.train.main() behind the shims, printing each step's metrics dict as a tagged JSON line."""
    sys.path.pop(0)
    shims()
    cpu = not torch.cuda.is_available()
    if cpu:  # before torchtitan's import, which reads the device type into its modules
        torch._utils._get_available_device_type = lambda: "cpu"
    try:
        import torchtitan.train  # noqa: F401 (a torchtitan newer than this torch fails here)
    except Exception as e:  # ImportError or AttributeError: what a torch it does not know raises at import
        print(UNUSABLE + f"{type(e).__name__}: {e}".splitlines()[0][:200], flush=True)
        sys.exit(3)
    if cpu:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        peaks = ("active_bytes.all.peak", "reserved_bytes.all.peak")
        for name, fn in dict(get_device_name=lambda *_: "cpu", empty_cache=lambda: None,
                             current_device=lambda: 0, reset_peak_memory_stats=lambda *_: None,
                             get_device_properties=lambda *_: types.SimpleNamespace(total_memory=ram),
                             memory_stats=lambda *_: dict.fromkeys(
                                 peaks, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)).items():
            setattr(torch.cpu, name, fn)
        from torch.nn.attention.flex_attention import AuxOutput, create_mask
        from torchtitan.models.common.attention import FlexAttention

        def sdpa(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
            assert score_mod is None and not return_aux.lse
            mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa), AuxOutput()
        FlexAttention._compiled_flex_attn = sdpa
    elif not json.loads(os.environ[SPEC_ENV])["autotune"]:
        from torch.nn.attention.flex_attention import flex_attention
        from torchtitan.models.common.attention import FlexAttention
        FlexAttention._compiled_flex_attn = torch.compile(flex_attention, options={
            "wrap_inductor_compiled_regions": True, "triton.cudagraphs": False})
    from torchtitan.components import metrics
    from torchtitan.train import main
    metrics.BaseLogger.log = lambda _, values, step: print(TAG + json.dumps({"step": step, **values}),
                                                           flush=True)
    main()


def assets(work: Path, vocab: int) -> None:
    """data.jsonl (a document per work, or kimi/'s source as one) and tokenizer/ (a byte-level BPE on it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    cache = Path(os.environ.get("KIMI_CACHE_DIR") or "~/.cache/kimi").expanduser() / "raw" / "shakespeare"
    docs = ([f.read_text(errors="replace") for f in sorted(cache.glob("*.txt"))] or
            ["\n".join(f.read_text(errors="replace") for f in sorted((ROOT / "kimi").rglob("*.py")))])
    (work / "data.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tdir := work / "tokenizer").mkdir(parents=True)
    tok, special = Tokenizer(models.BPE()), ["<|begin_of_text|>", "<|end_of_text|>"]
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    tok.save(str(tdir / "tokenizer.json"))
    (tdir / "tokenizer_config.json").write_text(json.dumps(dict(zip(("bos_token", "eos_token"), special))))


def find_site(site: Path | None) -> Path | None:
    """The directory torchtitan is installed in: `site`, $TITAN_SITE, .venv/titan; None where it is importable
    without one; exits saying how to install it otherwise."""
    import importlib.util

    if site is not None and not (site / "torchtitan").is_dir():
        sys.exit(f"torchtitan is not installed in {site}: make titan-site TITAN_SITE={site}")
    for candidate in (site, os.environ.get("TITAN_SITE"), ROOT / ".venv" / "titan"):
        if candidate and (Path(candidate) / "torchtitan").is_dir():
            return Path(candidate)
    if importlib.util.find_spec("torchtitan") is None:
        sys.exit("torchtitan is not installed: make titan-site (it goes into .venv/titan), or name its "
                 "directory with --site / $TITAN_SITE")
    return None


class Unusable(Exception):
    """torchtitan's trainer does not import with this python (its message says why): a torchtitan newer than
    the torch it finds fails at import (0.3.0 needs torch.distributed.fsdp's DataParallelMeshDims, which
    torch 2.11 lacks). The training child finds that out first, in seconds, before it builds anything."""


def torch_version() -> str:
    from importlib.metadata import version

    return version("torch")


def run(spec: dict, site: Path | None, warmup: int, steps: int) -> dict:
    """Train in a child process: the timed steps' means, and the peak memory of the whole run."""
    site = find_site(site)
    work = Path(tempfile.mkdtemp(prefix="titan_peer_"))
    assets(work, spec["vocab"])
    spec = {**spec, "total_steps": warmup + steps, "dump": str(work / "out"),
            "tokenizer": str(work / "tokenizer"), "data": str(work / "data.jsonl")}
    env = {**os.environ, SPEC_ENV: json.dumps(spec), "LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(20000 + os.getpid() % 20000), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "HF_DATASETS_CACHE": str(work / "hf"),
           "PYTHONPATH": os.pathsep.join(filter(None, [site and str(site.resolve()),
                                                       os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--module", "__main__", "--config", "titan_config"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
    (work / "titan.log").write_text(log := proc.stdout + proc.stderr)
    if said := [line[len(UNUSABLE):] for line in proc.stdout.splitlines() if line.startswith(UNUSABLE)]:
        raise Unusable(f"torchtitan does not import with torch {torch_version()}: {said[0]}")
    logged = [json.loads(line[len(TAG):]) for line in proc.stdout.splitlines() if line.startswith(TAG)]
    if proc.returncode or len(logged) < warmup + steps:
        sys.exit(f"torchtitan failed ({proc.returncode}), {work}/titan.log:\n{log[-4000:]}")
    timed = logged[warmup:]
    step_s = sum(r["time_metrics/end_to_end(s)"] for r in timed) / len(timed)
    tokens_per_s = spec["batch"] * spec["seq_len"] / step_s
    flops = timed[-1]["tflops"] * 1e12 / timed[-1]["throughput(tps)"]
    peak = float(re.search(r"Peak FLOPS used for computing MFU: (\S+)", log).group(1))
    return {"tokens_per_s": tokens_per_s, "mfu": tokens_per_s * flops / peak, "step_s": step_s,
            "peak_mem_bytes": int(max(r["memory/max_active(GiB)"] for r in logged) * 2**30),
            "device": re.search(r"\w+ capacity: (.+) with \S+GiB memory", log).group(1),
            "flops_per_token": flops, "peak_flops": peak, "log": str(work / "titan.log"),
            "losses": [r["loss_metrics/global_avg_loss"] for r in logged]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--like", help="take the shape from one of our all-attention presets, e.g. dense_1b")
    p.add_argument("--set", nargs="*", default=[], help="overrides for --like, e.g. model.num_layers=2")
    for name, default in (("layers", 2), ("dim", 64), ("heads", 4), ("kv-heads", 0), ("ffn-dim", 192),
                          ("vocab", 512), ("batch", 4), ("steps", 10), ("warmup", 2), ("seq-len", None)):
        p.add_argument(f"--{name}", type=int, default=default)
    for flag, what in (("compile", "torchtitan's per-block torch.compile"), ("bf16", "bf16 mixed precision"),
                       ("no-autotune", "compile FlexAttention without max_autotune")):
        p.add_argument(f"--{flag}", action="store_true", help=what)
    p.add_argument("--ac", choices=("none", "selective", "full"), default="none",
                   help="as our parallel.activation_checkpointing")
    p.add_argument("--site", type=Path, help="torchtitan's directory (default: $TITAN_SITE, else "
                   ".venv/titan)")
    a = p.parse_args(argv)
    shape = like(a.like, a.set, a.seq_len) if a.like else dict(
        layers=a.layers, dim=a.dim, heads=a.heads, kv_heads=a.kv_heads or a.heads, ffn_dim=a.ffn_dim,
        vocab=a.vocab, rope_theta=500000.0, tied=False, seq_len=a.seq_len or 64)
    spec = {**shape, "batch": a.batch, "compile": a.compile, "dtype": "bfloat16" if a.bf16 else "float32",
            "ac": a.ac, "autotune": not a.no_autotune}
    try:
        record = {"model": a.like or "custom", "shape": shape, **run(spec, a.site, a.warmup, a.steps)}
    except Unusable as e:
        sys.exit(str(e))
    print(json.dumps(record, indent=2))
    return record


if __name__ == "__main__":
    child() if SPEC_ENV in os.environ else main()
