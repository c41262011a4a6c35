"""torchrun worker for tests/precision/test_fp8_gather.py: fp8 training runs under FSDP2, one after another in
one launch, each probed before it trains.

    torchrun --nproc_per_node N tests/dist_fp8_gather.py RUNS.json OUT.json

RUNS.json holds a list of {"run_dir", "overrides", "resume_from"?, "reload"?}. With resume_from (a finished
run dir and a step), rank 0 first copies that run's dir without its checkpoints after the step, so the run
resumes there. With reload (a step), the trained run then loads its checkpoint of that step back into the same
engine, as a rollback does.
OUT.json gets, per run, from rank 0:

* gathered_bytes: what FSDP's all-gathers of one forward (an evaluation batch) return, in bytes;
* converted: the fp8 projections; fp8_weights: the weights torchao's float8 gather moves, fp8_elements
  their elements;
* gathered_fp8_exact: for every such weight, whether the fp8 data and scale the layer is handed once its
  unit is gathered equal torchao's cast of the whole fp32 master (gathered in fp32 and cast in one piece);
  before training, and (exact_trained, exact_reloaded) after it and after the reload.
"""

from __future__ import annotations

import gc
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir

ROOT = Path(__file__).resolve().parents[1]


def copy_until(src: Path, dst: Path, step: int) -> None:
    from kimi.checkpoint import store

    shutil.copytree(src, dst)
    for info in store.list_checkpoints(dst / "checkpoints"):
        if info.step > step:
            shutil.rmtree(info.path)


def gathered_bytes(trainer) -> int:
    """Bytes FSDP's all-gathers return in one evaluation forward (they all go through all_gather_single)."""
    seen, original = [], dist.all_gather_single

    def counting(output, input, *args, **kwargs):
        seen.append(output.numel() * output.element_size())
        return original(output, input, *args, **kwargs)

    dist.all_gather_single = counting
    try:
        trainer.engine.eval_loss(trainer.val_batches[0])
    finally:
        dist.all_gather_single = original
    return sum(seen)


def fp8_exact(trainer) -> bool:
    """Each float8-gathered weight, as its unit hands it to the layer, against torchao's cast of the whole
    master."""
    from torch.distributed.fsdp import FSDPModule
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole

    engine, model, exact = trainer.engine, trainer.model, True
    full = {k: v.full_tensor() for k, v in engine.model_state_dict().items()}
    for name in engine.float8_gather.weights:
        linear = model.get_submodule(name.rpartition(".")[0])
        unit = next(m for n, m in model.named_modules()
                    if isinstance(m, FSDPModule) and name.startswith(n + "."))
        unit.unshard()
        got = linear.weight
        want = hp_tensor_to_float8_dynamic(full[name], linear.config.cast_config_weight.target_dtype,
                                           linear.linear_mm_config, gemm_input_role=GemmInputRole.WEIGHT)
        exact &= torch.equal(got._data.view(torch.uint8), want._data.view(torch.uint8))
        exact &= torch.equal(got._scale, want._scale)
        unit.reshard()
    return bool(exact)


def probe(trainer) -> dict:
    gather = trainer.engine.float8_gather
    weights = gather.weights if gather else []
    params = dict(trainer.model.named_parameters())
    return {"converted": trainer.engine.low_precision, "fp8_weights": weights,
            "gathered_bytes": gathered_bytes(trainer),
            "fp8_elements": sum(params[n].numel() for n in weights),
            "gathered_fp8_exact": fp8_exact(trainer) if weights else None}


def main(spec: Path, out: Path) -> None:
    from kimi import checkpoint
    from kimi.config import register_configs
    from kimi.parallel import destroy_distributed
    from kimi.trainer import Trainer

    register_configs()
    results = {}
    for run in json.loads(spec.read_text()):
        if "resume_from" in run:
            src, step = run["resume_from"]
            if dist.get_rank() == 0:
                copy_until(Path(src), Path(run["run_dir"]), step)
            dist.barrier()
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("config", overrides=[f"trainer.run_dir={run['run_dir']}", *run["overrides"]])
        trainer = Trainer(cfg)
        results[run["run_dir"]] = probe(trainer)
        trainer.fit()
        if trainer.engine.float8_gather:
            results[run["run_dir"]]["exact_trained"] = fp8_exact(trainer)
        if "reload" in run:
            ckpt = checkpoint.step_dir(Path(run["run_dir"]) / "checkpoints", run["reload"])
            checkpoint.load(ckpt, trainer.engine, trainer.loader)
            results[run["run_dir"]]["exact_reloaded"] = fp8_exact(trainer)
        del trainer
        gc.collect()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    destroy_distributed()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
