"""The step priced as parallel.compile=true runs it on a GPU, next to the unfused roofline
(bench/step_audit.py --parts compiled; its `compiled` entry of bench/results/step_audit.json).

The unfused roofline prices every aten op as its own kernel. With parallel.compile=true each sublayer and
each depth mix (with its pre-norm) is one compiled region: Inductor generates fused kernels for its
elementwise ops and reductions and calls the rest (matmuls, our Triton custom ops) as extern kernels. So the
compiled step is priced in four parts, at the GPU shape (one row of T tokens, bf16 weights):

* outside the regions (embedding, the chunked loss, gradient accumulation), and the matmuls and our custom
  ops inside them: priced as the unfused roofline prices them, from the same meta-device trace. What is
  inside a region is known exactly: torch.compile is replaced, for the trace, by a marker that wraps what
  apply_compile would compile (`Regions`), so the regions are the trainer's own.
* every other op inside a region: replaced by the kernels Inductor generates for it, priced at their bytes
  over the HBM bandwidth. The bytes are Inductor's own count (each generated kernel's reads and writes after
  fusion, as its metrics log reports them), from compiling the step at its real widths on this CPU (bf16
  weights, our custom ops as null kernels: they are extern and not counted). A kernel's bytes are linear in
  the tokens (a per-token part, and a weight-sized part such as a norm weight's gradient), so the counts at
  two short lengths fix the line that gives T: compiling at 4,096 tokens on a CPU would take hours.
* the gradient sums autograd's engine makes between regions: a region input that several regions read gets
  one gradient from each, and the engine adds them outside every graph (`accumulations`, counted in the
  same CPU run's profile). The eager trace runs those adds under the region's backward node, so they are
  among the marked ops that the Inductor kernels replace, and are added back here.

Where it can be off: Inductor's C++ backend fuses as its Triton backend does (one scheduler) but not always
identically: it may fuse loops a GPU launches as separate kernels (outer-loop fusion), and the GPU backend
may split large reductions into two kernels. Every kernel is priced at its bytes alone: no launch latency,
no tail effect, no kernel below its bandwidth; the matmuls at the datasheet peak. It is a ceiling, like the
unfused roofline.
"""

from __future__ import annotations

import functools
import logging
import time
from unittest import mock

import torch

# the depth mix through Inductor (the fused Triton kernel would be one extern op); KDA and attention are our
# Triton ops in the trace (step_audit.trace_step) and null kernels on the CPU run: extern either way
OVERRIDES = ["model.attnres.backend=compile"]
KEEP_IN_REGION = "kimi"  # our custom ops' namespace: extern kernels inside a region, priced as unfused


class Regions:
    """Marks the ops of an eager step that run inside what apply_compile compiles: forward ops while a
    region's function runs, backward ops whose autograd node one created (autograd numbers its nodes in
    creation order, so each region call is an interval of those numbers)."""

    def __init__(self):
        self.depth, self.spans = 0, []

    def compile(self, fn=None, **_kwargs):
        """Stands in for torch.compile: fn, marked."""
        if fn is None:
            return self.compile

        @functools.wraps(fn)
        def marked(*args, **kwargs):
            start = torch._C._autograd._get_sequence_nr()
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1
                self.spans.append((start, torch._C._autograd._get_sequence_nr()))

        return marked

    def inside(self) -> bool:
        if self.depth:
            return True
        node = torch._C._current_autograd_node()
        if node is None:
            return False
        n = node._sequence_nr()
        return any(a <= n < b for a, b in self.spans)

    def apply(self, model) -> None:
        """apply_compile(model), each compiled function marked instead."""
        from kimi.model.attnres import compiled_depth_attention
        from kimi.parallel import apply_compile

        compiled_depth_attention.cache_clear()  # a cached one would hold real compiled functions
        try:
            with mock.patch("torch.compile", self.compile):
                apply_compile(model)
        finally:
            compiled_depth_attention.cache_clear()


def absorbed(op: str, matmuls: set[str]) -> bool:
    """Whether Inductor generates the kernel of this op in a region (not a matmul or one of our ops)."""
    return op not in matmuls and not op.startswith(KEEP_IN_REGION + "::")


