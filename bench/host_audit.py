"""The host side of a training micro-batch, measured on a CPU: how many ops the host dispatches and how long
it takes to issue them, eagerly and with parallel.compile=true, next to the GPU time the roofline predicts for
the same micro-batch (bench/step_audit.py --parts host; its `host` entry of bench/results/step_audit.json).

A GPU step is host-bound when issuing its kernels takes longer than running them. Neither needs a GPU to be
counted, only to be timed, so each is measured where the compute is negligible, the kernels dispatched as on
a CUDA device (`as_on_cuda`: the Triton KDA and attention custom ops, the fused gate and norm kernels, not the
CPU fallbacks):

* eager, on the meta device: the model at its real shape (1b, 4096 tokens), bf16 weights; meta tensors
  carry shapes but no data, so every op costs only its Python and dispatcher time. The ops counted are
  every aten op the dispatcher sees (a TorchDispatchMode), and those that are not views (a view launches no
  kernel): the eager step's kernel launches, each of which a GPU host pays for (about 5 us per launch
  through CUDA, before any Python).
* compiled, on the CPU at a tiny width (`proxy`): the same depth, layer pattern, heads and sublayer kinds,
  every width cut to a few elements per head, one row of 64 tokens (the loss in one chunk, as at 4096), so
  dynamo traces the same graphs with the same breaks and inductor emits the same kernels per graph, and the
  kernels themselves cost little. Our Triton custom ops run as null kernels there (zeros of their
  outputs' shapes: their fake implementations), which is what their host side costs: one call. The host time
  is the step's median wall time over several steps after warm-up less the median CPU time its matmuls
  and inductor's kernels took in as many profiled steps (at 16 elements per head `1b`'s proxy is 256 wide:
  its matmuls were about half of the step's time on a 2-core CPU, compute a GPU does), the ops those the
  profiler sees dispatched (aten ops and our custom ops) plus inductor's own kernels (each a launch on a
  GPU). The same proxy run eagerly checks the proxy: its host time against the meta device's at full
  shape.

`host_ms_gpu` adds what the proxy cannot show, a CUDA launch per kernel (LAUNCH_US), to the measured time; the
ratio to the roofline's predicted GPU time is what decides whether the step waits on its host.

parallel.cuda_graphs (kimi/parallel/cuda_graphs.py) is predicted from the same proxy, since graphs need a GPU:
* regions: the compiled step's host time outside its regions (the profiled wall time less every region's
  call, forward and backward, less the compute outside them; an upper bound, as the profiler's own cost of
  the ops out there stays in) and their launches, plus REPLAY_US for each region call;
* step: StepGraph's own host part, measured on the proxy with a replay that costs nothing (the batch copied
  in, the gradients' addresses checked, the records and the loss copied out), with a launch per copy, plus
  one launch of a graph holding the compiled step's kernels (GRAPH_LAUNCH_US + GRAPH_NODE_US a kernel).
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# A CUDA kernel launch's host cost (cudaLaunchKernel through PyTorch's or Triton's launcher): about 5 us on a
# current x86 host; Triton's Python launcher adds more than PyTorch's C++ one.
LAUNCH_US = 5.0
# aten ops that only make a view of their input: no kernel runs
VIEWS = {"view", "_unsafe_view", "transpose", "t", "expand", "select", "slice", "unsqueeze", "squeeze",
         "detach",
         "alias", "as_strided", "permute", "split", "split_with_sizes", "unbind", "narrow", "_reshape_alias",
         "unflatten", "diagonal", "lift_fresh", "view_as_real", "view_as_complex", "_to_copy_view", "unfold",
         "expand_as", "view_as", "chunk", "movedim", "real", "imag"}
# parallel.cuda_graphs=regions: a compiled region replayed by inductor's cudagraph trees costs their
# checks of its inputs and outputs and a cudaGraphLaunch. The one breakdown published for it (pytorch/pytorch
# issue 150488, 2025: one graph) is 128 us of cudagraph-tree checks and 41 us of launch; it grows with a
# graph's inputs and outputs, so this is an estimate until a GPU measures ours.
REPLAY_US = 170.0
# parallel.cuda_graphs=step: one graph of the whole micro-batch. Launching a graph of N kernels took 15 us
# plus 0.58 us a kernel on the one published sweep we found (ahrefs/ocannl issue 488, 2026: chains of 8 to
# 117 kernels, CUDA 13.3), against 6.4 us a kernel launched one by one there.
GRAPH_LAUNCH_US, GRAPH_NODE_US = 15.0, 0.58
PROXY_T = 64  # tokens of the proxy's one row
# the ops whose CPU time on the proxy is compute a GPU does, not host work: at 16 elements per head `1b`'s
# proxy is 256 wide, and its ~500 matmuls a step take tens of milliseconds of the CPU's time
# (self time: a composite such as linear keeps only its own overhead, which is the host's)
COMPUTE = {"mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "mkldnn_convolution", "_convolution",
           "convolution_backward", "_scaled_dot_product_flash_attention_for_cpu",
           "_scaled_dot_product_flash_attention_for_cpu_backward"}


class DispatchCount(TorchDispatchMode):
    """Every aten (and custom) op the dispatcher runs, by name."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()
        self.custom: Counter = Counter()  # our own (kimi::) ops, the Triton kernels' host side

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        if func.namespace == "kimi":
            self.custom[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    @property
    def launches(self) -> int:
        return sum(n for op, n in self.ops.items() if op not in VIEWS)


@contextlib.contextmanager
def as_on_cuda():
    """Dispatch as on a CUDA device: `auto` picks the Triton kernels for every device, and their host code's
    device check lets CPU and meta tensors through (as it does for interpreted kernels) to the custom ops,
    which run on meta tensors or as null kernels here, never compiled or interpreted."""
    import kimi.ops.attention.triton.common as attention_common
    import kimi.ops.dispatch as dispatch
    import kimi.ops.kda.triton.common as kda_common

    saved = dispatch.auto_picks_triton
    modules = [m for m in list(sys.modules.values())
               if getattr(m, "__name__", "").startswith("kimi")
               and getattr(m, "auto_picks_triton", None) is saved]
    checks = [attention_common, kda_common]
    interpret = [m.INTERPRET for m in checks]
    for m in modules:
        m.auto_picks_triton = lambda device: True
    for m in checks:
        m.INTERPRET = True
    try:
        yield
    finally:
        for m in modules:
            m.auto_picks_triton = saved
        for m, value in zip(checks, interpret):
            m.INTERPRET = value


_NULLED = False


class _Spec:
    """An output's shape and dtype (a pytree leaf, unlike a tuple)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype


def null_kernels() -> list[str]:
    """Register, for CPU tensors, every kimi:: custom op as a null kernel: zeros of the shapes and dtypes its
    fake implementation gives (found once per input signature on meta tensors, then cached, so a call costs
    what a launch's host side does: argument handling and the output's allocation). Once per process (it
    replaces the ops' CPU kernels for good)."""
    global _NULLED
    import kimi.ops.attention.triton.op  # noqa: F401  (the ops exist once their modules are imported)
    import kimi.ops.kda.triton.gate  # noqa: F401
    import kimi.ops.kda.triton.op  # noqa: F401

    tree_map = torch.utils._pytree.tree_map
    names = sorted(n for n in dir(torch.ops.kimi) if not n.startswith("_") and n not in ("name",))
    if _NULLED:
        return names
    for name in names:
        op, shapes = getattr(torch.ops.kimi, name).default, {}

        def null(*args, _op=op, _shapes=shapes, **kwargs):
            key = tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else x
                        for x in (*args, *kwargs.values()))
            if key not in _shapes:
                meta = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, (args, kwargs))
                _shapes[key] = tree_map(lambda x: _Spec(x.shape, x.dtype)
                                        if isinstance(x, torch.Tensor) else x,
                                        _op(*meta[0], **meta[1]))
            return tree_map(lambda x: torch.zeros(x.shape, dtype=x.dtype) if isinstance(x, _Spec) else x,
                            _shapes[key])

        torch.library.register_kernel(f"kimi::{name}", "cpu", null)
    _NULLED = True
    return names


