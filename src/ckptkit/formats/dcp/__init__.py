"""torch.distributed.checkpoint (DCP) metadata, checked without running it.

torch reads DCP's ``.metadata`` with plain ``pickle.load``: a hostile folder runs code. This
lists the globals ``.metadata`` names, without importing them, and tells DCP's own metadata
classes (safe to unpickle) from anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

from ...io.fileio import ClampedReader, open_regular
from ..dtypes import BY_NAME
from ..pickles.scan import pickle_globals
from .detect import DCP_METADATA

# What a reader says of a folder torch's reader cannot read either (a writer never wrote it), said once
DAMAGED = "the folder is damaged: restore it from a good copy or save it again"

# Exact names: a protocol-4 pickle can name a dotted attribute of a module (STACK_GLOBAL with
# qualname "os.system" in torch.distributed.checkpoint.metadata is os.system), so a prefix
# match would admit anything those modules import.
_DCP_CLASSES = frozenset(
    [
        f"torch.distributed.checkpoint.metadata.{c}"
        for c in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ]
    + ["torch.distributed.checkpoint.filesystem._StorageInfo"]
    # megatron-core's torch_dist pickles its save plans in .metadata (all_local_plans): torch's
    # planner dataclasses, read as inert stand-ins and never used
    + [
        f"torch.distributed.checkpoint.planner.{c}"
        for c in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData")
    ]
)
_OTHER_SAFE = frozenset(
    {
        "torch.Size",
        "torch.serialization._get_layout",
        "collections.OrderedDict",
        "builtins.set",
        "builtins.frozenset",
        "pathlib.PosixPath",
        "pathlib.PurePosixPath",
        "pathlib.WindowsPath",
        "pathlib.PureWindowsPath",
        "torch.strided",
        "torch.contiguous_format",
    }
)


def is_dcp_class(name: str) -> bool:
    """True for a global DCP's ``.metadata`` may name safely (its dataclasses, dtypes, paths)."""
    if name in _OTHER_SAFE or name in _DCP_CLASSES:
        return True
    module, _, attr = name.rpartition(".")
    return module == "torch" and attr in BY_NAME


def unsafe_metadata_globals(path: str | os.PathLike[str]) -> list[str]:
    """The globals a DCP folder's ``.metadata`` names beyond DCP's own metadata classes."""
    return [g for g in metadata_globals(path) if not is_dcp_class(g)]


def metadata_globals(path: str | os.PathLike[str]) -> list[str]:
    """The globals a DCP folder's ``.metadata`` pickle names, in first-use order."""
    meta = Path(path) / DCP_METADATA
    with open_regular(meta, folder=path) as f:
        return list(dict.fromkeys(pickle_globals(ClampedReader(f))))  # type: ignore[arg-type]
