"""The per-head max logits of a softmax-attention sublayer: what QK-Clip reads after each update and a
diagnostic pass shows; and the attention call that measures them (MLA and MHA share both)."""

from __future__ import annotations

import torch

from kimi.ops.attention import attention
from kimi.ops.documents import cu_seqlens_from_starts

from .probe import PROBE


class RecordsMaxLogits:
    """Mixin (before nn.Module in the bases; call ``_init_max_logits(cfg)`` in __init__).

    When set (through KimiModel.record_max_logits, for QK-Clip), every forward that builds a graph records its
    per-head max scaled logit [H] fp32; consume_max_logits() returns the max over them (micro-batches). They
    are kept as a list and reduced on consumption so a forward runs the same ops whatever came before it, as
    selective activation checkpointing requires of a recomputed forward.
    """

    MAX_LOGITS = True
    RECORDS = ("_seen_max_logits",)
    PROBES = ("max_logits",)  # per head, scaled

    def _init_max_logits(self, cfg) -> None:
        self.track_max_logits = False
        self._seen_max_logits: list[torch.Tensor] = []
        # model.attention.backend / attention_deterministic, as attention()'s backend= and deterministic=
        self.attention_options = dict(backend=cfg.attention.backend,
                                      deterministic=cfg.attention.deterministic)

    @property
    def max_logits(self) -> torch.Tensor | None:
        """The per-head max over the recorded forwards since the last consume (None if none)."""
        seen = self._seen_max_logits
        return None if not seen else seen[0] if len(seen) == 1 else torch.stack(seen).amax(dim=0)

    def set_record_max_logits(self, enabled: bool) -> None:
        self.track_max_logits = enabled

    def consume_max_logits(self) -> torch.Tensor | None:
        """The max since the last call (None if no recorded forward), and forget it."""
        out, self._seen_max_logits = self.max_logits, []
        return out

    def logits_wanted(self) -> tuple[bool, bool]:
        """(record, measure) for this forward. Only forwards that build a graph feed an update, so only they
        record: evaluation and generation run under no_grad and must not clip the next step (recomputed
        forwards of activation checkpointing record the same values again, which a max ignores). A diagnostic
        pass (kimi/diagnostics) measures them in its no_grad forward too, without QK-Clip."""
        record = self.track_max_logits and torch.is_grad_enabled()
        return record, record or PROBE.on

    def keep_max_logits(self, max_logits: torch.Tensor, record: bool) -> None:
        """Keep the attention's max logits [B, H] of this forward (as the per-head max over the batch)."""
        max_logits = max_logits.amax(dim=0).detach()
        if record:
            self._seen_max_logits.append(max_logits)
        if PROBE.on:
            PROBE.record(self, max_logits=max_logits)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None,
               context=None) -> torch.Tensor:
        """Causal attention [B, T, H, Dv], keeping its max logits when wanted. Under context parallelism with
        packed documents each row's queries attend over its keys under its own documents."""
        record, measure = self.logits_wanted()
        if context is not None and cu_seqlens is not None:
            out = _rows_over_documents(q, k, v, context.prefix_doc_starts(), measure, self.attention_options)
        else:
            out = attention(q, k, v, causal=True, cu_seqlens=cu_seqlens, return_max_logits=measure,
                            **self.attention_options)
        if measure:
            out, max_logits = out
            self.keep_max_logits(max_logits, record)
        return out


def _rows_over_documents(q, k, v, starts: torch.Tensor, record: bool, options: dict):
    """Each row's queries over its keys under its own documents (starts [rows, Tk]), as attention() returns
    them for the rows stacked."""
    outs = [attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], causal=True, return_max_logits=record,
                      cu_seqlens=cu_seqlens_from_starts(starts[r:r + 1]), **options)
            for r in range(q.shape[0])]
    if not record:
        return torch.cat(outs)
    return torch.cat([o for o, _ in outs]), torch.cat([m for _, m in outs])
