"""What Kimi's blocks cost against the transformer everybody knows, in the same run: `1b` (KDA + MLA, Block
AttnRes) and its dense peer `dense_1b` (the same width, depth, MLP and vocabulary as a Llama-shaped model:
softmax attention through SDPA, standard residuals) trained on one device with the same tokens per step, the
same overrides and the same number of timed steps (bench/parallel.py's one-process measurement for each).

    python bench/peer.py [--kimi 1b] [--dense dense_1b] [--batch 4] [--steps 10] [--set key=value ...]
    python bench/peer.py --kimi tiny --dense tiny --dense-set model.layer_pattern=A model.residual=standard \
        --batch 4 --steps 2 --set trainer.seq_len=64   # CPU dry run, tiny (gpu-check's dry run)

Prints a table (tokens/s, MFU, peak memory, ms per step, each Kimi/dense ratio) and writes
bench/results/peer.json. MFU counts each model's own FLOPs per token (model.flops_per_token: the dense
peer's attention is quadratic in the sequence, KDA's linear), so the two MFUs are comparable as hardware
use and tokens/s as speed.

--kimi-result reuses a measurement of the Kimi preset taken with the same settings (make gpu-check's train
step), so a short GPU call trains it once. --titan adds a third row: torchtitan's own trainer
(bench/titan_peer.py) on a Llama of the dense peer's shape, same tokens per step, steps, precision, compile
and activation checkpointing. dense vs torchtitan measures the framework, kimi vs dense the Kimi blocks.
Its MFU is put on our FLOP count (the dense peer's FLOPs per token; torchtitan's own, which does not halve
causal attention, is kept as mfu_titan).
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
           "--batch", str(args.batch), "--steps", str(args.steps), "--out", str(out), "--set", *args.set,
           *extra]
    print(f"[peer] {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench/parallel.py failed for {model}:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())["layouts"]["single"][0]


def titan(args, dense: dict) -> dict:
    """bench/titan_peer.py on the dense peer's shape, trained as --set trains ours."""
    from titan_peer import like, run  # bench/ is this script's directory

    sets = dict(s.split("=", 1) for s in args.set)
    shape = like(args.dense, [*args.set, *args.dense_set], None)
    micro = int(sets.get("trainer.micro_batch_size", args.batch))  # rows per micro-batch, as ours trains
    spec = {**shape, "batch": args.batch, "micro_batch": micro,
            "compile": sets.get("parallel.compile") == "true", "autotune": False,
            "dtype": "bfloat16" if sets.get("trainer.precision") == "bf16" else "float32",
            "ac": sets.get("parallel.activation_checkpointing", "none")}
    print(f"[peer] torchtitan: {json.dumps(spec)}", flush=True)
    record = run(spec, args.titan_site, warmup=2, steps=args.steps)
    return {"model": f"torchtitan {args.dense}", "shape": shape, **record, "mfu_titan": record["mfu"],
            "mfu": record["tokens_per_s"] * dense["mfu"] / dense["tokens_per_s"]}


def ratio(rows: dict, a: str, b: str) -> str:
    x, y = rows[a], rows[b]
    return (f"| {a} / {b} | {x['tokens_per_s'] / y['tokens_per_s']:.2f}x | {x['mfu'] / y['mfu']:.2f}x | "
            f"{x['peak_mem_bytes'] / y['peak_mem_bytes']:.2f}x | {x['step_s'] / y['step_s']:.2f}x |")


def table(rows: dict) -> str:
    lines = ["| model | tokens/s | MFU | peak memory | step |", "|---|---|---|---|---|"]
    for name in ("titan", "dense", "kimi"):
        if r := rows.get(name):
            lines.append(f"| {r['model']} ({name}) | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.2f}% | "
                         f"{r['peak_mem_bytes'] / 2**30:.2f} GiB | {1e3 * r['step_s']:.0f} ms |")
    lines += [ratio(rows, "kimi", "dense")] + ([ratio(rows, "dense", "titan")] if "titan" in rows else [])
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kimi", default="1b", help="the Kimi preset")
    parser.add_argument("--dense", default="dense_1b", help="its dense peer's preset")
    parser.add_argument("--dense-set", nargs="*", default=[], help="overrides for the dense peer only")
    parser.add_argument("--batch", type=int, default=4, help="sequences per step, both models")
    parser.add_argument("--steps", type=int, default=10, help="timed steps, both models")
    parser.add_argument("--set", nargs="*", default=[], help="overrides for both, e.g. trainer.seq_len=4096 "
                        "trainer.precision=bf16 parallel.compile=true")
    parser.add_argument("--titan", action="store_true", help="also train torchtitan's Llama of the dense "
                        "shape")
    parser.add_argument("--titan-site", type=Path, default=None, help="where torchtitan and its packages are "
                        "installed (default: $TITAN_SITE, else .venv/titan, else importable already)")
    parser.add_argument("--kimi-result", type=Path, default=None,
                        help="bench/parallel.py's JSON of the Kimi preset measured with the same --batch, "
                             "--steps and --set (gpu-check's train step): its row instead of training it "
                             "again")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "peer.json")
    args = parser.parse_args(argv)
    rows: dict = {}

    def save() -> None:  # after each row: a run stopped by a time limit keeps the rows it measured
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"batch": args.batch, "steps": args.steps, "set": args.set,
                                        "dense_set": args.dense_set, **rows}, indent=2) + "\n")

    reused = reuse(args)
    rows["kimi"] = {"model": args.kimi, **(reused or measure(args.kimi, args, []))}
    if reused:
        rows["kimi"]["reused"] = str(args.kimi_result)
        print(f"[peer] {args.kimi}: the row of {args.kimi_result}", flush=True)
    save()
    rows["dense"] = {"model": args.dense, **measure(args.dense, args, args.dense_set)}
    save()
    if args.titan:
        from titan_peer import Unusable

        try:
            rows["titan"] = titan(args, rows["dense"])
        except Unusable as e:  # this machine's torch cannot run the torchtitan carried: said, not failed
            print(f"[peer] torchtitan not run: {e}", flush=True)
            rows["titan_skipped"] = str(e)
        save()
    device = rows["kimi"]["device"]
    print(f"\n{args.batch} sequences per step, {args.steps} timed steps, {' '.join(args.set) or 'defaults'}; "
          f"{device}\n\n{table(rows)}")
    print(f"\nwrote {args.out}")


def reuse(args) -> dict | None:
    """The Kimi row of --kimi-result when it measured what this run would: the same preset, sequences per
    step, timed steps and overrides (None when there is no such file, or it differs)."""
    if args.kimi_result is None or not args.kimi_result.is_file():
        return None
    r = json.loads(args.kimi_result.read_text())
    measured = (r.get("model"), r.get("batch"), r.get("steps"), r.get("set"))
    same = measured == (args.kimi, args.batch, args.steps, args.set)
    single = r.get("layouts", {}).get("single")
    return single[0] if same and single else None


if __name__ == "__main__":
    main()
