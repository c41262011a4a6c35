"""Size a configuration without training: parameters per family, the optimizer's split, FLOPs, memory per \
rank.

    python -m kimi.summary model=48b_dense parallel.dp_shard=64 parallel.tp=8 parallel.pp=4 \\
        trainer.seq_len=4096 trainer.micro_batch_size=1 trainer.precision=bf16

The config is composed from conf/ with the same overrides train.py takes; the model is built on the meta
device (shapes only: no memory, no initialisation cost). Memory per rank counts the persistent training
state of the heaviest pipeline rank: fp32 master weights, fp32 gradients and the optimizer's fp32 state, as
its registry entry's state model counts it (kimi/optim/registry.py; MuonClip: one momentum per Muon
parameter, two moments per AdamW parameter; AdamW: two moments for all), after

  1. pipeline parallelism: a pipeline rank holds its stages' blocks (kimi.parallel.pipeline.split_blocks),
     the first stage also the embedding, the last the final norm, final AttnRes query and LM head;
  2. tensor parallelism (each sublayer's declared plan, kimi/model/sublayer.py): what it splits by heads or
     width is divided by tp (row-parallel matrices along their input dimension), the rest stays replicated;
     the embedding and LM head split the vocabulary; RMSNorm weights and AttnRes queries stay replicated;
  3. expert parallelism: the routed experts' dim 0 (the expert) is split over ep;
  4. FSDP2: every parameter's dim 0 is split over dp_shard x cp (the largest shard, ceil, is counted; the
     context-parallel ranks shard the weights like data-parallel ones), the routed experts' over
     dp_shard / ep (the rest of their data-parallel ranks); nothing is divided by dp_replicate.

With dp_shard x cp > 1 it also shows, apart, the transient all-gathered copy of the largest FSDP unit (a token
mixer, an MLP, or the root: embedding, LM head, norms and queries) in the compute dtype. Activations are not
counted.

torch and the model are imported by summarize(), so that --help answers without torch's start-up.
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Sequence, Tuple

from kimi.config import Config, ConfigError, check_stage_split, mixer_pattern, resolve_vocab, stages_per_rank
from kimi.model.registry import legend
from kimi.optim.registry import OptimizerKind, optimizer_for
from kimi.optim.rules import validate_optim
from kimi.parallel.rules import validate_parallel
from kimi.precision.registry import precision_for
from kimi.schema.run import tokens_per_step

if TYPE_CHECKING:
    from kimi.model import KimiModel

GIB = 1024**3

NORMS = "norms + AttnRes queries"  # the block's pre-norms and queries, the final norm and query


@dataclass
class RankState:
    """What one pipeline rank (any of its tp x dp ranks: they hold equal shares) keeps."""

    pp_rank: int
    stages: List[int]
    blocks: List[int]
    first: bool  # holds the embedding
    last: bool  # holds the final norm, final query and LM head
    params: int  # parameters of its part of the model, before tp and FSDP
    tp_split: int  # of those, divided by tp
    tp_replicated: int  # of those, whole on every tp rank
    local: int  # parameters a rank keeps after tp and FSDP
    local_by_family: Dict[str, int]  # of those, per family of optim.name (kimi/optim/registry.py)
    largest_unit: Tuple[str, int] = ("", 0)  # FSDP unit with the most tp-local parameters, and that count
    units: Dict[str, int] = field(default_factory=dict)  # every FSDP unit's tp-local parameters
    bytes: Dict[str, int] = field(default_factory=dict)

    @property
    def persistent_bytes(self) -> int:
        return sum(v for k, v in self.bytes.items() if not k.startswith("transient"))


@dataclass
class Summary:
    cfg: Config
    model: KimiModel
    vocab_note: Optional[str]
    families: Dict[str, int]  # parameter count per family (a tied LM head counts 0: it is the embedding)
    total: int
    active: int  # parameters one token uses (all of them in a dense model)
    muon: int  # under optim=muonclip with the config's patterns
    adamw: int
    flops_per_token: float
    tokens_per_step: int
    flops_per_step: float
    world: int
    ranks: List[RankState]
    heaviest: RankState


# ---- config ------------------------------------------------------------------------------------------------
def compose_config(overrides: Sequence[str]) -> Config:
    """The typed config train.py would run with these overrides (the run dir is not needed here)."""
    from omegaconf import OmegaConf

    from kimi.cli.conf_dir import compose

    return OmegaConf.to_object(compose(["trainer.run_dir=unused", *overrides]))


def vocab_note(cfg: Config) -> Optional[str]:
    """Set model.vocab_size when null, as the trainer does from its tokenizer; returns a note saying so."""
    m = cfg.model
    if m.vocab_size is not None:
        return None
    tok = cfg.data.tokenizer.vocab_size
    resolve_vocab(m, tok)
    return (f"model.vocab_size=null: using data.tokenizer.vocab_size={tok} rounded up to a multiple of "
            f"model.pad_vocab_multiple={m.pad_vocab_multiple} = {m.vocab_size}")


# ---- parameters --------------------------------------------------------------------------------------------
def _sublayer_of(model: KimiModel, name: str):
    """(the sublayer holding parameter `name`, the name relative to it), or (None, name) outside sublayers."""
    parts = name.split(".")
    if len(parts) > 3 and parts[0] == "blocks" and parts[2] in ("mixer", "mlp"):
        return model.get_submodule(".".join(parts[:3])), ".".join(parts[3:])
    return None, name


def family(model: KimiModel, name: str) -> str:
    """The family of a parameter name of model.named_parameters(remove_duplicate=False): the embedding, the
    LM head, the family its sublayer declares (e.g. "KDA mixers", "routed experts"), or norms and queries."""
    if name.startswith("embed."):
        return "embedding"
    if name.startswith("lm_head."):
        return "LM head"
    sub, rel = _sublayer_of(model, name)
    return NORMS if sub is None else sub.family(rel)


def _ep_split(model: KimiModel, name: str) -> bool:
    """Whether expert parallelism splits this parameter's dim 0 (what its sublayer declares: EP_SPLIT)."""
    sub, rel = _sublayer_of(model, name)
    return sub is not None and any(rel.startswith(prefix + ".") for prefix in sub.EP_SPLIT)


