"""The layouts `kimi.convert to-hf` writes a model in, by name: the registry `layout=` chooses from.

A layout is a class here and one entry in LAYOUTS. It says which config.json it writes (`config(cfg)`,
NotExpressible naming a setting it cannot hold, before anything is written), which file tensor comes from
which tensor of ours (`file_map(cfg)`, kimi.interop.hf's FileEntry), how to read its config.json back
(`model_fields`), whether a config.json is its own (`detect`, for the layouts import tells apart: K3's,
remote code's; Kimi Linear's release and save_pretrained layouts differ in tensor names only, and reading
accepts both), and the words to-hf's --help and last line use for it. kimi.convert and kimi.interop.hf_folder
ask only these, so a new layout changes no code there.

The export with its own modeling code (kimi.interop.remote) is no `layout=` value: remote_code=true chooses
it, and so does the release layout for a model transformers' class cannot express (`falls_back`). It is
REMOTE_CODE here, so that import detects it and to-hf's message names it the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List

from kimi.model.config import ModelConfig

# each layout imports its module (torch, the model) when it is used: the registry alone (to-hf's --help, its
# layout= choices) starts without torch
if TYPE_CHECKING:
    from kimi.interop import hf

DEFAULT = "release"


class Layout:
    """A Hugging Face folder layout: config.json and safetensors tensor names."""
    name = ""
    help = ""  # its tensor names, for to-hf's --help
    wrote = ""  # to-hf's "wrote OUT: config.json and safetensors{wrote}" fragment
    # non-empty: a model this layout cannot express is written with its own modeling code instead, to-hf
    # saying this and the setting
    falls_back = ""
    own_code = False  # the folder holds its modeling code (REMOTE_CODE): read by kimi.interop.remote

    def detect(self, config: Dict[str, Any]) -> bool:
        """Whether `config` (a folder's config.json) is in this layout and no other."""
        return False

    def config(self, cfg: ModelConfig) -> Dict[str, Any]:
        raise NotImplementedError(f"the {self.name} layout writes no config.json of its own")

    def file_map(self, cfg: ModelConfig) -> List[hf.FileEntry]:
        raise NotImplementedError(f"the {self.name} layout has no file map")

    def model_fields(self, config: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError(f"the {self.name} layout is read by kimi.interop.remote")


class Release(Layout):
    """Kimi-Linear-48B-A3B's released layout, which transformers, vLLM and mlx-lm read."""
    name = "release"
    help = "the released Kimi Linear checkpoints' (default; what every loader reads)"
    wrote = " for KimiLinearForCausalLM"
    falls_back = "not for KimiLinearForCausalLM"

    def config(self, cfg: ModelConfig) -> Dict[str, Any]:
        from kimi.interop import hf

        return hf.release_config(cfg)

    def file_map(self, cfg: ModelConfig) -> List[hf.FileEntry]:
        from kimi.interop import hf

        return hf.file_map(cfg, self.name)

    def model_fields(self, config: Dict[str, Any]) -> Dict[str, Any]:
        from kimi.interop import hf

        return hf.model_fields(config)


class SavePretrained(Release):
    """The release's config.json with the tensor names transformers' save_pretrained writes (hf.RENAMES)."""
    name = "save_pretrained"
    help = "the ones transformers' save_pretrained writes (dense MLP under block_sparse_moe)"
    falls_back = ""  # what a user asks for by name is never replaced by another layout


class K3(Layout):
    """Kimi K3's released layout (kimi.interop.k3), which mlx-lm's kimi_k3 reads."""
    name = "k3"
    help = "Kimi K3's (kimi_k3: text_config, language_model.)"
    wrote = " in Kimi K3's layout"

    def detect(self, config: Dict[str, Any]) -> bool:
        from kimi.interop import k3

        return k3.is_k3(config)

    def config(self, cfg: ModelConfig) -> Dict[str, Any]:
        from kimi.interop import k3

        return k3.k3_config(cfg)

    def file_map(self, cfg: ModelConfig) -> List[hf.FileEntry]:
        from kimi.interop import k3

        return k3.k3_file_map(cfg)

    def model_fields(self, config: Dict[str, Any]) -> Dict[str, Any]:
        from kimi.interop import k3

        return k3.k3_model_fields(config)


class RemoteCode(Layout):
    """Any model with its own modeling code (trust_remote_code): kimi.interop.remote writes and reads it."""
    name = "remote code"
    own_code = True

    def detect(self, config: Dict[str, Any]) -> bool:
        from kimi.interop import remote

        return remote.is_remote(config)


LAYOUTS: Dict[str, Layout] = {layout.name: layout for layout in (Release(), SavePretrained(), K3())}
REMOTE_CODE = RemoteCode()


def get(name: str) -> Layout:
    """The registered layout `name`; a ValueError naming the others for any other name."""
    if name not in LAYOUTS:
        raise ValueError(f"layout={name}: no such layout; the layouts are {', '.join(LAYOUTS)}")
    return LAYOUTS[name]


def of_config(config: Dict[str, Any]) -> Layout:
    """The layout a folder's config.json is in: the first that detects it, else Kimi Linear's release (whose
    reading also takes save_pretrained's tensor names)."""
    return next((layout for layout in (REMOTE_CODE, *LAYOUTS.values()) if layout.detect(config)),
                LAYOUTS[DEFAULT])
