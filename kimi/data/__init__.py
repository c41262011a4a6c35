"""Data pipeline: documents (sources) -> tokens (tokenizer, encode) -> token shards with a document index
(shards, pack; `python -m kimi.data.prepare`) ->
resumable batches of windows with document boundaries (loader)."""

from kimi.data.loader import Batch, TokenLoader
from kimi.data.pack import PreparedData, open_split, open_tokens, read_tokens
from kimi.data.prepare import prepare  # the function: bound after the submodule of the same name
from kimi.data.sources import DataError, load_documents
from kimi.data.tokenizer import Tokenizer, train_tokenizer

__all__ = ["Batch", "DataError", "PreparedData", "TokenLoader", "Tokenizer", "load_documents", "open_split",
           "open_tokens", "prepare", "read_tokens", "train_tokenizer"]
