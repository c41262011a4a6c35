"""Where the YAML presets are, for every command that composes a config (training, kimi.summary,
kimi.data.prepare, kimi.ablate, kimi.cli's override check).

In a checkout (`python train.py`, an editable install) they are the repository's conf/, beside the kimi
package, so a preset added there is used at once. A wheel (`pip install .`) carries the same files as the
package data of ``kimi.conf`` (setup.py maps that package onto conf/), and Hydra reads them through its
``pkg://`` search path, from whatever directory the command runs in.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

PACKAGE = "kimi.conf"
KIMI = Path(__file__).resolve().parents[1]  # the kimi package (this file is kimi/cli/conf_dir.py)


def checkout_conf() -> Optional[Path]:
    """The checkout's conf/ when this kimi package runs from one (or from a copy of kimi/ and conf/), else
    None. A wheel's own copy inside the package comes first: in site-packages an unrelated top-level `conf`
    directory could lie beside kimi."""
    if (KIMI / "conf" / "config.yaml").is_file():
        return None
    conf = KIMI.parent / "conf"
    return conf if (conf / "config.yaml").is_file() else None


def conf_dir() -> Path:
    """The presets' directory: the checkout's conf/, else the installed package's copy (kimi/conf)."""
    found = checkout_conf()
    if found is not None:
        return found
    installed = KIMI / "conf"
    if not (installed / "config.yaml").is_file():
        from kimi.errors import ConfigError

        raise ConfigError(f"no configs: neither a checkout's conf/ nor {installed} holds config.yaml; "
                          "reinstall kimi (pip install .) or run from a checkout")
    return installed


def search_path() -> str:
    """Where Hydra looks for the configs: the checkout's directory, or the installed package (pkg://)."""
    found = checkout_conf()
    if found is not None:
        return str(found)
    conf_dir()  # one line when the package data is missing, instead of Hydra's "primary config not found"
    return f"pkg://{PACKAGE}"


def compose(overrides, where: Optional[str] = None, config_name: str = "config"):
    """The config (a DictConfig, not yet resolved) these overrides give, composed from `where` (a directory
    or pkg://module; default search_path()) with the structured schema registered, as training composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir, initialize_config_module

    from kimi.config import register_configs

    register_configs()
    where = where or search_path()
    init = (initialize_config_module(config_module=where[len("pkg://"):], version_base="1.3")
            if where.startswith("pkg://") else initialize_config_dir(config_dir=where, version_base="1.3"))
    with init:
        cfg = hydra_compose(config_name, overrides=list(overrides))
    if "model" in cfg:  # the model section's old flat keys moved to their sections, with one line
        from kimi.model.config import announce_aliases, resolve_aliases

        announce_aliases(resolve_aliases(cfg.model))
    return cfg