def inductor_kernels(cfg, T: int, build, batch, loss_of) -> dict:
    """Compile one training step of cfg's model at T tokens on this CPU (bf16 weights) as parallel.compile
    does, and count, per step, the kernels Inductor generates and their bytes (each compiled graph's kernels
    times the calls of that graph; a graph's backward runs once per forward call)."""
    import torch._dynamo
    import torch._inductor.config as inductor
    from torch._inductor import compile_fx as compile_fx_module
    from torch._inductor import metrics
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    from torch.profiler import ProfilerActivity, profile

    from host_audit import as_on_cuda, null_kernels  # bench/, beside this script
    from kimi.model.attnres import compiled_depth_attention
    from kimi.parallel import apply_compile

    graphs: list[dict] = []

    def backend(gm, example_inputs):
        g = {"calls": 0, "kernels": 0, "bytes": 0, "extern": 0}
        graphs.append(g)

        def inner(*args, **kwargs):  # forward and backward graphs: both are this region's
            before = len(metrics.nodes_num_elem)
            out = compile_fx_inner(*args, **kwargs)
            for node, words in metrics.nodes_num_elem[before:]:  # (scheduler node, its bytes // 4)
                kind = type(node).__name__
                if kind == "ExternKernelSchedulerNode":
                    g["extern"] += 1
                elif kind != "NopKernelSchedulerNode":
                    g["kernels"] += 1
                    g["bytes"] += 4 * words
            return out

        compiled = compile_fx(gm, example_inputs, inner_compile=inner)

        def run(*args):
            g["calls"] += 1
            return compiled(*args)

        return run

    null_kernels()
    torch._dynamo.reset()
    compiled_depth_attention.cache_clear()
    real_compile = torch.compile
    # Inductor counts its kernels' bytes when its metrics log is on (its level; nothing is printed)
    level = compile_fx_module.inductor_metrics_log.level
    compile_fx_module.inductor_metrics_log.setLevel(logging.INFO)
    try:
        with as_on_cuda(), inductor.patch({"fx_graph_cache": False}), \
                torch._dynamo.config.patch(automatic_dynamic_shapes=False), \
                mock.patch("torch.compile", functools.partial(real_compile, backend=backend)):
            model = build(cfg, "cpu", torch.bfloat16)
            apply_compile(model)
            ids, labels = batch(cfg.model.vocab_size, T, "cpu")
            t0 = time.perf_counter()
            loss_of(model, ids, labels).backward()  # compiles
            compile_s = time.perf_counter() - t0
            for g in graphs:
                g["calls"] = 0
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                loss_of(model, ids, labels).backward()  # counted
            sums = accumulations(prof.events())
    finally:
        compile_fx_module.inductor_metrics_log.setLevel(level)
        compiled_depth_attention.cache_clear()
        torch._dynamo.reset()
    return {"T": T, "graphs": len(graphs), "region_calls": sum(g["calls"] for g in graphs), **sums,
            "kernels": sum(g["calls"] * g["kernels"] for g in graphs),
            "extern": sum(g["calls"] * g["extern"] for g in graphs),
            "bytes": sum(g["calls"] * g["bytes"] for g in graphs), "first_step_s": compile_s}


ENGINE = "autograd::engine::evaluate_function: CompiledFunctionBackward"
SIZES = {"c10::BFloat16": 2, "c10::Half": 2, "float": 4, "double": 8}  # the profiler's dtype names


def accumulations(events) -> dict:
    """The gradient sums autograd's engine makes outside the compiled graphs, for a region's input that
    other regions also read (under Block AttnRes a block's sum feeds every later depth mix): an add each,
    which the eager trace runs under the region's backward node (so Regions marks it inside) but Inductor
    never sees. {"accumulations": calls, "accumulation_bytes": two operands read and one written}."""
    calls, nbytes = 0, 0
    for e in events:
        if e.name not in ("aten::add_", "aten::add") or e.cpu_parent is None or e.cpu_parent.name != ENGINE:
            continue
        numel = 1
        for n in (e.input_shapes or [[0]])[0]:
            numel *= n
        size = SIZES.get((e.input_dtypes or ["?"])[0], 4)
        calls, nbytes = calls + 1, nbytes + 3 * numel * size
    return {"accumulations": calls, "accumulation_bytes": nbytes}