def tp_dim(model: KimiModel, name: str) -> Optional[int]:
    """The dimension tensor parallelism splits this parameter along, or None if it is replicated over tp:
    the vocabulary of the embedding and LM head, a sublayer's declared plan, nothing else."""
    if name.startswith(("embed.", "lm_head.")):
        return 0
    sub, rel = _sublayer_of(model, name)
    return None if sub is None else sub.tp_plan().split_dim(rel)


def optimizer_families(kind: OptimizerKind, model: KimiModel) -> Dict[str, str]:
    """The family of each parameter name under the optimizer `kind` (its registry entry's routing)."""
    return {n: kind.family(n, p) for n, p in model.named_parameters(remove_duplicate=False)}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def local_numel(shape: Sequence[int], dim: Optional[int], tp: int, dp_shard: int) -> int:
    """Elements one rank keeps: `dim` split over tp, then dim 0 over dp_shard (FSDP2; the largest shard)."""
    s = list(shape) or [1]
    if dim is not None and tp > 1:
        s[dim] = _ceil_div(s[dim], tp)
    s[0] = _ceil_div(s[0], dp_shard)
    return math.prod(s)


# ---- layout ------------------------------------------------------------------------------------------------
def pipeline_ranks(cfg: Config) -> List[Tuple[List[int], List[int], bool, bool]]:
    """(stages, blocks, first, last) per pipeline rank."""
    p, n = cfg.parallel, cfg.model.num_layers
    if p.pp == 1:
        return [([0], list(range(n)), True, True)]
    from kimi.parallel.pipeline import split_blocks, stage_indices

    check_stage_split(p, n, p.pp_split)
    virtual = stages_per_rank(p)
    total = p.pp * virtual
    ranges = split_blocks(cfg.model, total, cfg.trainer.seq_len, p.pp_split)
    out = []
    for rank in range(p.pp):
        stages = stage_indices(rank, p.pp, virtual)
        out.append((stages, [i for s in stages for i in ranges[s]], 0 in stages, total - 1 in stages))
    return out


@dataclass(frozen=True)
class ParamFact:
    """What rank_state needs of one parameter, looked up once (kimi/plan sizes thousands of layouts)."""

    name: str
    key: int  # id of the tensor: a tied LM head is the embedding's
    shape: Tuple[int, ...]
    tp_dim: Optional[int]
    ep_split: bool
    unit: str  # its FSDP unit without expert parallelism: a token mixer, an MLP, or the root


