"""Reading checkpoints without trusting them: nothing under a run directory can run code when loaded.

torch.distributed.checkpoint reads ``.metadata`` with ``pickle.load`` and non-tensor entries with
``torch.load(weights_only=False)``: a planted file could execute anything on resume or generation. Here the
metadata goes through an unpickler that admits only the classes DCP's metadata is made of, and non-tensor
entries through ``torch.load(weights_only=True)`` (plain containers, numbers, strings and tensors). What we
write is already limited to those: the trainer stores its non-tensor state as JSON text or tensors.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

_DCP = "torch.distributed.checkpoint."
_ALLOWED = {
    (_DCP + "metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {(_DCP + "filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
     ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
     ("pathlib", "PurePosixPath")}


class UntrustedCheckpoint(pickle.UnpicklingError):
    """A checkpoint file refers to something a checkpoint never needs (so it was not written by DCP)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                           torch.dtype)):
            return super().find_class(module, name)
        raise UntrustedCheckpoint(f"refers to {module}.{name}, which checkpoint metadata never contains")


def load_metadata(stream) -> Metadata:
    try:
        metadata = _MetadataUnpickler(stream).load()
    except UntrustedCheckpoint:
        raise
    except Exception as e:  # noqa: BLE001 (empty, cut short, or not a pickle at all)
        raise UntrustedCheckpoint(f"is not checkpoint metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise UntrustedCheckpoint(f"holds a {type(metadata).__name__}, not checkpoint metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with the metadata read by the restricted unpickler."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load_metadata(f)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner with non-tensor entries read by ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