def at(T: int, a: dict, b: dict, key: str = "bytes") -> float:
    """A per-step byte count (Inductor's kernels', or the engine's sums) at T tokens, on the line through two
    compiled lengths."""
    slope = (b[key] - a[key]) / (b["T"] - a["T"])
    return a[key] + slope * (T - a["T"])


def price(rows: list[dict], fused_bytes: float, model_flops: float, gpus: dict, matmuls: set[str],
          accumulation_bytes: float = 0.0) -> dict:
    """{gpu: the compiled step's predicted time by part and its MFU ceiling}, from the unfused roofline's
    priced rows at the same T (each with `region`: traced inside a compiled region), Inductor's bytes and
    the engine's gradient sums between regions (accumulations)."""
    out = {}
    for gpu, peak in gpus.items():
        parts = {"matmuls": 0.0, "custom ops": 0.0, "eager, outside regions": 0.0, "absorbed (unfused)": 0.0}
        for r in rows[gpu]:
            if r["region"] and absorbed(r["op"], matmuls):
                parts["absorbed (unfused)"] += r["time_s"]
            elif r["op"] in matmuls:
                parts["matmuls"] += r["time_s"]
            elif r["op"].startswith(KEEP_IN_REGION + "::"):
                parts["custom ops"] += r["time_s"]
            else:
                parts["eager, outside regions"] += r["time_s"]
        parts["inductor kernels"] = fused_bytes / peak["bandwidth"]
        parts["gradient sums between regions"] = accumulation_bytes / peak["bandwidth"]
        unfused = sum(r["time_s"] for r in rows[gpu])
        compiled = (unfused - parts["absorbed (unfused)"] + parts["inductor kernels"]
                    + parts["gradient sums between regions"])
        kept = [r for r in rows[gpu] if not (r["region"] and absorbed(r["op"], matmuls))]
        out[gpu] = {"unfused_step_s": unfused, "compiled_step_s": compiled, "parts_s": parts,
                    "top_kept": kept[:12],
                    "mfu_ceiling_unfused": model_flops / peak["bf16"] / unfused,
                    "mfu_ceiling": model_flops / peak["bf16"] / compiled,
                    "matmuls_at_peak_s": model_flops / peak["bf16"]}
    return out


def report(results: dict) -> list[str]:
    """The compiled roofline's table (--parts compiled)."""
    rows = [(name, r["compiled"]) for name, r in results["families"].items() if "compiled" in r]
    if not rows:
        return []
    lines = ["", "The step as parallel.compile=true runs it (one row of T tokens; "
             "bench/compiled_roofline.py), H200 ms:", "",
             "| family | T | unfused roofline | compiled roofline | matmuls | our custom ops | eager outside "
             "regions | region ops unfused | their Inductor kernels (bytes) | gradient sums between "
             "regions (adds) | kernels per step | MFU ceiling unfused / compiled |", "|" + "---|" * 12]
    for name, c in rows:
        g = c["gpus"]["H200"]
        p = {k: 1e3 * v for k, v in g["parts_s"].items()}
        lines.append(f"| {name} | {c['T']} | {1e3 * g['unfused_step_s']:,.1f} | "
                     f"{1e3 * g['compiled_step_s']:,.1f} | "
                     f"{p['matmuls']:,.1f} | {p['custom ops']:,.1f} | {p['eager, outside regions']:,.1f} | "
                     f"{p['absorbed (unfused)']:,.1f} | {p['inductor kernels']:,.1f} "
                     f"({c['inductor_bytes'] / 1e9:,.1f} GB) | "
                     f"{p.get('gradient sums between regions', 0):,.1f} ({c.get('accumulations', 0)}) | "
                     f"{c['kernels_per_step']:,} | "
                     f"{g['mfu_ceiling_unfused']:.0%} / {g['mfu_ceiling']:.0%} |")
    return lines