def proxy_overrides(cfg) -> list[str]:
    """Overrides that keep a preset's depth, pattern, heads and sublayer kinds and cut every width to a few
    elements per head (the proxy)."""
    m = cfg.model
    heads = max(m.kda.num_heads, m.mla.num_heads, m.mha.num_heads)
    d = 16 * heads  # every projection keeps its shape's structure; heads of 16 elements
    out = [f"model.d_model={d}", f"model.mlp.hidden={2 * d}", "model.vocab_size=256",
           "model.kda.head_dim=16", "model.mla.qk_nope_head_dim=16", "model.mla.v_head_dim=16",
           f"model.mla.kv_lora_rank={min(m.mla.kv_lora_rank, 32)}", "model.mha.head_dim=16"]
    out += [f"model.mla.qk_rope_head_dim={min(m.mla.qk_rope_head_dim, 8)}"] if m.mla.qk_rope_head_dim else []
    out += [f"model.mla.q_lora_rank={min(m.mla.q_lora_rank, 32)}"] if m.mla.q_lora_rank else []
    if m.moe.num_experts:
        out += [f"model.moe.hidden={d}"] + ([f"model.moe.latent_dim={d // 2}"] if m.moe.latent_dim else [])
    return out


def _step(model, ids, labels, loss_of):
    model.zero_grad(set_to_none=True)  # as the optimizer leaves them: no gradient to add into
    loss = loss_of(model, ids, labels)
    loss.backward()
    return loss


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def eager_on_meta(cfg, T: int, build, batch, loss_of, repeats: int = 3) -> dict:
    """Dispatched ops and host time of one eager fwd+bwd at the real shape, on the meta device."""
    with as_on_cuda():
        model = build(cfg, "meta", torch.bfloat16)
        ids, labels = batch(cfg.model.vocab_size, T, "meta")
        _step(model, ids, labels, loss_of)  # first calls: probes, caches
        count = DispatchCount()
        with count:
            _step(model, ids, labels, loss_of)
        seconds = _timed(lambda: _step(model, ids, labels, loss_of), repeats)
    return {"ops": sum(count.ops.values()), "launches": count.launches, "host_ms": 1e3 * seconds,
            "top_ops": dict(count.ops.most_common(12)), "custom_ops": dict(count.custom)}


