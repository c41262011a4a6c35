"""Memory per rank of a layout, without running it: what the heaviest rank holds at its peak, by part.

Persistent state (weights, gradients, optimizer state, the gathered FSDP units) is kimi.summary's count per
pipeline rank after pp, tp, ep and FSDP (`rank_state`), and under the DeepSpeed engine ZeRO's partitioning
of it over dp_shard. Activations come from kimi.plan.activations: what autograd keeps per token of each
block under parallel.activation_checkpointing, traced from the model's shapes in the run's compute dtype
with the kernels its device takes (autocast's copies of the weights apart: kept once per micro-batch, and
only by an eager step on plain fp32 weights, keeps_weight_copies), then

  * split by the layout: tokens per rank are rows x seq_len / cp; the tensors inside sublayers divide by tp,
    the d_model-wide ones between them only under sequence parallelism; the loss's logits divide by tp
    (vocabulary-parallel) and are a chunk's (model.loss_chunk) unless the loss is the plain one (a pipeline's
    last stage, or tp > 1);
  * kept for the micro-batches in flight: 1 without a pipeline; for 1F1B min(pp - rank, micro-batches), for
    GPipe all of them, for the interleaved schedules the stage-micro-batches of their warm-up
    (min(v M, (v - 1) pp + 2 (pp - rank) - 1)), each holding one of the rank's v stages (a v-th of its
    blocks' activations, on average);
  * plus the largest transient at once: the backward's recompute and activation gradients, a weight's
    gradient as it is made, or the loss's logits, whichever is larger.

A step peaks at one of three moments, and the parts returned are that moment's, so they add up to the
peak: the first backward after the forwards in flight (weights, optimizer state, activations, gathered FSDP
units; the gradients only if an earlier micro-batch's backward made them), the end of the last backward
(the gradients made, the first block's activations and the backward's transient left), or the optimizer
step (weights, gradients, the state and the step's working memory, kimi.plan.optimizer_step; MuonClip's on
its busiest owner, kimi.plan.owner_plan). What the optimizer keeps between steps (MuonClip's Newton-Schulz
buffers on the CPU) counts with its state at the first two. docs/planning.md checks this against measured
peaks. Cached per model shape: the meta model, its parameter facts, the pipeline split, the traces.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List

from kimi.config import Config, pipeline_microbatches, stages_per_rank
from kimi.parallel.engine_rules import DEEPSPEED, TORCH
from kimi.plan.activations import Mode, Trace, trace
from kimi.plan.optimizer_step import kept_bytes_per_param, step_bytes_per_param
from kimi.plan.owner_plan import owned
from kimi.plan.shapes import facts, model_shapes, muonclip, pipeline, section_key, sources, stage_ranges

PARTS = ("weights", "gradients", "optimizer", "activations", "fsdp_gathered", "comm_buffers")


def inflight(cfg: Config, rank: int) -> int:
    """Micro-batches (stage-micro-batches for the interleaved schedules) whose activations pipeline rank
    `rank` holds at once."""
    p = cfg.parallel
    if p.pp == 1:
        return 1
    M, v = pipeline_microbatches(cfg), stages_per_rank(p)
    if p.pp_schedule == "gpipe":
        return M
    if v == 1:
        return min(p.pp - rank, M)
    return min(v * M, (v - 1) * p.pp + 2 * (p.pp - rank) - 1)


def activations(cfg: Config, tr: Trace, rank: int, blocks: List[int], first: bool, last: bool) -> float:
    """Activation bytes pipeline rank `rank` holds at its peak (its blocks; the embedding if first; the
    final mix and the loss if last)."""
    p = cfg.parallel
    rows, tokens, cb = _micro_batch(cfg)
    v = stages_per_rank(p)
    if v == 1:
        kept = inflight(cfg, rank) * _held(cfg, tr, blocks, first, last, rows, tokens, cb)
    else:  # an interleaved schedule's in-flight unit is a stage-micro-batch: one of the rank's stages
        ranges, total = stage_ranges(cfg), p.pp * v
        kept = 0.0
        for c, count in enumerate(_inflight_per_stage(cfg, rank)):
            stage = rank + c * p.pp
            kept += count * _held(cfg, tr, list(ranges[stage]), stage == 0, stage == total - 1, rows, tokens,
                                  cb)
    plain = p.pp > 1 or p.tp > 1  # the schedule's loss, or a vocabulary-parallel head's: whole logits
    head = tr.head_row / p.tp if last and not plain else 0.0
    transient = _transient(cfg, tr, tokens)
    if last:
        transient = max(transient, tr.logits_alive(cfg.model, tokens, p.tp, plain))
    return kept + head + transient


def last_backward(cfg: Config, tr: Trace, blocks: List[int], first: bool) -> float:
    """Activation bytes at the end of a rank's last backward, when its gradients are all but made: what the
    micro-batch keeps of the rank's first block (and of the embedding if first) and the backward's
    transient. Under full recomputation this moment, not the first backward's start, can set the peak."""
    rows, tokens, cb = _micro_batch(cfg)
    return _held(cfg, tr, blocks[:1], first, False, rows, tokens, cb) + _transient(cfg, tr, tokens)


