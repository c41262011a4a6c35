"""wandb for a run: which mode (online, offline, disabled), which run id a resumed start continues, and a
start that falls back to offline with one line when online cannot start."""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Dict, Optional


from kimi.config import WANDB_MODES, ConfigError, WandbConfig

WANDB_ONLINE_TIMEOUT_S = 20.0  # wandb's own default (90 s, then a traceback) holds every start of a run


def wandb_mode(cfg: WandbConfig) -> str:
    """logging.wandb.mode; where the config leaves it null, $WANDB_MODE (wandb's own variable), else
    offline."""
    if cfg.mode is not None:
        return cfg.mode
    env = os.environ.get("WANDB_MODE", "").strip()
    mode = {"": "offline", "dryrun": "offline", "run": "online"}.get(env, env)  # wandb's older spellings
    if mode not in WANDB_MODES:
        raise ConfigError(f"WANDB_MODE={env!r} in the environment is invalid: choose one of "
                          f"{'|'.join(WANDB_MODES)}, or set logging.wandb.mode (which wins over it)")
    return mode



def start_wandb(cfg: WandbConfig, run_dir: Path, config: Dict[str, Any], wandb_id: str,
                rewound: Optional[str] = None):
    """wandb's run `wandb_id` (wandb_run_id) for `run_dir`. Online without credentials is a one-line
    ConfigError at once (there is nothing to wait for); online without a reachable server logs offline
    instead, with one warning line, after WANDB_ONLINE_TIMEOUT_S, as a wandb run of its own
    (`<id>-offline-<hex>`): a network outage should not cost a training run (`wandb sync` uploads it later).
    Null keys leave wandb's environment variables in charge (WANDB_ENTITY, WANDB_NAME, WANDB_RUN_GROUP,
    WANDB_TAGS); the project is logging.wandb.project, $WANDB_PROJECT, else kimi."""
    import wandb

    notes = (f"resumed from an older checkpoint than wandb run {rewound} had logged: this run continues it"
             if rewound else None)

    def init(mode: str, run_id: str = wandb_id, **settings):
        return wandb.init(project=cfg.project or os.environ.get("WANDB_PROJECT") or "kimi", entity=cfg.entity,
                          name=cfg.name, group=cfg.group, tags=list(cfg.tags) or None, notes=notes, mode=mode,
                          dir=str(run_dir), config=config, resume="allow", id=run_id,
                          # quiet and silent: our own lines already say everything wandb would print (quiet
                          # alone still lets its start banner through); wrap: what the console shows also goes
                          # to the run's Logs tab (offline: in the record, which `wandb sync` uploads), the
                          # console itself unchanged
                          settings=wandb.Settings(quiet=True, silent=True, console="wrap", **settings))

    mode = wandb_mode(cfg)
    if mode != "online":
        return tokens_axis(init(mode))
    try:
        return tokens_axis(init("online", init_timeout=WANDB_ONLINE_TIMEOUT_S))
    except wandb.errors.UsageError as e:
        raise ConfigError(f"logging.wandb.mode=online, but wandb cannot start: {_first_line(e)}. Set "
                          "WANDB_API_KEY (or run `wandb login`), or use logging.wandb.mode=offline and "
                          "`wandb sync` later") from None
    except wandb.errors.CommError as e:
        # wandb's service still holds the online attempt's id ("run ID is in use"): the offline record is a
        # run of its own, which `wandb sync` uploads beside the online one
        offline_id = f"{wandb_id}-offline-{uuid.uuid4().hex[:6]}"
        print(f"[kimi] warning: wandb's server did not answer within {WANDB_ONLINE_TIMEOUT_S:.0f} s "
              f"({_first_line(e)}): logging offline to {run_dir / 'wandb'} as run {offline_id} instead; "
              "upload it with `wandb sync` once the network is back", flush=True)
        return tokens_axis(init("offline", run_id=offline_id))


def offline_sync_hint(folder: Path) -> str:
    """The line that ends a start logged offline: where its record is and the command that uploads it."""
    return f"[kimi] wandb: logged offline to {folder}; upload it with: wandb sync {folder}"


def tokens_axis(run):
    """Make the tokens trained so far (every row's `tokens`, MetricsLogger.log) the default x axis of every
    chart: runs of different batch sizes line up where they have seen the same data. Step stays a choice in
    each panel's x-axis setting."""
    run.define_metric("tokens")
    run.define_metric("*", step_metric="tokens")
    return run


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0].rstrip(".")