def param_facts(model: KimiModel) -> Dict[object, List[ParamFact]]:
    """The facts of every parameter (named_parameters(remove_duplicate=False)), by where it lives: a block
    index, "embed" (the first part) or "end" (the last: final norm, final query, LM head)."""
    out: Dict[object, List[ParamFact]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        parts = name.split(".")
        where = int(parts[1]) if parts[0] == "blocks" else "embed" if parts[0] == "embed" else "end"
        unit = ".".join(parts[:3]) if parts[0] == "blocks" and parts[2] in ("mixer", "mlp") else "root"
        out.setdefault(where, []).append(ParamFact(name, id(param), tuple(param.shape), tp_dim(model, name),
                                                   _ep_split(model, name), unit))
    return out


def rank_state(cfg: Config, model: KimiModel, routes: Dict[str, str], pp_rank: int, stages: List[int],
               blocks: List[int], first: bool, last: bool,
               facts: Optional[Dict[object, List[ParamFact]]] = None) -> RankState:
    """routes: the family of each parameter under optim.name (optimizer_families); facts: param_facts(model)
    when the caller keeps it."""
    p, t = cfg.parallel, cfg.trainer
    kind = optimizer_for(cfg.optim)
    facts = param_facts(model) if facts is None else facts
    seen = set()
    st = RankState(pp_rank, stages, blocks, first, last, 0, 0, 0, 0, dict.fromkeys(kind.FAMILIES, 0))
    units: Dict[str, int] = {}
    held = [*blocks, *(["embed"] if first else []), *(["end"] if last else [])]
    for f in (f for where in held for f in facts.get(where, [])):
        # a tied LM head is the embedding on one rank; across pipeline stages each end holds its own copy
        if f.key in seen:
            continue
        seen.add(f.key)
        dim, n = f.tp_dim, math.prod(f.shape)
        st.params += n
        if dim is None:
            st.tp_replicated += n
        else:
            st.tp_split += n
        shape, shard, unit = f.shape, p.dp_shard * p.cp, f.unit
        if p.ep > 1 and f.ep_split:  # an FSDP unit of their own
            shape, shard = (_ceil_div(shape[0], p.ep), *shape[1:]), p.dp_shard // p.ep
            unit = f.name.rsplit(".", 1)[0]
        local = local_numel(shape, dim, p.tp, shard)
        st.local += local
        st.local_by_family[routes[f.name]] += local
        units[unit] = units.get(unit, 0) + local_numel(shape, dim, p.tp, 1)
    st.units = units
    st.largest_unit = max(units.items(), key=lambda kv: kv[1])
    st.bytes = {"fp32 master weights": 4 * st.local, "fp32 gradients": 4 * st.local}
    for fam, state in kind.FAMILIES.items():  # the optimizer's state model, per family it routes to
        per = f"per {state.title} param" if len(kind.FAMILIES) > 1 else "per param"
        st.bytes[f"{state.title} {state.state} (fp32, {state.tensors} {per})"] = (
            state.bytes_per_param * st.local_by_family[fam])
    if p.dp_shard * p.cp > 1:
        st.bytes["transient"] = precision_for(t.precision).compute_bytes() * st.largest_unit[1]
    return st


# ---- the summary -------------------------------------------------------------------------------------------
def summarize(cfg: Config) -> Summary:
    """Everything the report prints, from a composed config (model.vocab_size is resolved in place)."""
    import torch

    from kimi.model import KimiModel
    from kimi.model.rules import validate_model
    from kimi.optim.optimizers import MuonClipKind

    # the sections it reads; not the rules of a training step (micro-batches, sequence splits), which a
    # layout being sized may not have settled yet
    validate_model(cfg.model)
    validate_optim(cfg.optim)
    validate_parallel(cfg.parallel)
    note = vocab_note(cfg)
    with torch.device("meta"):  # shapes only
        model = KimiModel(cfg.model)
    mixers = {b.mixer for b in model.blocks.values()}  # the rows: embedding, LM head, mixers, MLPs, norms
    families = {"embedding": 0, "LM head": 0}
    subs = [sub for _, sub in model.sublayers()]
    for sub in [s for s in subs if s in mixers] + [s for s in subs if s not in mixers]:
        families.update({fam: 0 for fam in (sub.FAMILY, *sub.FAMILY_OF.values()) if fam not in families})
    families[NORMS] = 0
    for name, param in model.named_parameters():  # a tied LM head is not listed again
        families[family(model, name)] += param.numel()
    # the parameter table's split is MuonClip's routing whatever optim.name is (the memory is optim.name's)
    split = optimizer_families(MuonClipKind(cfg.optim), model)
    muon = sum(p.numel() for n, p in model.named_parameters() if split[n] == "muon")
    routes = optimizer_families(optimizer_for(cfg.optim), model)
    total = model.num_params()
    t, p = cfg.trainer, cfg.parallel
    tokens = tokens_per_step(t, p.dp_replicate * p.dp_shard)
    fpt = model.flops_per_token(t.seq_len)
    facts = param_facts(model)
    ranks = [rank_state(cfg, model, routes, r, *layout, facts)
             for r, layout in enumerate(pipeline_ranks(cfg))]
    heaviest = max(ranks, key=lambda r: (r.persistent_bytes, -r.pp_rank))
    return Summary(cfg, model, note, families, total, model.num_active_params(), muon, total - muon, fpt,
                   tokens, fpt * tokens, p.dp_replicate * p.dp_shard * p.cp * p.tp * p.pp, ranks, heaviest)


# ---- printing ----------------------------------------------------------------------------------------------
def table(rows: List[Sequence[str]], header: Sequence[str], align: str) -> str:
    """Columns padded to their widest cell; align is one 'l' or 'r' per column."""
    cells = [list(header)] + [list(r) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def fmt(r):
        return "  ".join(c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join(["  " + fmt(cells[0]), "  " + rule] + ["  " + fmt(r) for r in cells[1:]])


def _blocks(blocks: List[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2,5-6'."""
    runs, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            runs.append(f"{start}" if start == b else f"{start}-{b}")
            start = None
    return ",".join(runs)


def human(n: float) -> str:
    """1_474_950 -> '1.47M', 47_962_255_232 -> '47.96B'."""
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{unit}"
    return f"{n:g}"


def flops(x: float) -> str:
    """7.509e16 -> '75.09 PFLOP'."""
    for scale, unit in ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M")):
        if x >= scale:
            return f"{x / scale:.2f} {unit}FLOP"
    return f"{x:.0f} FLOP"


def report(s: Summary) -> str:
    m, t, p, o = s.cfg.model, s.cfg.trainer, s.cfg.parallel, s.cfg.optim
    out = [f"model {m.name}: {m.num_layers} blocks {mixer_pattern(m)} ({legend(m)}), d_model "
           f"{m.d_model}, MLP width {m.mlp.hidden}, vocab {m.vocab_size}, residual {m.residual}"]
    if s.vocab_note:
        out.append(s.vocab_note)

    def share(n):
        return f"{100 * n / s.total:.2f}%"

    head = "tied: the embedding" if m.tie_embeddings else "untied"
    counts = Counter(sub.FAMILY for _, sub in s.model.sublayers())
    labels = {"LM head": f"LM head ({head})", **{fam: f"{fam} (x{n})" for fam, n in counts.items()}}
    rows = [[labels.get(k, k), f"{v:,}", human(v), share(v)] for k, v in s.families.items()]
    rows.append(["total", f"{s.total:,}", human(s.total), share(s.total)])
    if s.active != s.total:
        rows.append(["  active per token", f"{s.active:,}", human(s.active), share(s.active)])
    rows.append(["  Muon (hidden matrices)", f"{s.muon:,}", human(s.muon), share(s.muon)])
    rows.append(["  AdamW (the rest)", f"{s.adamw:,}", human(s.adamw), share(s.adamw)])
    out += ["", "Parameters (the Muon/AdamW split is MuonClip's routing, optim=muonclip)",
            table(rows, ["family", "parameters", "", "share"], "lrrr")]

    rows = [["FLOPs per token (fwd + bwd)", f"{s.flops_per_token:.4g}",
             f"{flops(s.flops_per_token)}, model.flops_per_token({t.seq_len})"],
            ["tokens per step", f"{s.tokens_per_step:,}",
             f"micro_batch {t.micro_batch_size} x seq_len {t.seq_len} x grad_accum {t.grad_accum_steps} x "
             f"dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard}"],
            ["FLOPs per step", f"{s.flops_per_step:.4g}", flops(s.flops_per_step)],
            ["FLOPs per step per rank", f"{s.flops_per_step / s.world:.4g}",
             f"{flops(s.flops_per_step / s.world)}, average over {s.world} ranks"]]
    out += ["", "Training compute", table(rows, ["", "value", ""], "lrl")]

    virtual = ("" if p.pp == 1 or len(s.ranks[0].stages) == 1
               else f", {len(s.ranks[0].stages)} stages per rank")
    experts = f"; routed experts over ep {p.ep}" if p.ep > 1 else ""
    out += ["", f"Layout: dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x cp {p.cp} x tp {p.tp} x pp "
                f"{p.pp} = {s.world} ranks (pp_schedule {p.pp_schedule}{virtual}){experts}"]
    rows = []
    for r in s.ranks:
        ends = "+".join(x for x, on in (("embed", r.first), ("head", r.last)) if on)
        rows.append([str(r.pp_rank), ",".join(map(str, r.stages)), _blocks(r.blocks), ends, f"{r.params:,}",
                     f"{r.tp_split:,}", f"{r.tp_replicated:,}", f"{r.local:,}",
                     f"{r.persistent_bytes / GIB:.2f}", "<- heaviest" if r is s.heaviest else ""])
    out.append(table(rows, ["pp rank", "stages", "blocks", "ends", "params", "split over tp",
                            "replicated over tp", "params per rank", "GiB", ""], "llllrrrrrl"))

    h = s.heaviest
    rows = []
    for k, v in h.bytes.items():
        if not k.startswith("transient"):
            rows.append([k, f"{v:,}", f"{v / GIB:.2f}"])
    rows.append(["total (persistent)", f"{h.persistent_bytes:,}", f"{h.persistent_bytes / GIB:.2f}"])
    if "transient" in h.bytes:
        v, dtype = h.bytes["transient"], precision_for(t.precision).compute_name()
        rows.append([f"+ one gathered FSDP unit ({dtype}, {h.largest_unit[0]}: {h.largest_unit[1]:,})",
                     f"{v:,}", f"{v / GIB:.2f}"])
        rows.append(["total with it", f"{h.persistent_bytes + v:,}", f"{(h.persistent_bytes + v) / GIB:.2f}"])
    out += ["", f"Memory per rank, heaviest pipeline rank {h.pp_rank}: {h.local:,} parameters per rank "
                f"(optim={o.name}, precision={t.precision})",
            table(rows, ["", "bytes", "GiB"], "lrr"),
            "  Counted: fp32 weights, fp32 gradients, fp32 optimizer state, after pp, then tp, then FSDP "
            "over dp_shard x cp (not dp_replicate).",
            "  Not counted: activations (they depend on micro_batch_size, seq_len and "
            "parallel.activation_checkpointing), communication buffers, the CUDA context and allocator "
            "slack."]
    return "\n".join(out)


def one_line(e: BaseException) -> str:
    """The first line of an error and of its cause (Hydra's "Could not override 'model.foo'." is caused by
    OmegaConf's "Key 'foo' not in 'ModelConfig'")."""
    parts = []
    while e is not None and len(parts) < 3:
        line = " ".join(str(e).strip().split("\n")[0].split()).rstrip(".:")
        if line and line not in parts:
            parts.append(line)
        e = e.__cause__
    return ": ".join(parts) or "invalid configuration"


def main(argv: Optional[Sequence[str]] = None) -> str:
    """Print the summary for these Hydra overrides (sys.argv[1:] by default) and return it; on a config error
    print a one-line `error: ...` and exit with status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        import kimi.parallel.engine_rules  # noqa: F401 (fills parallel.engine's choices)
        from kimi.cli.config_help import config_help

        text = config_help(__doc__, argv, only=("model", "optim", "trainer", "parallel", "precision"))
        print(text)
        return text
    try:
        text = report(summarize(compose_config(argv)))
    except Exception as e:  # noqa: BLE001 (Hydra/OmegaConf errors have no common base; ConfigError too)
        from hydra.errors import HydraException
        from omegaconf.errors import OmegaConfBaseException

        if not isinstance(e, (HydraException, OmegaConfBaseException, ConfigError, ValueError)):
            raise
        print(f"error: {one_line(e)}", file=sys.stderr)
        sys.exit(2)
    print(text)
    return text


def cli() -> int:
    """`kimi-summary`: main's exit status (a console script would print the returned text a second time)."""
    main()
    return 0


if __name__ == "__main__":
    main()
