"""Where 1b's compiled bf16 step spends the GPU (2026-12-04 gpu-check: GPU busy 97% of 1033 ms, aten::mul 236 ms
and elementwise kernels 142 ms on top): the micro-batch's forward+backward and the optimizer step timed apart
with CUDA events, and each profiled with input shapes, so an eager elementwise op names its tensors.

    python3 where_time.py OUT_DIR      (from the repository root, on a CUDA machine; the gpu-check wheels)
"""

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from torch.profiler import ProfilerActivity, profile

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))
from kimi.config import register_configs  # noqa: E402
from kimi.data.synthetic import write_corpus  # noqa: E402
from kimi.trainer import Trainer  # noqa: E402

out = Path(sys.argv[1])
out.mkdir(parents=True, exist_ok=True)
work = Path(tempfile.mkdtemp())
corpus = write_corpus(work / "corpus", docs=200, sentences=400)
register_configs()
with initialize_config_dir(str(ROOT / "conf"), version_base=None):
    cfg = compose("config", overrides=[
        "model=1b", f"trainer.run_dir={work / 'run'}", "logging.wandb.mode=disabled", "trainer.checkpoint_every=0",
        "trainer.eval_every=0", "trainer.resume=false", "trainer.seq_len=4096", "trainer.micro_batch_size=4",
        "trainer.precision=bf16", "parallel.compile=true", "model.vocab_size=32000", "data=files",
        f"data.data_files=[{corpus}/*.txt]", f"data.cache_dir={work / 'data'}", "data.tokenizer.vocab_size=384",
        "data.val_fraction=0.15"])
t0 = time.perf_counter()
trainer = Trainer(cfg)
engine = trainer.engine
for _ in range(2):
    trainer.train_step()
print(f"start and 2 warm-up steps: {time.perf_counter() - t0:.0f} s", flush=True)


def timed(fn, n=3):
    ms = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ms.append(a.elapsed_time(b))
    return sorted(ms)[len(ms) // 2]


def trainer_steps(n=5):
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        trainer.train_step()
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t) / n


# the trainer's own step, then the same after one step under bench/parallel.py's CommCounter (a dispatch mode),
# as gpu-check's train row times it
sys.path.append(str(ROOT / "bench"))
from comm_count import CommCounter  # noqa: E402

plain_ms = trainer_steps()
with CommCounter():
    trainer.train_step()
after_counter_ms = trainer_steps()
print(json.dumps({"trainer_step_ms": plain_ms, "after_commcounter_step_ms": after_counter_ms}), flush=True)
(out / "steps.json").write_text(json.dumps({"trainer_step_ms": plain_ms, "after_commcounter_step_ms": after_counter_ms}))
if "--steps-only" in sys.argv:
    sys.exit(0)
batch = trainer.loader.next_batch()
fb_ms = timed(lambda: engine.forward_backward(batch, 1.0))
step_ms = timed(lambda: (engine.forward_backward(batch, 1.0), engine.step(1.0)))
result = {"forward_backward_ms": fb_ms, "forward_backward_and_step_ms": step_ms, "step_ms": step_ms - fb_ms}
print(json.dumps(result), flush=True)


def top(fn, name, n=25, shapes=True):
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(group_by_input_shape=shapes), key=lambda e: e.self_device_time_total,
                  reverse=True)[:n]
    found = [{"op": e.key[:90], "shapes": str(e.input_shapes)[:160], "ms": round(e.self_device_time_total / 1e3, 2),
              "calls": e.count} for e in rows if e.self_device_time_total > 0]
    total = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3
    result[name] = {"device_ms": total, "top": found}
    print(f"\n{name}: {total:.0f} ms of device time", flush=True)
    for r in found:
        print(f"{r['ms']:8.2f} ms {r['calls']:5d}x {r['op']:50s} {r['shapes']}", flush=True)
    (out / "where_time.json").write_text(json.dumps(result, indent=1))


top(lambda: engine.forward_backward(batch, 1.0), "forward_backward")
top(lambda: engine.forward_backward(batch, 1.0), "forward_backward_by_name", n=15, shapes=False)
engine.forward_backward(batch, 1.0)
top(lambda: engine.step(1.0), "optimizer_step")
