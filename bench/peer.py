"""What Kimi's blocks cost against the transformer everybody knows, in the same run: `1b` (KDA + MLA, Block
AttnRes) and its dense peer `dense_1b` (the same width, depth, MLP and vocabulary as a Llama-shaped model:
softmax attention through SDPA, standard residuals) trained on one device with the same tokens per step, the
same overrides and the same number of timed steps (bench/parallel.py's one-process measurement for each).

    python bench/peer.py [--kimi 1b] [--dense dense_1b] [--batch 4] [--steps 10] [--set key=value ...]
    python bench/peer.py --kimi tiny --dense tiny --dense-set model.layer_pattern=A model.residual=standard \
        --batch 4 --steps 2 --set trainer.seq_len=64      # a CPU dry run at tiny shape (tests/test_peer.py)

Prints a table (tokens/s, MFU, peak memory, ms per step, each Kimi/dense ratio) and writes
bench/results/peer.json. MFU counts each model's own FLOPs per token (model.flops_per_token: the dense
peer's attention is quadratic in the sequence, KDA's linear), so the two MFUs are comparable as hardware
use and tokens/s as speed. torchtitan's Llama of the same shape, which would measure the framework itself
against a well-kept peer, is not run here yet (see docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def measure(model: str, args, extra: list[str]) -> dict:
    """bench/parallel.py's one-process layout for `model`: its record (tokens/s, MFU, peak memory, ...)."""
    out = Path(tempfile.mkdtemp(prefix="kimi_peer_")) / f"{model}.json"
    cmd = [sys.executable, str(ROOT / "bench" / "parallel.py"), "--layouts", "single", "--model", model,
           "--batch", str(args.batch), "--steps", str(args.steps), "--out", str(out), "--set", *args.set, *extra]
    print(f"[peer] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench/parallel.py failed for {model}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())["layouts"]["single"][0]


def table(rows: dict) -> str:
    kimi, dense = rows["kimi"], rows["dense"]
    lines = ["| model | tokens/s | MFU | peak memory | step |", "|---|---|---|---|---|"]
    for name in ("dense", "kimi"):
        r = rows[name]
        lines.append(f"| {r['model']} ({name}) | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.2f}% | "
                     f"{r['peak_mem_bytes'] / 2**30:.2f} GiB | {1e3 * r['step_s']:.0f} ms |")
    lines.append(f"| kimi / dense | {kimi['tokens_per_s'] / dense['tokens_per_s']:.2f}x | "
                 f"{kimi['mfu'] / dense['mfu']:.2f}x | {kimi['peak_mem_bytes'] / dense['peak_mem_bytes']:.2f}x | "
                 f"{kimi['step_s'] / dense['step_s']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kimi", default="1b", help="the Kimi preset")
    parser.add_argument("--dense", default="dense_1b", help="its dense peer's preset")
    parser.add_argument("--dense-set", nargs="*", default=[], help="overrides for the dense peer only")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step, both models")
    parser.add_argument("--steps", type=int, default=10, help="timed steps, both models")
    parser.add_argument("--set", nargs="*", default=[], help="overrides for both, e.g. trainer.seq_len=4096 "
                        "trainer.precision=bf16 parallel.compile=true")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peer.json")
    args = parser.parse_args(argv)
    rows = {"dense": {"model": args.dense, **measure(args.dense, args, args.dense_set)},
            "kimi": {"model": args.kimi, **measure(args.kimi, args, [])}}
    device = rows["kimi"]["device"]
    print(f"\n{args.batch} sequences per step, {args.steps} timed steps, {' '.join(args.set) or 'defaults'}; "
          f"{device}\n\n{table(rows)}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"batch": args.batch, "steps": args.steps, "set": args.set,
                                    "dense_set": args.dense_set, **rows}, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
