"""Read a torch.distributed.checkpoint (DCP) folder into one state dict, safely.

torch reads DCP's ``.metadata`` with plain ``pickle.load`` and non-tensor entries with
``torch.load(weights_only=False)``: a hostile folder runs code. ckptkit first lists the
globals in ``.metadata`` without running them and admits only DCP's own metadata classes,
and loads non-tensor entries weights-only, unless the caller trusts the folder.
"""

from __future__ import annotations

import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

from ._errors import PICKLE_ERRORS, CheckpointFormatError, CkptkitError, UnsafeCheckpointError, summarize
from ._formats import ClampedReader, filter_unsafe, pickle_globals
from ._lazy_pickle import DTYPES

_DCP_CLASSES = ("torch.distributed.checkpoint.metadata.", "torch.distributed.checkpoint.filesystem._StorageInfo")
_OTHER_SAFE = frozenset(
    {"torch.Size", "torch.serialization._get_layout", "collections.OrderedDict", "builtins.set", "builtins.frozenset",
     "pathlib.PosixPath", "pathlib.PurePosixPath", "pathlib.WindowsPath", "pathlib.PureWindowsPath",
     "torch.strided", "torch.contiguous_format"}
)  # fmt: skip


def _safe(name: str) -> bool:
    if name in _OTHER_SAFE or name.startswith(_DCP_CLASSES[0]) or name == _DCP_CLASSES[1]:
        return True
    module, _, attr = name.rpartition(".")
    return module == "torch" and attr in DTYPES


def metadata_globals(path: str | os.PathLike[str]) -> list[str]:
    """The globals a DCP folder's ``.metadata`` pickle names, in first-use order."""
    meta = Path(path) / ".metadata"
    with open(meta, "rb") as f:
        return list(dict.fromkeys(pickle_globals(ClampedReader(f))))  # type: ignore[arg-type]


def read_dcp(path: str | os.PathLike[str], *, trust: bool = False) -> dict[str, Any]:
    """Load a DCP folder into a nested dict of CPU tensors and values.

    Raises:
        UnsafeCheckpointError: ``.metadata`` names globals outside DCP's own classes.
        CheckpointFormatError: metadata or shards are missing or damaged.
    """
    folder = Path(path)
    try:
        unsafe = [g for g in metadata_globals(folder) if not _safe(g)]
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{folder}/.metadata: {e}") from e
    if unsafe and not trust:
        raise UnsafeCheckpointError(
            f"{folder}: refused to load: its .metadata needs {len(unsafe)} global(s) beyond DCP's own metadata "
            f"classes: {summarize(unsafe)}. torch would unpickle them with plain pickle, which can run code. "
            "If you trust this folder, pass trust=True (CLI: --trust)",
            unsafe,
        )
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class _Planner(_EmptyStateDictLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: Any, value: Any) -> None:
            if trust:
                return super().load_bytes(read_item, value)
            fqn = read_item.dest_index.fqn
            try:
                obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                value.seek(0)
                raise _unsafe_entry(folder, fqn, value) from e
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element  # type: ignore[import-not-found]

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    from torch.distributed.checkpoint.api import CheckpointException

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_Planner(), no_dist=True)
    except CkptkitError:
        raise
    except CheckpointException as e:  # a BaseException: DCP wraps each rank's failure in it
        cause = _first_failure(e)
        if isinstance(cause, CkptkitError):
            raise cause from e
        what = f"{type(cause).__name__}: {cause}" if cause is not None else "unknown failure"
        raise CheckpointFormatError(f"{folder}: cannot read this torch.distributed.checkpoint: {what}") from e
    except PICKLE_ERRORS as e:
        raise CheckpointFormatError(f"{folder}: cannot read this torch.distributed.checkpoint: {type(e).__name__}: {e}") from e
    return state


def _first_failure(e: BaseException) -> BaseException | None:
    for failure in getattr(e, "failures", {}).values():
        # (exception, traceback frames) in torch 2.13; a WrappedException in some releases.
        failure = failure[0] if isinstance(failure, tuple) and failure else failure
        return getattr(failure, "exception", failure)
    return None


def _unsafe_entry(folder: Path, fqn: str, value: io.BytesIO) -> UnsafeCheckpointError:
    try:
        with zipfile.ZipFile(value) as zf:
            names = [n for n in zf.namelist() if n.endswith("data.pkl")]
            unsafe = filter_unsafe(pickle_globals(zf.read(names[0]))) if names else []
    except (zipfile.BadZipFile, CheckpointFormatError, IndexError):
        unsafe = []
    listed = summarize(unsafe) if unsafe else "globals outside the weights-only allowlist"
    return UnsafeCheckpointError(
        f"{folder}: refused to load entry {fqn!r}: it needs {listed}. Unpickling could run arbitrary code; "
        "if you trust this folder, pass trust=True (CLI: --trust)",
        unsafe,
    )
