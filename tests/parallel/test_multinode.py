"""Two nodes on one machine: two torchrun agents meet through c10d's rendezvous on 127.0.0.1, as the
agents of two real nodes meet at the first node's address, and the job trains exactly what one process
trains (dp 2 with one rank per node; dp 2 x tp 2 with two per node, tp inside a node). The command is the
README's multi-node line, with HEAD=127.0.0.1 and the tiny test run's overrides appended."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers import free_port
from layout_runs import ROOT, assert_same_run, overrides

pytestmark = pytest.mark.dist


def readme_multinode() -> list[str]:
    """The README's two-node command (continuations joined), its words as a shell would pass them."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^(\.venv/bin/torchrun --nnodes 2 .*?)(?<!\\)$", text, re.M | re.S)
    assert match, "README.md has no `.venv/bin/torchrun --nnodes 2 ...` command"
    return shlex.split(re.sub(r"\\\n\s*", " ", match.group(1)))


@pytest.mark.parametrize("per_node,layout", [(2, []), (1, ["parallel.tp=1"])])
def test_two_agents_rendezvous_and_train_like_one_process(tmp_path, data, references, per_node, layout):
    """The README's line as it is (2 ranks per node: replicas across the nodes, tp 2 inside), and with one
    rank per node (tp 1: plain replicas across the nodes)."""
    words = readme_multinode()
    assert words[0] == ".venv/bin/torchrun" and "train.py" in words
    script = words.index("train.py")
    launcher = [w.replace("$HEAD:29500", f"127.0.0.1:{free_port()}") for w in words[1:script]]
    launcher[launcher.index("--nproc_per_node") + 1] = str(per_node)
    run = tmp_path / "run"
    readme_overrides = [w for w in words[script + 1:] if not w.startswith("hydra.run.dir=")]
    # then the test run's: 4 windows per step over the 2 data-parallel ranks
    train = [*readme_overrides, *overrides(data, "muonclip", "trainer.micro_batch_size=2", *layout),
             f"hydra.run.dir={run}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, str(ROOT / "train.py"), *train]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    outputs = [a.communicate(timeout=600)[0] for a in agents]
    for agent, out in zip(agents, outputs):
        assert agent.returncode == 0, out[-4000:]
    assert_same_run(run, references("muonclip"), tmp_path)
