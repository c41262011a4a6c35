"""torchrun worker for tests/parallel/test_expert_parallel.py: kimi.parallel.expert_parallel.experts_parallel
on each rank's tokens with that rank's slice of the experts; writes OUT_DIR/rank<r>.pt with the output and the
gradients of a fixed loss (tokens, routing weights, local experts).

    torchrun --nproc_per_node N tests/dist_experts.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))
from expert_problem import E, rank_problem, weights  # noqa: E402

from kimi.parallel.expert_parallel import experts_parallel  # noqa: E402

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
x, experts, routing, out_grad = rank_problem(rank)
local = slice(rank * E // world, (rank + 1) * E // world)
mine = [w[local].clone().requires_grad_() for w in weights()]
x.requires_grad_()
routing.requires_grad_()
y = experts_parallel(x, experts, routing, *mine, dist.group.WORLD)
grads = torch.autograd.grad((y * out_grad).sum(), [x, routing, *mine])
torch.save({"y": y.detach(), "grads": grads}, Path(sys.argv[1]) / f"rank{rank}.pt")
dist.barrier()
dist.destroy_process_group()
