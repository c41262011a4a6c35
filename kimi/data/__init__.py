"""Data pipeline: documents (sources) -> sentencepiece tokens (tokenizer) -> flat token files (pack) ->
resumable batches of windows with document boundaries (loader)."""

from kimi.data.loader import Batch, TokenLoader
from kimi.data.pack import PreparedData, open_tokens, prepare
from kimi.data.sources import DataError, load_documents
from kimi.data.tokenizer import Tokenizer, train_tokenizer

__all__ = ["Batch", "DataError", "PreparedData", "TokenLoader", "Tokenizer", "load_documents", "open_tokens",
           "prepare", "train_tokenizer"]
