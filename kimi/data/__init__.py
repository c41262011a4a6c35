"""Data pipeline: documents (sources) -> tokens (tokenizer, encode) -> token shards with a document index
(shards, pack; `python -m kimi.data.prepare`) ->
resumable batches of windows with document boundaries (loader).

The names below are imported on first use, so that importing the data's torch-free config
(kimi/data/config.py, which kimi.config assembles) does not import torch and the pipeline.
"""

import sys
from types import ModuleType
from typing import TYPE_CHECKING

from kimi import lazy_getattr

_WHERE = {
    "Batch": "loader", "TokenLoader": "loader", "PreparedData": "pack", "open_split": "pack",
    "open_tokens": "pack", "read_tokens": "pack", "prepare": "prepare", "DataError": "sources",
    "load_documents": "sources", "Tokenizer": "tokenizer", "train_tokenizer": "tokenizer",
}
__all__ = ["Batch", "DataError", "PreparedData", "TokenLoader", "Tokenizer", "load_documents", "open_split",
           "open_tokens", "prepare", "read_tokens", "train_tokenizer"]


__getattr__ = lazy_getattr(__name__, _WHERE)


class _Package(ModuleType):
    """kimi.data.prepare is the function prepare, as it always was, though the package of the same name
    (kimi/data/prepare/) is bound here, over it, when it is first imported: the function is kept."""

    def __setattr__(self, name, value):
        if name == "prepare" and isinstance(value, ModuleType):
            value = value.prepare
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if TYPE_CHECKING:  # for type checkers: the names of __all__, which __getattr__ imports at run time
    from .loader import Batch, TokenLoader  # noqa: F401
    from .pack import PreparedData, open_split, open_tokens, read_tokens  # noqa: F401
    from .prepare import prepare  # noqa: F401
    from .sources import DataError, load_documents  # noqa: F401
    from .tokenizer import Tokenizer, train_tokenizer  # noqa: F401
