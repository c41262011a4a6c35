"""The optimizer section (optim.*): its schema and the names optim.name takes.

Torch-free, like every section's config (kimi/schema/__init__.py); the section's rules are
kimi/optim/rules.py's, its optimizers kimi/optim/registry.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from kimi.schema.vocabulary import one_of

# optim.name's names: the table of kimi/optim/registry.py, which fills it (it imports this module)
OPTIMIZERS: Dict[str, Any] = {}
SCHEDULES = ("cosine", "wsd", "constant")
NS_DTYPES = ("auto", "fp32", "bf16")
ADJUST_LR_FNS = ("match_rms_adamw", "original")


@dataclass
class OptimConfig:
    name: str = one_of(OPTIMIZERS, "muonclip")
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    schedule: str = one_of(SCHEDULES, "cosine")  # all after linear warmup
    warmup_steps: int = 30
    min_lr_ratio: float = 0.1  # final lr as a fraction of lr (cosine and wsd)
    decay_fraction: float = 0.2  # wsd: fraction of max_steps spent decaying
    # MuonClip only (kimi/optim/muonclip.py); lr, weight_decay, betas and eps above serve its AdamW family.
    momentum: float = 0.95  # Muon momentum
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    ns_dtype: str = one_of(NS_DTYPES, "auto")  # Newton-Schulz matmuls: auto = bf16 on CUDA, fp32 elsewhere
    # Muon's lr scale: match_rms_adamw (0.2 sqrt(max(A,B))) | original (sqrt(max(1,A/B)))
    adjust_lr_fn: str = one_of(ADJUST_LR_FNS, "match_rms_adamw")
    # fnmatch patterns over parameter names that force a family; null keeps the default (embed, lm_head)
    adamw_patterns: Optional[List[str]] = None
    muon_patterns: List[str] = field(default_factory=list)
    # Orthogonalise MLA's fused projections per logical matrix (true) or each weight whole (false: what
    # torch.optim.Muon and Moonlight do); one of the ablations (conf/experiment)
    muon_split_fused: bool = True
    # Kimi K3's per-head Muon: each head's block of the query, key and value projections (KDA q/k/v, MLA's
    # query and W_ukv: keys and values of a head apart) orthogonalised alone, its update scaled by its own
    # shape; the other matrices whole, or per logical matrix with muon_split_fused
    muon_per_head: bool = False
    # QK-Clip threshold on each MLA head's max scaled logit (K2: 100); 0 disables QK-Clip
    qk_clip_tau: float = 100.0
