"""The Kimi-style hybrid model: token embedding, blocks of (KDA or MLA token mixer, SwiGLU MLP) joined by
a residual stream (standard, or Attention Residuals over every sublayer or over blocks), final norm, LM head.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kimi.model.config import ModelConfig
from kimi.ops.documents import cu_seqlens_from_starts
from kimi.ops.linear_ce import CHUNK_MIB, linear_cross_entropy

from .attnres import depth_mix, make_stream, resume_stream
from .cache import InferenceCache
from .init import Rules, constant, normal, param_seed, prefixed
from .layouts import QKClipSpec
from .mtp import MTPLayer, mtp_loss
from .norm import RMSNorm
from .registry import mixer_classes, mlp_class, mlp_kinds
from .sublayer import Sublayer
from .views import ParamViews

Runner = Callable[..., torch.Tensor]


class Runners:
    """Mixin: parts of a forward called through a runner when one is set
    (kimi/parallel/activation_checkpointing.py)."""

    def set_runner(self, name: str, run: Runner, module_apart: bool = False) -> None:
        """Call part `name` as run(function, *args) from now on: how activation checkpointing recomputes a
        sublayer in the backward without replacing its forward or renaming its parameters. module_apart: a
        sublayer's runner gets its depth mix and pre-norm only, the module called on their output after it
        (a module that checkpoints itself: selective checkpointing inside its compiled region)."""
        self.__dict__.setdefault("_runners", {})[name] = run
        apart = self.__dict__.setdefault("_apart", set())
        (apart.add if module_apart else apart.discard)(name)

    def run_through(self, name: str, function: Callable, *args) -> torch.Tensor:
        """function(*args), or run(function, *args) with the runner set for `name`."""
        run = self.__dict__.get("_runners", {}).get(name)
        return function(*args) if run is None else run(function, *args)


def site_query(query: torch.Tensor | None, key_weight: torch.Tensor | None) -> torch.Tensor | None:
    """A depth mix's effective pseudo-query: w . (gamma * RMSNorm(v)) = (gamma * w) . RMSNorm(v)."""
    return query if key_weight is None or query is None else query * key_weight


class Block(Runners, ParamViews, nn.Module):
    """One token mixer and one MLP (dense, or a mixture of experts), each a sublayer (kimi/model/sublayer.py)
    with its own pre-norm and (with AttnRes) pseudo-query."""

    def __init__(self, cfg: ModelConfig, mixer: type, mlp: type, first: bool):
        super().__init__()
        d = cfg.d_model
        self.mixer_norm = RMSNorm(d, cfg.norm_eps)
        self.mixer = mixer.build(cfg)
        self.mlp_norm = RMSNorm(d, cfg.norm_eps)
        self.mlp = mlp.build(cfg)
        attnres = cfg.residual != "standard"
        # The model's first sublayer has one source (the embedding), whose softmax weight is 1 whatever
        # its query: a query there would be a parameter with an identically zero gradient, so it has none.
        self.mixer_query = nn.Parameter(torch.zeros(d)) if attnres and not first else None
        self.mlp_query = nn.Parameter(torch.zeros(d)) if attnres else None
        keyed = attnres and cfg.attnres.key_weight
        self.mixer_key_weight = nn.Parameter(torch.ones(d)) if keyed and not first else None
        self.mlp_key_weight = nn.Parameter(torch.ones(d)) if keyed else None

    def site_query(self, name: str) -> torch.Tensor | None:
        """Sublayer `name`'s effective pseudo-query: its query times its key-norm weight, if it has one."""
        return site_query(self.param(f"{name}_query"), self.param(f"{name}_key_weight"))

    def sublayer(self, name: str, stream, **kwargs) -> torch.Tensor:
        """Sublayer `name`'s ("mixer" or "mlp") output: its depth mix of the stream, pre-norm and module, as
        one function of the stream's sources, called through the sublayer's runner (see :meth:`set_runner`) if
        any. The mix is inside: activation checkpointing then keeps the sources (alive in the stream anyway)
        rather than the mix's fp32 stacks, and recomputes the mix with the module."""
        module, norm = getattr(self, name), getattr(self, f"{name}_norm")
        apart = name in self.__dict__.get("_apart", ())

        def whole(query, *sources):
            h = stream.mix(query, sources, norm)
            return h if apart else module(h, **kwargs)

        out = self.run_through(name, whole, self.site_query(name), *stream.sources())
        return module(out, **kwargs) if apart else out

    def forward(self, stream, cu_seqlens: torch.Tensor | None = None, cache=None,
                rows: int | None = None, context=None):
        """Advance the residual stream (see kimi.model.attnres) through both sublayers; returns it. rows: how
        many batch rows a packed row [1, B*T] holds (an MoE layer's sequence-wise loss is per row); context:
        the token mixer's shard of a sequence split over ranks (see KimiModel.forward)."""
        kwargs = {} if context is None else {"context": context}
        stream.push(self.sublayer("mixer", stream, cu_seqlens=cu_seqlens, cache=cache, **kwargs))
        kwargs = {} if rows is None else {"rows": rows}
        stream.push(self.sublayer("mlp", stream, **kwargs))
        return stream


