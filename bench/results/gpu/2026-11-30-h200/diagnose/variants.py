"""chunk_bwd_kernel launch variants: does one avoid the half-precision fault, and is it right?"""
import os, sys, torch, torch.nn.functional as F
sys.path.insert(0, os.getcwd())
import kimi.ops.kda.triton.chunk_bwd as cb
from kimi.ops.kda import chunk_kda

warps, stages, bkc = (int(x) for x in sys.argv[1:4])
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[sys.argv[4]]
orig_tiles = cb.tiles
cb.tiles = lambda K, V: orig_tiles(K, V)._replace(BKC=bkc)
class Proxy:
    def __init__(s, k): s.k = k
    def __getitem__(s, grid):
        f = s.k[grid]
        return lambda *a, **kw: f(*a, **{**kw, "num_warps": warps, "num_stages": stages})
cb.chunk_bwd_kernel = Proxy(cb.chunk_bwd_kernel)

dev, H, d, T = "cuda", 4, 128, 300
cu = torch.tensor([0, 100, 101, 300], device=dev)
gen = torch.Generator(device=dev).manual_seed(0)
q, k, v, g = (torch.randn(1, T, H, d, generator=gen, device=dev) for _ in range(4))
q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
g = -F.softplus(g)
beta = torch.sigmoid(torch.randn(1, T, H, generator=gen, device=dev))
h0 = torch.randn(3, H, d, d, device=dev)
do = torch.randn(1, T, H, d, device=dev, generator=gen)
res = {}
for dt in (torch.float32, dtype):
    leaves = [x.to(dt if i < 3 else x.dtype).detach().requires_grad_() for i, x in enumerate((q, k, v, g, beta, h0))]
    o, s = chunk_kda(*leaves[:5], initial_state=leaves[5], output_final_state=True, cu_seqlens=cu, backend="triton")
    grads = torch.autograd.grad(o, leaves, do.to(dt))
    torch.cuda.synchronize()
    res[dt] = [o, *grads]
err = [((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(res[dtype], res[torch.float32])]
print(f"variant warps={warps} stages={stages} BKC={bkc} {sys.argv[4]}: OK, rel err vs fp32 (o dq dk dv dg dbeta dh0):",
      " ".join(f"{e:.1e}" for e in err), flush=True)
