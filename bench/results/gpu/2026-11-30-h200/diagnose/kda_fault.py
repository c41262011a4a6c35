"""Which KDA kernel faults on the GPU: every Triton launch synchronised and named."""
import os, sys, itertools, torch, torch.nn.functional as F
import triton.runtime.jit as J
sys.path.insert(0, os.getcwd())
from kimi.ops.kda import chunk_kda, fused_recurrent_kda

orig = J.JITFunction.run
def run(self, *a, **kw):
    r = orig(self, *a, **kw)
    if not kw.get("warmup"):
        try:
            torch.cuda.synchronize()
        except Exception as e:
            meta = {n: v for n, v in zip(self.arg_names, a) if not torch.is_tensor(v)}
            shapes = {n: (tuple(v.shape), str(v.dtype)) for n, v in zip(self.arg_names, a) if torch.is_tensor(v)}
            print("FAULT in", self.fn.__name__, "grid", kw.get("grid"), meta, shapes, flush=True)
            os._exit(3)
        print("  ok", self.fn.__name__, flush=True)
    return r
J.JITFunction.run = run

case = sys.argv[1]
dev = "cuda"
dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[sys.argv[2]]
beta_dt = dt if sys.argv[3] == "same" else torch.float32
H, d = int(sys.argv[4]), 128
docs = [int(x) for x in sys.argv[5].split(",")]
T = sum(docs)
cu = torch.tensor([0, *itertools.accumulate(docs)], device=dev)
gen = torch.Generator(device=dev).manual_seed(0)
q, k, v, g = (torch.randn(1, T, H, d, generator=gen, device=dev) for _ in range(4))
q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
g = -F.softplus(g)
beta = torch.sigmoid(torch.randn(1, T, H, generator=gen, device=dev)).to(beta_dt)
q, k, v = (x.to(dt) for x in (q, k, v))
h0 = torch.randn(len(docs), H, d, d, device=dev) if case != "noinit" else None
leaves = [x.requires_grad_() for x in (q, k, v, g, beta)] + ([h0.requires_grad_()] if h0 is not None else [])
print("case", sys.argv[1:], flush=True)
o, s = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend="triton")
print(" fwd done", o.float().norm().item(), flush=True)
gr = torch.autograd.grad((o, s), leaves, (torch.randn_like(o), torch.randn_like(s)))
print(" bwd done", [x.float().norm().item() for x in gr], flush=True)
