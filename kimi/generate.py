"""Sampling from a KimiModel with its decoding cache (KDA recurrent state + short-conv tails, MLA latents)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from kimi.model import KimiModel


def sample_next(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator | None) -> int:
    """One token id from the logits [vocab] of one position. temperature <= 0 means greedy (argmax)."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(
    model: KimiModel,
    prompt_ids: list[int] | torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 50,
    eos_id: int | None = None,
    generator: torch.Generator | None = None,
) -> list[int]:
    """Continue one prompt; returns only the new token ids (at most max_new_tokens).

    The prompt goes through the model in one forward (the prefill), then each sampled token alone through
    the cache, so a step costs the same whatever the length so far for KDA layers. Generation stops
    before max_new_tokens when eos_id is sampled; eos itself is not returned. top_k <= 0 keeps the whole
    vocabulary. The generator (on the model's device for CUDA) makes sampling reproducible.
    """
    device = next(model.parameters()).device
    ids = torch.as_tensor(prompt_ids, dtype=torch.long, device=device).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("generate needs a non-empty prompt")
    cache = model.new_cache()
    logits = _whole(model(ids, cache=cache))
    out: list[int] = []
    while len(out) < max_new_tokens:
        token = sample_next(logits[0, -1], temperature, top_k, generator)
        if token == eos_id:
            break
        out.append(token)
        if len(out) < max_new_tokens:
            logits = _whole(model(torch.tensor([[token]], device=device), cache=cache))
    return out


def _whole(logits: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel model's logits are sharded over the vocabulary: every rank gathers them all, then
    samples the same token from the same generator state."""
    return logits.full_tensor() if isinstance(logits, DTensor) else logits


def load_from_checkpoint(path: str, device: str = "cpu"):
    """(model, tokenizer, step) from a checkpoint directory, or from a run directory (its newest complete
    checkpoint). The model is rebuilt from the config saved in the checkpoint."""
    from pathlib import Path

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from kimi import checkpoint
    from kimi.config import ModelConfig
    from kimi.data import Tokenizer

    ckpt = Path(path)
    if not (ckpt / checkpoint.COMPLETE).is_file():
        latest = checkpoint.latest_complete(ckpt / "checkpoints")
        if latest is None:
            raise FileNotFoundError(f"{ckpt} is neither a complete checkpoint nor a run dir with one "
                                    f"(looked for {ckpt / 'checkpoints'}/step_*/{checkpoint.COMPLETE})")
        ckpt = latest.path
    saved = checkpoint.read_trainer_state(ckpt)
    model = KimiModel(ModelConfig(**saved["config"]["model"])).to(device)
    state = {"model": get_model_state_dict(model)}
    dcp.load(state, checkpoint_id=str(ckpt))
    set_model_state_dict(model, state["model"])
    run_copy = ckpt.parent.parent / "tokenizer.model"  # <run>/checkpoints/step_N -> <run>/tokenizer.model
    tokenizer = Tokenizer(run_copy if run_copy.is_file() else saved["extra"]["tokenizer_path"])
    return model.eval(), tokenizer, saved["step"]


def main(argv: list[str] | None = None) -> None:
    """python -m kimi.generate run=<run dir or checkpoint dir> [prompt="ROMEO:"] [max_new_tokens=200]
    [temperature=0.8] [top_k=50] [seed=0] [device=cpu]"""
    import sys

    from omegaconf import OmegaConf

    defaults = {"run": None, "prompt": "ROMEO:", "max_new_tokens": 200, "temperature": 0.8, "top_k": 50,
                "seed": 0, "device": "cpu"}
    args = OmegaConf.merge(OmegaConf.create(defaults), OmegaConf.from_cli(sys.argv[1:] if argv is None else argv))
    unknown = set(args) - set(defaults)
    if unknown or not args.run:
        raise SystemExit(f"usage: {main.__doc__.strip()}" + (f"\nunknown keys: {sorted(unknown)}" if unknown else ""))
    model, tokenizer, step = load_from_checkpoint(args.run, args.device)
    generator = torch.Generator(device=args.device).manual_seed(int(args.seed))
    new = generate(model, tokenizer.encode(str(args.prompt)), int(args.max_new_tokens), float(args.temperature),
                   int(args.top_k), tokenizer.eos_id, generator)
    print(f"[kimi] step {step} checkpoint, {len(new)} tokens:\n{args.prompt}{tokenizer.decode(new)}", flush=True)


if __name__ == "__main__":
    main()
