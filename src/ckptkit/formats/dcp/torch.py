"""Read a torch.distributed.checkpoint (DCP) folder into one state dict, safely.

torch reads DCP's ``.metadata`` with plain ``pickle.load`` and non-tensor entries with
``torch.load(weights_only=False)``: a hostile folder runs code. ckptkit first lists the globals
in ``.metadata`` without running them and admits only DCP's own metadata classes (and what the
caller allows), and loads non-tensor entries weights-only, unless the caller trusts the folder.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

from ..distributed.devices import MapLocation, single_device
from ..errors import PICKLE_ERRORS, CheckpointFormatError, CkptkitError, UnsafeCheckpointError
from ..formats.dcp import unsafe_metadata_globals
from ..formats.dcp.meta import read_metadata
from ..formats.pickles.reader import UnsupportedGlobal
from ..formats.pickles.scan import pickle_globals
from ..formats.source import NeedsTorch
from .safety import AllowGlobals, filter_unsafe, global_name, resolve_globals, unsafe_error


def read_dcp(
    path: str | os.PathLike[str],
    *,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    map_location: MapLocation = None,
) -> dict[str, Any]:
    """Load a DCP folder into a nested dict of tensors and values.

    Tensors land on ``map_location`` (a device), or on this rank's device by default.

    Raises:
        UnsafeCheckpointError: ``.metadata`` names globals outside DCP's own classes and
            ``allow_globals``, or an entry needs globals outside torch's allowlist.
        CheckpointFormatError: metadata or shards are missing or damaged.
        ArgumentError: ``map_location`` is not a device.
    """
    folder = Path(path)
    device = single_device(map_location, str(folder), "a torch.distributed.checkpoint folder")
    allowed = resolve_globals(allow_globals)
    try:
        unsafe = unsafe_metadata_globals(folder)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{folder}/.metadata: {e}") from e
    unsafe = [g for g in unsafe if g not in {global_name(a) for a in allowed}]
    if unsafe and not trust:
        raise unsafe_error(str(folder), unsafe, where=" its .metadata", plain_pickle=True)
    try:  # its own checks first: a planner_data index of 10**14 makes torch's reader allocate that
        read_metadata(folder)
    except (NeedsTorch, UnsupportedGlobal):
        pass  # laid out beyond the torch-free reader, or names allowed globals: torch reads it
    state = _load(folder, trust, allowed)
    return _to_device(state, device) if device != "cpu" else state


def _load(folder: Path, trust: bool, allowed: list[Any]) -> dict[str, Any]:
    import torch
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    class _Planner(_EmptyStateDictLoadPlanner):  # type: ignore[misc]
        def load_bytes(self, read_item: Any, value: Any) -> None:
            if trust:
                return super().load_bytes(read_item, value)
            fqn = read_item.dest_index.fqn
            try:
                with torch.serialization.safe_globals(allowed) if allowed else contextlib.nullcontext():
                    obj = torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                value.seek(0)
                raise _unsafe_entry(folder, fqn, value, allowed) from e
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element  # type: ignore[import-not-found]

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=FileSystemReader(str(folder)), planner=_Planner(), no_dist=True)
    except CkptkitError:
        raise
    except CheckpointException as e:  # a BaseException: DCP wraps each rank's failure in it
        cause = first_failure(e)
        if isinstance(cause, CkptkitError):
            raise cause from e
        what = f"{type(cause).__name__}: {cause}" if cause is not None else "unknown failure"
        raise CheckpointFormatError(f"{folder}: cannot read this torch.distributed.checkpoint: {what}") from e
    except PICKLE_ERRORS as e:
        raise CheckpointFormatError(
            f"{folder}: cannot read this torch.distributed.checkpoint: {type(e).__name__}: {e}"
        ) from e
    return state


def _to_device(node: Any, device: str) -> Any:
    import torch

    if isinstance(node, torch.Tensor):
        return node.to(device)
    if isinstance(node, dict):
        return {k: _to_device(v, device) for k, v in node.items()}
    if isinstance(node, list):
        return [_to_device(v, device) for v in node]
    return node


def first_failure(e: BaseException) -> BaseException | None:
    for failure in getattr(e, "failures", {}).values():
        # (exception, traceback frames) in torch 2.13; a WrappedException in some releases.
        failure = failure[0] if isinstance(failure, tuple) and failure else failure
        return getattr(failure, "exception", failure)
    return None


def _unsafe_entry(folder: Path, fqn: str, value: io.BytesIO, allowed: list[Any]) -> UnsafeCheckpointError:
    try:
        with zipfile.ZipFile(value) as zf:
            names = [n for n in zf.namelist() if n.endswith("data.pkl")]
            unsafe = filter_unsafe(pickle_globals(zf.read(names[0])), allowed) if names else []
    except (zipfile.BadZipFile, CheckpointFormatError, IndexError):
        unsafe = []
    return unsafe_error(str(folder), unsafe, where=f" entry {fqn!r}")
