"""Data sources by their data.source name: adding one is a class following :class:`DataSource` and one line
in ``SOURCES``, whose names are data.source's allowed values (kimi.data.config.DATA_SOURCES).

An entry is ``module:Class`` inside kimi.data, imported when first asked for (the built-in sources live in
kimi/data/sources.py, which imports this module for the base class), or the class itself. Callers ask
:func:`source_for` for the configured source and never compare data.source with a name.
"""

from __future__ import annotations

from typing import Any, ClassVar, Dict, List, Tuple, Union

from kimi.data.config import DATA_SOURCES, DataConfig
from kimi.errors import DataError, one_line
from kimi.schema.vocabulary import registered

# The table is kimi.data.config.DATA_SOURCES itself, the values validate() allows for data.source: the config
# is imported first and cannot import this module, so the entries are made here.
SOURCES: Dict[str, Union[str, type]] = DATA_SOURCES
SOURCES.update({
    "shakespeare": "sources:ShakespeareSource",
    "hf": "sources:HubSource",
    "files": "sources:FilesSource",
})


class DataSource:
    """One kind of data.source, built from the data config (data.*, or a blend entry merged over it).

    Every source ends as a ``datasets.Dataset`` with one ``text`` column and one row per document, so
    tokenisation and packing never care where the text came from. A subclass defines ``documents`` and
    ``identity``; the rest has defaults:

      documents(split)   every document of data.train_split or data.val_split (a source without
                         NAMED_SPLITS is only asked for data.train_split, and data.val_fraction of what it
                         returns is held out for validation)
      identity()         what the documents depend on, as plain JSON data (part of the token cache's key:
                         equal identities mean equal documents); cheap, no loading where possible
      stream(split)      its rows as a datasets IterableDataset (data.streaming=true); only with STREAMS
      text_field()       the column of a streamed row that holds the text
      check(key)         its own config rules, as kimi.config.check calls (key: "data" or the blend entry)
      where()            the source in one line, for error messages
      undecodable(e)     the error for text found not to be UTF-8 while it was tokenised
    """

    NAMED_SPLITS: ClassVar[bool] = False  # data.train_split / data.val_split name its splits
    STREAMS: ClassVar[bool] = False  # data.streaming=true can read it
    # data.prepare_workers can split it: its documents come from data.data_files (kimi/data/prepare/parts.py)
    BY_FILE: ClassVar[bool] = False

    def __init__(self, cfg: DataConfig):
        self.cfg = cfg

    def documents(self, split: str) -> Any:
        raise NotImplementedError

    def identity(self) -> Dict[str, Any]:
        raise NotImplementedError

    def stream(self, split: str) -> Any:
        raise DataError(f"data.streaming reads data.source={' or '.join(names_where('STREAMS'))}, not "
                        f"{self.cfg.source!r}: set data.streaming=false")

    def text_field(self) -> str:
        return self.cfg.text_field

    def check(self, key: str) -> None:
        pass

    def where(self) -> str:
        return f"data.source={self.cfg.source}"

    def undecodable(self, e: UnicodeDecodeError) -> DataError:
        return DataError(f"{self.where()} holds text that is not valid UTF-8 ({one_line(e)}); convert it to "
                         "UTF-8")

    def load_stream(self, split: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Any:
        """``datasets.load_dataset(*args, streaming=True, **kwargs)``, a failure one line naming ``split``."""
        import datasets

        try:
            return datasets.load_dataset(*args, streaming=True, **kwargs)
        except Exception as e:  # noqa: BLE001 (datasets wraps what went wrong in its own error types)
            raise DataError(f"cannot stream {self.where()}[{split}]: {one_line(e)}; check the source or set "
                            "data.streaming=false") from e


def source_class(name: str) -> type:
    if name not in SOURCES:
        raise DataError(f"data.source={name!r}: choose {'|'.join(SOURCES)}")
    return registered(SOURCES[name], __package__)


def source_for(cfg: DataConfig) -> DataSource:
    """The configured source (data.source's class, built from ``cfg``)."""
    return source_class(cfg.source)(cfg)


def names_where(flag: str) -> List[str]:
    """The names of the sources whose class sets ``flag`` (NAMED_SPLITS, STREAMS, BY_FILE), in table order."""
    return [name for name in SOURCES if getattr(source_class(name), flag)]