def _micro_batch(cfg: Config):
    """(rows, tokens per rank, the compute dtype's bytes) of one micro-batch."""
    from kimi.precision.registry import precision_for

    t = cfg.trainer
    rows = t.micro_batch_size // pipeline_microbatches(cfg)
    return rows, rows * (t.seq_len // cfg.parallel.cp), precision_for(t.precision).compute_bytes()


def _transient(cfg: Config, tr: Trace, tokens: int) -> float:
    """The backward's larger transient: an activation gradient or recompute (grows with the tokens), or a
    weight's gradient made (does not)."""
    return max(tokens * tr.extra / cfg.parallel.tp, tr.extra_row)


def _held(cfg: Config, tr: Trace, blocks: List[int], first: bool, last: bool, rows: int, tokens: int,
          cb: int) -> float:
    """What one micro-batch in flight keeps of `blocks` (as traced; the embedding's if first, the final
    mix's and the loss's if last); cb: the compute dtype's bytes."""
    m, p = cfg.model, cfg.parallel
    wide = p.tp if p.sequence_parallel else 1  # d_model-wide tensors between sublayers
    per_token = sum(b[0] / wide + b[1] / p.tp for b in (tr.blocks[i] for i in blocks))
    per_row = sum(b[0] / wide + b[1] / p.tp for b in (tr.blocks_row[i] for i in blocks))
    per_batch = sum(tr.casts[i] for i in blocks) / p.tp  # the weight copies, sharded as the weights
    if first:
        per_token += tr.first[0] / wide + tr.first[1] / p.tp
        per_batch += tr.casts_ends[0]
    elif blocks:  # the stream's sources received from the stage before (and their gradients at the end)
        per_token += sources(m, 2 * min(blocks)) * m.d_model * cb
    if last:
        per_token += tr.last[0] / wide + tr.last[1] / p.tp + tr.head_token / wide
        per_batch += tr.casts_ends[1]
    return tokens * per_token + rows * per_row + (per_batch if keeps_weight_copies(cfg) else 0.0)


def trace_mode(cfg: Config) -> Mode:
    """How cfg's step runs, as its activation trace follows it. A compiled step on the CPU is traced as
    inductor's partitioner cuts its regions (kimi.plan.compiled; the eager trace was 1.3-1.9x over). On a
    GPU a compiled step is still sized by the eager trace, an upper bound there, until a GPU has measured a
    compiled step's peak (docs/planning.md): the eager trace is under the one GPU peak measured so far (an
    eager step's), and a model under the GPU's memory would pick layouts that do not fit."""
    from kimi.precision.registry import precision_for

    p, t = cfg.parallel, cfg.trainer
    gpu = t.device != "cpu"
    return Mode(precision_for(t.precision).compute_bytes(), gpu, p.compile and not gpu, p.cp)


def keeps_weight_copies(cfg: Config) -> bool:
    """Whether autocast's copies of the weights in the compute dtype stay alive until the backward: in an
    eager step whose weights are plain fp32 tensors. FSDP with bf16 gathers them in bf16 already (nothing
    to copy), DeepSpeed's bf16 keeps its module in bf16, and a compiled region casts inside its graph, where
    the partitioner recomputes a cast from the fp32 weight it holds anyway rather than save the copy."""
    from kimi.parallel.dims import ParallelDims

    p = cfg.parallel  # the trainer's own rule for FSDP (the world size does not enter it)
    return p.engine == TORCH and not ParallelDims.from_config(p, world=1).fsdp and not p.compile


def _inflight_per_stage(cfg: Config, rank: int) -> List[int]:
    """The stage-micro-batches in flight on `rank` (inflight) by its local stage: the interleaved schedules
    run a rank's forwards in groups of pp micro-batches per stage, its stages in turn."""
    p = cfg.parallel
    v, counts = stages_per_rank(p), [0] * stages_per_rank(p)
    for k in range(inflight(cfg, rank)):
        counts[(k // p.pp) % v] += 1
    return counts


def _zero(cfg: Config, local: int, opt: int, full: int) -> Dict[str, int]:
    """DeepSpeed ZeRO's persistent parts: `full` parameters on the rank before partitioning, `local` and
    `opt` bytes of optimizer state after it (kimi.summary shards over dp_shard like ZeRO does)."""
    ds = cfg.parallel.deepspeed
    dp = cfg.parallel.dp_shard
    share = -(-full // dp)
    weights = 4 * (share if ds.zero_stage == 3 else full)
    grads = 4 * (share if ds.zero_stage >= 2 else full)
    # the contiguous gradient bucket (contiguous_gradients, kimi/parallel/deepspeed_engine.py), fp32, made
    # at its configured size whatever the model's: 2 GB at the default 500M elements
    buckets = 4 * ds.reduce_bucket_size
    return {"weights": weights, "gradients": grads, "optimizer": opt, "comm_buffers": buckets}


def rank_parts(cfg: Config, mode: Mode | None = None) -> List[Dict[str, int]]:
    """The parts of every pipeline rank at its peak (memory_per_rank takes the heaviest); mode: the
    activation trace's, if not trace_mode(cfg)."""
    from kimi.summary import rank_state

    model, routes, named = model_shapes(cfg)
    table = facts(cfg)
    p, t = cfg.parallel, cfg.trainer
    cb = _micro_batch(cfg)[2]
    tr = trace(cfg.model, p.activation_checkpointing, mode or trace_mode(cfg))
    step, kept_per_param = step_bytes_per_param(cfg), kept_bytes_per_param(cfg)
    out = []
    for rank, (stages, blocks, first, last) in enumerate(pipeline(cfg)):
        if p.engine == DEEPSPEED:  # ZeRO partitions over dp_shard itself: the rank's state unsharded first
            whole = dataclasses.replace(cfg, parallel=dataclasses.replace(p, dp_shard=1, cp=1))
            st = rank_state(whole, model, routes, rank, stages, blocks, first, last, table)
            parts = _zero(cfg, st.local, -(-_state(st) // p.dp_shard), st.local)
            gathered, updated = 0, -(-st.local // p.dp_shard)
        else:
            st = rank_state(cfg, model, routes, rank, stages, blocks, first, last, table)
            parts = {"weights": st.bytes["fp32 master weights"], "gradients": st.bytes["fp32 gradients"],
                     "optimizer": _state(st)}
            if muonclip(cfg):  # its state is spread over the whole stage group (owners.py)
                one = dataclasses.replace(p, dp_shard=1, cp=1, tp=1, ep=1)
                whole = dataclasses.replace(cfg, parallel=one)
                state = _state(rank_state(whole, model, routes, rank, stages, blocks, first, last, table))
                parts["optimizer"] = -(-state // (p.dp_replicate * p.dp_shard * p.cp * p.tp))
            gathered = _gathered(cfg, st.units) * cb if p.dp_shard * p.cp > 1 else 0
            updated = st.local
        act = int(activations(cfg, tr, rank, blocks, first, last))
        # three moments: the activations' peak (the first backward after the forwards in flight; the
        # gradients exist by then only if an earlier micro-batch's backward made them), the end of the last
        # backward (the gradients made, the activations nearly all freed), and the optimizer step's
        # (interleaved: inflight counts stage-micro-batches, of which a step runs v x micro-batches)
        units = pipeline_microbatches(cfg) * stages_per_rank(p)
        earlier = t.grad_accum_steps > 1 or (p.pp > 1 and units > inflight(cfg, rank))
        grads_then = parts["gradients"] if earlier else 0
        # what the optimizer keeps between steps (CPU MuonClip's Newton-Schulz buffers) is alive in the
        # backward too; the step's working memory already holds it
        kept = int(_step_transient(cfg, kept_per_param, st.params, updated, blocks, first, last,
                                   routed=False))
        backward = {**parts, "optimizer": parts["optimizer"] + kept, "fsdp_gathered": gathered}
        forward = {**backward, "gradients": grads_then, "activations": act}
        ending = {**backward, "activations": int(last_backward(cfg, tr, blocks, first))}
        working = int(_step_transient(cfg, step, st.params, updated, blocks, first, last))
        stepping = {**parts, "optimizer": parts["optimizer"] + working, "activations": 0, "fsdp_gathered": 0}
        best = max((forward, ending, stepping), key=lambda d: sum(d.values()))
        out.append({k: int(best.get(k, 0)) for k in PARTS})
    return out


def _step_transient(cfg: Config, per_param: float, stage_params: int, updated: int, blocks, first: bool,
                    last: bool, routed: bool = True) -> float:
    """The optimizer step's working memory on one rank. MuonClip (kimi/optim/owners.py) gives every matrix
    one owner among the ranks of a pipeline stage: a rank orthogonalises the matrices it owns whole (their
    share of the traced working memory), holds their gathered gradients (fp32, 4 bytes an element) and,
    during each of its two all-to-alls, the flat send and receive buffers the router concatenates (fp32;
    the larger exchange counts); the busiest rank counts. AdamW updates the rank's own shards. routed=False:
    the owner's share alone, without the gathered gradients and the router's buffers."""
    p = cfg.parallel
    if not muonclip(cfg) or p.engine != TORCH:
        return per_param * updated
    if p.dp_replicate * p.dp_shard * p.cp * p.tp == 1:
        return per_param * stage_params
    per_muon = per_param * _muon_ratio(cfg)  # the traced working memory is Muon's
    return max(per_muon * mine + routed * (4 * mine + 4 * buffers)
               for mine, buffers in owned(cfg, blocks, first, last))


_RATIOS: Dict[str, float] = {}


def _muon_ratio(cfg: Config) -> float:
    """The model's parameters over its Muon parameters (cached per model shape and optimizer)."""
    key = section_key(cfg.model, cfg.optim)
    if key not in _RATIOS:
        _, routes, named = model_shapes(cfg)
        params = {n: p.numel() for n, p in named}
        muon = sum(params[n] for n, fam in routes.items() if fam == "muon" and n in params)
        _RATIOS[key] = sum(params.values()) / max(1, muon)
    return _RATIOS[key]


def _state(st) -> int:
    """The optimizer state's bytes of a kimi.summary RankState."""
    skip = ("fp32 master weights", "fp32 gradients", "transient")
    return sum(v for k, v in st.bytes.items() if k not in skip)


def _gathered(cfg: Config, units: Dict[str, int]) -> int:
    """Parameters FSDP holds unsharded at once: the root (kept gathered through the step), and of the other
    units the one computing and the one prefetched (all of them with reshard_after_forward=false)."""
    others = sorted((n for u, n in units.items() if u != "root"), reverse=True)
    if not cfg.parallel.reshard_after_forward:
        return sum(units.values())
    return units.get("root", 0) + sum(others[:2])


def memory_floor(cfg: Config) -> Dict[str, int]:
    """memory_per_rank's parts sized with one device's trace at the rank's tokens: no more than the layout's
    under context parallelism, whose last rank holds more (kimi/plan/activations.py), and cheaper, one
    trace per checkpointing mode serving every cp (the search sizes a cp layout with it first)."""
    return memory_per_rank(cfg, dataclasses.replace(trace_mode(cfg), cp=1))


def memory_per_rank(cfg: Config, mode: Mode | None = None) -> Dict[str, int]:
    """Bytes the heaviest rank holds at its peak, by part: 'weights', 'gradients', 'optimizer',
    'activations', 'fsdp_gathered', 'comm_buffers' (every key present, 0 where none). cfg: a composed,
    validated Config whose parallel and trainer sections are the layout. No reserve added. mode: the
    activation trace's (kimi.plan.activations.Mode), if not the one the layout runs as (trace_mode)."""
    return max(rank_parts(cfg, mode), key=lambda parts: sum(parts.values()))