class LMHead(nn.Linear):
    """The output projection to the vocabulary; given labels, the mean cross-entropy instead of the logits,
    computed chunk by chunk (kimi.ops.linear_ce: `chunk` tokens, or 0: as many as `chunk_mib` MiB of fp32
    logits hold) unless `chunk` is -1. A module call either way, so every engine's hooks (FSDP, ZeRO-3)
    see the weight gathered."""

    def __init__(self, d_model: int, vocab: int, chunk: int, chunk_mib: int = CHUNK_MIB):
        super().__init__(d_model, vocab, bias=False)
        self.chunk, self.chunk_bytes = chunk, chunk_mib << 20
        self.vocab_parallel = False  # set by tensor parallelism, whose plan shards the logits

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(hidden)
        if self.chunk < 0:
            return lm_loss(super().forward(hidden), labels)
        return linear_cross_entropy(hidden, self.weight, labels, self.chunk, self.chunk_bytes)


class KimiModel(Runners, ParamViews, nn.Module):
    """The model, or one contiguous part of it (a pipeline stage: see :meth:`part`).

    A part holds a run of blocks (``blocks`` maps block indices to blocks, so parameter names are the whole
    model's) and the embedding only if it is first, the final aggregation, norm and LM head only if last;
    its forward passes through what it lacks. Parts never copy modules: they share the parent's.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set (resolve it from the tokenizer first)")
        self.cfg = cfg
        # the AttnRes streams' mix (model.attnres.backend); kimi.parallel's apply_compile may compile it
        self.depth_mix = depth_mix(cfg.attnres.backend, compiled=False)
        # One draw from torch's generator, before any module's constructor draws (on the meta device they do
        # not), seeds every parameter's own generator (init_parameter): the weights follow torch.manual_seed
        # but not the device, order or place in which parameters are initialised.
        self.init_seed = int(torch.randint(0, 2**62, (), device="cpu"))
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleDict({str(i): Block(cfg, mixer, mlp, first=i == 0)
                                     for i, (mixer, mlp) in enumerate(block_classes(cfg))})
        self.final_query = nn.Parameter(torch.zeros(cfg.d_model)) if cfg.residual != "standard" else None
        keyed = cfg.residual != "standard" and cfg.attnres.key_weight
        self.final_key_weight = nn.Parameter(torch.ones(cfg.d_model)) if keyed else None
        self.mtp = nn.ModuleList([MTPLayer(cfg.d_model, cfg.norm_eps, mtp_block(cfg))
                                  for _ in range(cfg.mtp.layers)]) if cfg.mtp.layers else None
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, cfg.loss_chunk, cfg.loss_chunk_mib)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        if not self.embed.weight.is_meta:  # on the meta device there is nothing to fill (see materialize)
            self.init_weights()

    def part(self, blocks, first: bool, last: bool) -> "KimiModel":
        """A model made of `blocks` (indices) of this one, with the embedding if `first` and the final
        aggregation, norm and LM head if `last`: the same modules, shared, under the same names."""
        part = KimiModel.__new__(KimiModel)
        nn.Module.__init__(part)
        part.cfg, part.init_seed, part.depth_mix = self.cfg, self.init_seed, self.depth_mix
        part.embed = self.embed if first else None
        part.blocks = nn.ModuleDict({str(i): self.blocks[str(i)] for i in blocks})
        part.final_query = self.final_query if last else None
        part.final_key_weight = self.final_key_weight if last else None
        part.mtp = self.mtp if last else None
        part.norm = self.norm if last else None
        part.lm_head = self.lm_head if last else None
        return part

    @staticmethod
    def union(parts: list["KimiModel"]) -> "KimiModel":
        """One model holding every module of `parts` (a pipeline rank's stages, each possibly wrapped by
        FSDP), under the whole model's names: what the optimizer and checkpoints see."""
        if len(parts) == 1:
            return parts[0]
        first = next((p for p in parts if p.embed is not None), None)
        last = next((p for p in parts if p.lm_head is not None), None)
        union = parts[0].part([], first is not None, last is not None)
        union.embed = None if first is None else first.embed
        union.blocks = nn.ModuleDict({k: b for p in parts for k, b in p.blocks.items()})
        if last is not None:
            union.final_query, union.norm, union.lm_head = last.final_query, last.norm, last.lm_head
            union.final_key_weight, union.mtp = last.final_key_weight, last.mtp
        return union

    def init_rules(self) -> Rules:
        """How each parameter this model (or part) holds starts, by name:

        * linears (and the untied LM head) and the embedding: normal(0, init_std); biases 0;
        * output projections of every sublayer (W_o of KDA/MLA, W_down of the MLPs): normal(0, init_std /
          sqrt(2 * num_layers)), GPT-2's rule: 2 * num_layers branches add into the residual sum, so this
          keeps its variance at init independent of depth (under AttnRes, a mix of the same outputs);
        * norms 1; AttnRes pseudo-queries 0 (every layer starts as a uniform average of its sources, which
          the paper reports matters for stability), their key-norm weights (model.attnres.key_weight) 1;
        * KDA: A_log = log U(1, 16), dt_bias = inverse-softplus of logU(1e-3, 1e-1), short convs as
          nn.Conv1d's default (see KDA.init_rules).
        """
        c = self.cfg
        std, out_std = c.init_std, c.init_std / math.sqrt(2 * c.num_layers)
        rules: Rules = {}
        if self.embed is not None:
            rules["embed.weight"] = normal(std)
        if self.lm_head is not None:
            rules.update({"norm.weight": constant(1.0), "lm_head.weight": normal(std)})
            if self.final_query is not None:
                rules["final_query"] = constant(0.0)
            if self.final_key_weight is not None:
                rules["final_key_weight"] = constant(1.0)
        for i, block in self.blocks.items():
            rules.update(prefixed(f"blocks.{i}.mixer", block.mixer.init_rules(std, out_std)))
            rules.update(prefixed(f"blocks.{i}.mlp", block.mlp.init_rules(std, out_std)))
            rules.update({f"blocks.{i}.{n}": constant(1.0) for n in ("mixer_norm.weight", "mlp_norm.weight")})
            rules.update({f"blocks.{i}.{n}": constant(0.0) for n in ("mixer_query", "mlp_query")
                          if getattr(block, n) is not None})
            rules.update({f"blocks.{i}.{n}": constant(1.0) for n in ("mixer_key_weight", "mlp_key_weight")
                          if getattr(block, n) is not None})
        for k, layer in enumerate(self.mtp or ()):
            rules.update(prefixed(f"mtp.{k}.block.mixer", layer.block.mixer.init_rules(std, out_std)))
            rules.update(prefixed(f"mtp.{k}.block.mlp", layer.block.mlp.init_rules(std, out_std)))
            rules.update({f"mtp.{k}.{n}.weight": constant(1.0)
                          for n in ("embed_norm", "hidden_norm", "norm", "block.mixer_norm",
                                    "block.mlp_norm")})
            rules[f"mtp.{k}.proj.weight"] = normal(std)
        return rules

    def init_parameter(self, name: str, tensor: torch.Tensor, rules: Rules | None = None) -> None:
        """Fill `tensor`, the whole value of parameter `name`, with its initial value, drawn from a
        generator seeded by the model's seed and the name: the same whichever rank, part or device asks (a
        tied LM head draws the embedding's value). rules: self.init_rules(), when already at hand."""
        key = "embed.weight" if name == "lm_head.weight" and self.cfg.tie_embeddings else name
        generator = torch.Generator(device=tensor.device).manual_seed(param_seed(self.init_seed, key))
        (rules or self.init_rules())[name](tensor, generator)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter (see init_rules) and buffer in place."""
        rules = self.init_rules()
        for name, p in self.named_parameters():
            self.init_parameter(name, p, rules)
        self.init_buffers()

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Every buffer starts at zero: the MoE layers' score-correction biases and token counts."""
        for b in self.buffers():
            b.zero_()

    def attnres_queries(self) -> list[nn.Parameter]:
        """Every AttnRes pseudo-query (empty in standard mode), in depth order, the final one last."""
        qs = [q for b in self.blocks.values() for q in (b.mixer_query, b.mlp_query) if q is not None]
        return qs + ([self.final_query] if self.final_query is not None else [])

    def final_site_query(self) -> torch.Tensor | None:
        """The final depth mix's effective pseudo-query (its key-norm weight folded in, if it has one)."""
        return site_query(self.param("final_query"), self.param("final_key_weight"))

    def sublayers(self) -> list[tuple[str, Sublayer]]:
        """(qualified name, module) of every token mixer and MLP, in depth order."""
        blocks = [(f"blocks.{i}", b) for i, b in self.blocks.items()]
        blocks += [(f"mtp.{k}.block", layer.block) for k, layer in enumerate(self.mtp or ())]
        return [(f"{name}.{kind}", getattr(b, kind)) for name, b in blocks for kind in ("mixer", "mlp")]

    def qk_clip_modules(self) -> list[Sublayer]:
        """The sublayers with softmax logits to record for QK-Clip (MLA's)."""
        return [m for _, m in self.sublayers() if m.MAX_LOGITS]

    def record_max_logits(self, enabled: bool = True) -> None:
        """Make every softmax-attention layer record its per-head max logits in the forwards that build a
        graph (what QK-Clip needs; off by default because it costs a pass over the scores on some backends).
        Each layer's qk_clip_specs() entry returns them."""
        for m in self.qk_clip_modules():
            m.set_record_max_logits(enabled)

    def qk_clip_specs(self) -> list[QKClipSpec]:
        """One QK-Clip spec per sublayer that has one, named as in self.named_parameters()."""
        specs = (m.qk_clip_spec(name) for name, m in self.sublayers())
        return [s for s in specs if s is not None]

    def muon_splits(self, per_head: bool = False) -> dict:
        """Fused weights that Muon orthogonalises per logical matrix (see MLA.muon_splits); per_head: also
        the query, key and value projections head by head (optim.muon_per_head)."""
        splits = {}
        for name, m in self.sublayers():
            splits.update(m.muon_splits(name, per_head))
        return splits

    def new_cache(self) -> InferenceCache:
        """An empty decoding state; the first forward with it (the prefill) fills it."""
        return InferenceCache([b.mixer.new_cache() for b in self.blocks.values()])

    def forward(
        self,
        *inputs: torch.Tensor,
        doc_starts: torch.Tensor | None = None,
        cache: InferenceCache | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The first part takes input_ids [B, T]; a later part takes the residual stream's sources from the
        part before it. The last part returns logits [B, T, vocab] in the activation dtype; any other part
        returns the stream's sources, [B, T, d] each, exactly what later sublayers read (see attnres.py).
        With doc_starts, outputs are those of the one packed row: [1, B*T, ...].

        doc_starts: [B, T] bool, True where a document starts (kimi.ops.documents): the rows run as one
        packed row in which nothing crosses a document boundary.
        cache: continue the sequences held in it (see new_cache); it is updated in place.
        labels: [B, T] next tokens: the last part then returns the mean cross-entropy (LMHead) instead of the
        logits, which it need not keep whole.

        Under context parallelism (``context_parallel`` set by kimi.parallel.parallelize; not with a cache)
        the inputs are this rank's shard of every row, T its length, doc_starts its columns of the loader's
        mask, and the outputs are the shard's.
        """
        B, T = inputs[0].shape[:2] if doc_starts is None else doc_starts.shape
        cu_seqlens, context = None, None
        split = self.__dict__.get("context_parallel")
        if split is not None and cache is None:
            context = split.shard(B, T, doc_starts, inputs[0].device)
            doc_starts = None if doc_starts is None else context.packing_starts()
        if doc_starts is not None:
            cu_seqlens = cu_seqlens_from_starts(doc_starts)
            inputs = tuple(x.reshape(1, B * T, *x.shape[2:]) for x in inputs)
        c = self.cfg
        if self.embed is not None:
            stream = make_stream(c.residual, self.embed(inputs[0]), c.attnres.block_size, c.norm_eps,
                                 self.depth_mix)
        else:  # resume after the sublayers of the blocks before this part
            done = 2 * int(next(iter(self.blocks.keys())))
            stream = resume_stream(c.residual, list(inputs), done, c.attnres.block_size, c.norm_eps,
                                   self.depth_mix)
        rows = B if doc_starts is not None else None
        for i, block in self.blocks.items():
            stream = block(stream, cu_seqlens=cu_seqlens, cache=None if cache is None
                           else cache.layers[int(i)],
                           rows=rows, context=context)
        if cache is not None:
            cache.seen_tokens += T
        if self.lm_head is None:
            # as they are, not views: a pipeline schedule detaches stage outputs in place
            return tuple(stream.sources())
        hidden = self.run_through("final", lambda query, *sources: stream.mix(query, sources, self.norm),
                                  self.final_site_query(), *stream.sources())
        if labels is None:
            return self.lm_head(hidden)
        if self.lm_head.vocab_parallel:  # its logits leave the module sharded: the loss is taken outside it
            return lm_loss(self.lm_head(hidden), labels)
        loss = self.lm_head(hidden, labels)
        if self.mtp is not None and self.training:  # multi-token prediction trains; it never evaluates
            trunk = stream.mix(self.final_site_query())
            loss = loss + c.mtp.loss_weight * mtp_loss(self.mtp, self.embed, self.lm_head, trunk, labels,
                                                       cu_seqlens=cu_seqlens, rows=rows)
        return loss

    def num_params(self, exclude_embedding: bool = False) -> int:
        """Parameters counted once (a tied LM head is the embedding). exclude_embedding drops the token
        embedding table (and with it a tied LM head)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if exclude_embedding and self.embed is not None else n

    def num_active_params(self) -> int:
        """Parameters one token uses (num_params less the routed experts it is not sent to)."""
        return self.num_params() - sum(m.inactive_params() for _, m in self.sublayers())

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs (forward + backward) per token of the whole model at sequence length seq_len:
        the sum of :func:`training_flops` over its blocks and its end (the same numbers that balance
        pipeline stages)."""
        blocks, end = training_flops(self.cfg, seq_len)
        return float(sum(blocks) + end)


def mtp_block(cfg: ModelConfig) -> Block:
    """A multi-token-prediction depth's block (kimi/model/mtp.py): the last trunk block's token mixer and a
    dense MLP, joined by a plain residual."""
    import dataclasses

    return Block(dataclasses.replace(cfg, residual="standard"), block_classes(cfg)[-1][0], mlp_class("dense"),
                 first=True)


def block_classes(cfg: ModelConfig) -> list[tuple[type, type]]:
    """(token mixer class, MLP class) of each block, from the registry (kimi/model/registry.py)."""
    return [(mixer, mlp_class(kind)) for mixer, kind in zip(mixer_classes(cfg), mlp_kinds(cfg))]


# training_flops's results by (repr(cfg), seq_len): the planner splits a pipeline's stages by them for each
# layout it walks, and building a K3-sized model's blocks on the meta device takes about half a second
_FLOPS: dict = {}


def training_flops(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float]:
    """Training FLOPs (forward + backward) per token at sequence length seq_len, per block and for the
    model's end (final norm, AttnRes query, LM head):

        6 * N  +  each sublayer's flops_per_token(seq_len)

    * N = the parameters involved: every one does one multiply-add per token forward and two backward.
      The LM head always counts (even tied); the embedding lookup does not (it is a gather). The short
      convolutions' taps are exactly such parameters (one multiply-add per token each). Norm weights,
      biases, A_log etc. are counted too, a negligible overcount. Parameters a token does not use (the
      routed experts it is not sent to: a sublayer's inactive_params) do not count.
    * Multi-token prediction's depths (model.mtp.layers) count with the end: their blocks the same way, and
      each its own pass through the LM head.
    * What the parameters do not show, each sublayer declares (kimi/model/sublayer.py): softmax attention's
      scores over the sequence, KDA's chunkwise state (docs/algorithms.md section 1).
    Not counted: the AttnRes depth mixing (12 d FLOPs per source and token at each mixing site: under 1% of
    every preset's step), gates' elementwise work, softmax exponentials. Convention and the check of every
    preset against torch's FlopCounterMode: kimi/ops/flops.py, tests/ops/test_flop_count.py,
    docs/benchmarks.md. Counted on the meta device: no memory; computed once per config and length.
    """
    key = (repr(cfg), seq_len)
    if key not in _FLOPS:
        _FLOPS[key] = _count_flops(cfg, seq_len)
    blocks, end = _FLOPS[key]
    return list(blocks), end


def _count_flops(cfg: ModelConfig, seq_len: int) -> tuple[list[float], float]:
    blocks = []
    with torch.device("meta"):
        for i, (mixer, mlp) in enumerate(block_classes(cfg)):
            block = Block(cfg, mixer, mlp, first=i == 0)
            params = sum(p.numel() for p in block.parameters())
            subs = (block.mixer, block.mlp)
            blocks.append(6.0 * (params - sum(m.inactive_params() for m in subs))
                          + sum(m.flops_per_token(seq_len) for m in subs))
    # LM head, final norm, query
    end = 6.0 * cfg.d_model * (cfg.vocab_size + 1 + (cfg.residual != "standard"))
    if cfg.mtp.layers:  # each depth: its block, projection and norms, and one more pass through the LM head
        with torch.device("meta"):
            layer = MTPLayer(cfg.d_model, cfg.norm_eps, mtp_block(cfg))
        subs = (layer.block.mixer, layer.block.mlp)
        depth = 6.0 * (sum(p.numel() for p in layer.parameters()) + cfg.d_model * cfg.vocab_size)
        end += cfg.mtp.layers * (depth + sum(m.flops_per_token(seq_len) for m in subs))
    return blocks, end


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position, in fp32: the one training and validation loss
    (also the pipeline schedule's, per micro-batch). Vocabulary-sharded logits need torch's
    loss_parallel()."""
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