# A compiled region's call as the profiler names it: its forward (dynamo's frame) and its backward (the
# autograd node AOTAutograd made of it). A CUDA graph would replay all that either runs.
REGION_FORWARD, REGION_BACKWARD = "Torch-Compiled Region", "CompiledFunctionBackward"


def _is_region(name: str) -> bool:
    return name.startswith(REGION_FORWARD) or name.endswith(REGION_BACKWARD)


def _in_region(e) -> bool:
    while e is not None:
        if _is_region(e.name):
            return True
        e = e.cpu_parent
    return False


def _profiled_counts(fn) -> dict:
    """What one call dispatches and where its time goes, from the profiler: aten and custom ops dispatched
    from the top and inductor's kernels; compiled regions called (forward, and backward nodes run); the
    milliseconds the CPU spent computing in matmuls and inductor's kernels; the call's wall milliseconds;
    and, for a CUDA-graph replay of each region, the part outside the regions: the wall milliseconds
    outside every region's call less the compute there, and the ops launched there."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        fn()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    out = Counter()
    for e in prof.events():
        name = e.name
        if name.startswith(("aten::", "kimi::")) and name.split("::", 1)[1] not in VIEWS:
            # only ops called by Python or a compiled graph, not the ops an op calls inside itself
            parent = e.cpu_parent
            inside = _in_region(e)
            if parent is None or not parent.name.startswith(("aten::", "kimi::")):
                out["dispatched"] += 1
                out["outside_launches"] += not inside
            if name.split("::", 1)[1] in COMPUTE:
                out["compute_us"] += e.self_cpu_time_total
                out["outside_compute_us"] += 0 if inside else e.self_cpu_time_total
        elif "cpp_fused" in name or name.startswith("triton_"):  # inductor's kernels (graph_N_cpp_fused_*)
            out["kernels"] += 1
            out["compute_us"] += e.self_cpu_time_total
        elif e.cpu_parent is None and _is_region(name):
            out["graphs" if name.startswith(REGION_FORWARD) else "backward_graphs"] += 1
            out["regions_us"] += e.cpu_time_total
    return {"dispatched": out["dispatched"], "kernels": out["kernels"], "graphs": out["graphs"],
            "backward_graphs": out["backward_graphs"], "compute_ms": out["compute_us"] / 1e3,
            "wall_ms": wall_ms, "outside_launches": out["outside_launches"],
            "outside_host_ms": wall_ms - (out["regions_us"] + out["outside_compute_us"]) / 1e3}


def proxy_step(cfg, compiled: bool, build, batch, loss_of, repeats: int = 7) -> dict:
    """The proxy (tiny width, PROXY_T tokens, null custom kernels) eager or compiled as parallel.compile
    compiles the model: host time per micro-batch and what it dispatches."""
    import torch._inductor.config as inductor

    from kimi.parallel import apply_compile

    null_kernels()
    torch.set_num_threads(1)
    # inductor names its kernels to the profiler (a cached graph compiled without that would not)
    with as_on_cuda(), inductor.patch({"cpp.enable_kernel_profile": True, "fx_graph_cache": False}):
        model = build(cfg, "cpu")
        if compiled:
            apply_compile(model)
        ids, labels = batch(cfg.model.vocab_size, PROXY_T, "cpu")
        t0 = time.perf_counter()
        _step(model, ids, labels, loss_of)  # compiles
        compile_s = time.perf_counter() - t0
        for _ in range(2):
            _step(model, ids, labels, loss_of)
        model.zero_grad(set_to_none=True)
        seconds = _timed(lambda: _step(model, ids, labels, loss_of), repeats)
        profiled = [_profiled_counts(lambda: _step(model, ids, labels, loss_of)) for _ in range(repeats)]
    first = profiled[0]

    def median(key: str) -> float:
        return statistics.median(p[key] for p in profiled)

    # the host's part: the step's median time less the median time its kernels computed in the profiled
    # steps (a GPU host pays for a launch instead, added by audit_host). Not each profiled step's own wall
    # time: the profiler adds about 10 us an op, as much as the eager step's own dispatch
    compute_ms = median("compute_ms")
    return {"host_ms": 1e3 * seconds - compute_ms, "step_ms": 1e3 * seconds, "kernel_compute_ms": compute_ms,
            "profiled_step_ms": median("wall_ms"),
            "dispatched": first["dispatched"], "inductor_kernels": first["kernels"],
            "launches": first["dispatched"] + first["kernels"], "compiled_regions": first["graphs"],
            "region_calls": first["graphs"] + first["backward_graphs"],
            # what a CUDA graph per region would leave: profiled, so an upper bound (the profiler's cost
            # of the ops outside the regions stays in)
            "outside_regions": {"host_ms": median("outside_host_ms"), "launches": first["outside_launches"]},
            "first_step_s": compile_s}


class _NullGraphs:
    """CUDA graphs whose replay costs nothing (the capture runs the micro-batch once, for its outputs): what
    is left of a StepGraph call is the host's own part, the batch copied in, the gradients' addresses
    checked, the records and the loss copied out."""

    @contextlib.contextmanager
    def side_stream(self):
        yield

    def capture(self, run):
        return None, run()

    def replay(self, graph) -> None:
        pass


def step_graph_host(cfg, build, batch, loss_of, repeats: int = 21, null: bool = True) -> dict:
    """parallel.cuda_graphs=step on the proxy: the host's milliseconds per micro-batch outside the graph, and
    the kernels it launches there (copies in and out), with QK-Clip's max logits recorded as in training.
    null=False keeps the custom ops' own CPU kernels (a test's process, where Triton runs interpreted)."""
    from kimi.data import Batch
    from kimi.parallel.cuda_graphs import StepGraph

    if null:
        null_kernels()
    torch.set_num_threads(1)
    model = build(cfg, "cpu")
    model.record_max_logits(True)
    ids, labels = batch(cfg.model.vocab_size, PROXY_T, "cpu")
    micro = Batch(input_ids=ids, labels=labels, doc_starts=torch.zeros_like(ids, dtype=torch.bool), epoch=0,
                  step=0)

    def run(b, scale):
        loss = loss_of(model, b.input_ids, b.labels)
        (loss * scale).backward()
        return loss

    def failed(line: str):
        raise RuntimeError(line)

    graph = StepGraph(model, run, _NullGraphs(), warmup=0, log=failed)
    with as_on_cuda():
        graph(micro, 1.0)  # captures
        count = DispatchCount()
        with count:
            graph(micro, 1.0)
        seconds = _timed(lambda: graph(micro, 1.0), repeats)
    return {"host_ms": 1e3 * seconds, "launches": count.launches, "records": len(graph.captured.effects),
            "parameters": len(graph.captured.grads)}


def audit_host(name: str, overrides: list[str], T: int, compose, build, batch, loss_of,
               predicted_gpu_s: dict | None = None) -> dict:
    """The host table's row of one family: eager at its real shape on meta, the proxy eager and compiled,
    and the predicted host time on a GPU against the roofline's GPU time (predicted_gpu_s: {gpu: s})."""
    # the Triton attention kernel: auto times it against SDPA on a real GPU (each issues about as many ops)
    overrides = [*overrides, "model.attention.backend=triton"]
    cfg = compose(overrides)
    eager = eager_on_meta(cfg, T, build, batch, loss_of)
    proxy_cfg = compose([*overrides, *proxy_overrides(cfg)])
    proxy = {"eager": proxy_step(proxy_cfg, False, build, batch, loss_of),
             "compiled": proxy_step(proxy_cfg, True, build, batch, loss_of),
             "step_graph": step_graph_host(proxy_cfg, build, batch, loss_of)}
    row = {"T": T, "eager_meta": eager, "proxy": proxy, "proxy_overrides": proxy_overrides(cfg),
           "launch_us": LAUNCH_US}
    c = proxy["compiled"]
    row["compiled_host_ms_gpu"] = c["host_ms"] + c["launches"] * LAUNCH_US / 1e3
    row["eager_host_ms_gpu"] = eager["host_ms"] + eager["launches"] * LAUNCH_US / 1e3
    row["ops_eager_over_compiled"] = eager["ops"] / max(1, c["dispatched"] + c["inductor_kernels"])
    # parallel.cuda_graphs, predictions until the GPU check's train_graphs step measures them. regions: each
    # region's forward and backward replayed (REPLAY_US a call), the rest as compiled now. step: the
    # compiled micro-batch's kernels in one graph, launched once, and StepGraph's own host part
    out, sg = c["outside_regions"], proxy["step_graph"]
    row["replay_us"], row["graph_launch_us"] = REPLAY_US, [GRAPH_LAUNCH_US, GRAPH_NODE_US]
    row["regions_host_ms_gpu"] = (out["host_ms"] + out["launches"] * LAUNCH_US / 1e3
                                  + c["region_calls"] * REPLAY_US / 1e3)
    row["step_graph_host_ms_gpu"] = (sg["host_ms"] + sg["launches"] * LAUNCH_US / 1e3
                                     + (GRAPH_LAUNCH_US + GRAPH_NODE_US * c["launches"]) / 1e3)
    if predicted_gpu_s:
        row["gpu_s"] = predicted_gpu_s
        row["host_share"] = {gpu: row["compiled_host_ms_gpu"] / (1e3 * s)
                             for gpu, s in predicted_gpu_s.items()}
    return row
