"""Expert parallelism's dispatch and combine (kimi/parallel/expert_parallel.py) under torchrun with gloo on
CPU: each rank's output and the gradients of its tokens, routing weights and its slice of the experts
equal one process running every rank's tokens through all experts (kimi.model.moe.experts_grouped), in
fp64, at ep = 2 and ep = 4, with uneven token counts, a rank that sends nothing to half the ranks and an
expert that receives nothing."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from expert_problem import E, rank_problem, weights
from kimi.model.moe import experts_grouped

pytestmark = pytest.mark.dist

TESTS = Path(__file__).parents[1]


@pytest.mark.parametrize("ep", [2, 4])
def test_experts_parallel_equals_one_process(tmp_path, ep):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ep}",
           str(TESTS / "dist_experts.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    problems = [rank_problem(r) for r in range(ep)]
    x, experts, routing, out_grad = (torch.cat(parts) for parts in zip(*problems))
    full = [w.clone().requires_grad_() for w in weights()]
    x.requires_grad_()
    routing.requires_grad_()
    y = experts_grouped(x, experts, routing, *full)
    dx, drouting, *dfull = torch.autograd.grad((y * out_grad).sum(), [x, routing, *full])
    start = 0
    for r in range(ep):
        got = torch.load(tmp_path / f"rank{r}.pt")
        n = problems[r][0].shape[0]
        rows, local = slice(start, start + n), slice(r * E // ep, (r + 1) * E // ep)
        torch.testing.assert_close(got["y"], y[rows].detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["grads"][0], dx[rows], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["grads"][1], drouting[rows], rtol=1e-12, atol=1e-12)
        for g, want in zip(got["grads"][2:], dfull):
            torch.testing.assert_close(g, want[local], rtol=1e-12, atol=1e-12)
        start += n
    assert dfull[0][6].abs().sum() == 0  # the expert nobody chose
