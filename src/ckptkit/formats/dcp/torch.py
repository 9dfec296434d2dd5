"""torch's half of DCP: a folder read into one state dict, safely, and a state dict written as one.

Reading. torch reads DCP's ``.metadata`` with plain ``pickle.load`` and non-tensor entries with
``torch.load(weights_only=False)``: a hostile folder runs code. ckptkit first lists the globals
in ``.metadata`` without running them and admits only DCP's own metadata classes (and what the
caller allows), and loads non-tensor entries weights-only, unless the caller trusts the folder.

Writing. What torch read (a trusted source, a layout only torch reads) DCP's own writer
(``FileSystemWriter``, one process, no process group) writes into a temp folder beside the
destination, which passes ckptkit's DCP check and appears whole or not at all
(:func:`ckptkit.io.atomicdir.atomic_folder`); everything else, the torch-free writer
(:mod:`.write`). The object comes from ckptkit's safe readers: nothing was unpickled that the
caller did not admit (torch's ``format_utils.torch_to_dcp`` would ``torch.load`` the source
with ``weights_only=False``).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import pickle
import warnings
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ...errors import (
    PARSE_ERRORS,
    PICKLE_ERRORS,
    ArgumentError,
    CheckpointFormatError,
    CheckpointWriteError,
    CkptkitError,
    UnsafeCheckpointError,
    spell,
)
from ...errors import cause as why
from ...io.atomic import describe_error
from ...io.atomicdir import atomic_folder
from ...io.fileio import local_file
from ..pickles.safety import AllowGlobals, filter_unsafe, global_name, resolve_globals, unsafe_error
from ..pickles.scan import pickle_globals
from ..source import NeedsTorch
from ..spec import Placement, WritePlan
from . import DAMAGED, unsafe_metadata_globals
from .check import check_written_dcp
from .keys import key_paths
from .megatron import extra_state_key, layer_key, no_stacks, stacks
from .meta import DCP_METADATA, BytesEntry, Chunk, DcpMetadata, Stored, TensorEntry, dims, unstored


def read_dcp(
    path: str | os.PathLike[str],
    *,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    device: str = "cpu",
) -> dict[str, Any]:
    """Load a DCP folder into a nested dict of tensors and values, its tensors on ``device``.

    Raises:
        UnsafeCheckpointError: ``.metadata`` names globals outside DCP's own classes and
            ``allow_globals``, or an entry needs globals outside torch's allowlist.
        CheckpointFormatError: metadata or shards are missing or damaged.
    """
    folder = Path(path)
    allowed = resolve_globals(allow_globals)
    try:
        unsafe = unsafe_metadata_globals(folder)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{folder}/.metadata: {e}") from e
    unsafe = [g for g in unsafe if g not in {global_name(a) for a in allowed}]
    if unsafe and not trust:
        raise unsafe_error(str(folder), unsafe, where=" its .metadata", plain_pickle=True)
    # ckptkit's own reader has already judged the folder (ops.read runs verify's checks first): a
    # planner_data index of 10**14, which makes torch's reader allocate that, never gets here
    state = _load(folder, trust, allowed)
    return _to_device(state, device) if device != "cpu" else state


def _load(folder: Path, trust: bool, allowed: list[Any]) -> dict[str, Any]:
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
        what = why(cause) if cause is not None else "unknown failure"  # torch's text runs over lines
        raise CheckpointFormatError(f"{folder}: cannot read this torch.distributed.checkpoint: {what}") from e
    except PICKLE_ERRORS as e:
        raise CheckpointFormatError(f"{folder}: cannot read this torch.distributed.checkpoint: {why(e)}") from e
    return state


def planned(folder: Path) -> tuple[DcpMetadata, set[Stored]]:
    """``folder`` as :func:`read_dcp`'s load plans it, up to the first byte of a tensor.

    ``.metadata`` as torch's ``FileSystemReader`` unpickles it; each key where ckptkit's parser
    places it (:func:`~.keys.key_paths`, first: it bounds the lists torch's planner would build);
    the load plan of the planner :func:`read_dcp` loads with, its tensors on the meta device
    (nothing allocated); and each read of the plan found in ``storage_data``. For a folder
    ckptkit's own parser does not model (``verify`` asks torch's reader instead), so that
    ``verify`` fails what ``read_checkpoint`` would fail.

    Returns:
        ckptkit's records of it, and the stored items that go through transforms (not a
        ``torch.save`` zip as they lie in the file).

    Raises:
        CheckpointFormatError: where the load would fail, with torch's reason on one line
            (naming ``.metadata``: ``verify`` reports it for the folder).
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # type: ignore[import-not-found]
    from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
    from torch.distributed.checkpoint._traverse import set_element  # type: ignore[import-not-found]
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    class _MetaPlanner(_EmptyStateDictLoadPlanner):  # type: ignore[misc]
        def set_up_planner(
            self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False
        ) -> None:
            # _EmptyStateDictLoadPlanner's set-up, then DefaultLoadPlanner's, with the tensors on the
            # meta device: the latter's _init_state_dict would allocate the whole checkpoint
            for k, v in metadata.state_dict_metadata.items():
                if isinstance(v, TensorStorageMetadata):
                    v = torch.empty(v.size, dtype=v.properties.dtype, device="meta")
                if metadata.planner_data is not None and k in metadata.planner_data:
                    set_element(state_dict, metadata.planner_data[k], v)
                else:
                    state_dict[k] = v
            self.original_state_dict = state_dict
            if self.flatten_sharded_tensors:
                state_dict = _flatten_sharded_tensors(state_dict)
            if self.flatten_state_dict:
                state_dict, self.mappings = flatten_state_dict(state_dict)
            self.state_dict, self.metadata, self.is_coordinator = state_dict, metadata, is_coordinator

    try:
        local_file(folder / DCP_METADATA)  # torch's reader opens it itself: an object read elsewhere is fetched
        meta = FileSystemReader(str(folder)).read_metadata()
    except Exception as e:  # .metadata passed the allowlist: whatever unpickling it raised is damage
        raise CheckpointFormatError(f".metadata: torch's reader cannot read it ({why(e)})") from e
    transformed: set[Stored] = set()

    def stored(index: Any) -> Stored:
        info = meta.storage_data.get(index)  # read_data's lookup: each read's index, by fqn and offsets
        if info is None:
            raise unstored(index.fqn, None if index.offset is None else tuple(index.offset))
        if not isinstance(info, _StorageInfo):  # FileSystemReader reads its four fields, transforms included
            raise CheckpointFormatError(
                f".metadata says where {index.fqn} is stored with a {type(info).__name__}, not a _StorageInfo: {DAMAGED}"
            )
        name = os.fspath(info.relative_path) if isinstance(info.relative_path, os.PathLike) else info.relative_path
        if not isinstance(name, str):
            raise CheckpointFormatError(f".metadata stores {index.fqn} in a {type(name).__name__}: {DAMAGED}")
        where = Stored(name, info.offset, info.length)
        if getattr(info, "transform_descriptors", None):
            transformed.add(where)
        return where

    try:
        kinds = {k: isinstance(md, TensorStorageMetadata) for k, md in meta.state_dict_metadata.items()}
        paths = key_paths(kinds, meta.planner_data)
        planner = _MetaPlanner()
        planner.set_up_planner({}, meta, True)
        if meta.storage_data is None:
            raise CheckpointFormatError(f".metadata has no storage_data: {DAMAGED}")
        for item in planner.create_local_plan().items:
            stored(item.storage_index)
        entries: dict[str, TensorEntry | BytesEntry] = {}
        for k, md in meta.state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata):
                entries[k] = BytesEntry(k, stored(MetadataIndex(k)))
                continue
            chunks = []
            for c in md.chunks:  # each, even one the plan does not read: refused rather than guessed
                offsets = dims(c.offsets, f"{k}'s chunk offset")
                chunks.append(Chunk(offsets, dims(c.sizes, f"{k}'s chunk size"), stored(MetadataIndex(k, offsets))))
            entries[k] = TensorEntry(k, str(md.properties.dtype).removeprefix("torch."), tuple(md.size), tuple(chunks))
    except CheckpointFormatError:
        raise
    except (NeedsTorch, *PARSE_ERRORS) as e:  # type: ignore[misc]  # Missing key, a negative dimension, no dtype
        raise CheckpointFormatError(
            f".metadata is malformed: torch's reader cannot plan its load ({why(e)}): {DAMAGED}"
        ) from e
    return DcpMetadata(entries, paths), transformed


def _to_device(node: Any, device: str) -> Any:
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


def write_dcp(obj: Any, path: str | os.PathLike[str]) -> int:
    """Save ``obj`` (a mapping: tensors, nested containers, plain values) as a DCP folder at ``path``.

    Returns the bytes written. ``torch.distributed.checkpoint.load`` reads it into a plain model
    or a sharded one (FSDP2, any world size).

    Raises:
        ArgumentError: ``obj`` is not something DCP can save (not a mapping, or keys it cannot
            flatten); CheckpointWriteError: the folder could not be written.

    Example:
        >>> write_dcp({"fc.weight": torch.ones(2, 2)}, "out.dcp")  # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    dest = Path(path)
    if not isinstance(obj, Mapping):
        raise ArgumentError(f"{dest}: a DCP folder holds a state dict (a mapping), not a {type(obj).__name__}")
    with atomic_folder(
        dest, check=lambda tmp: check_written_dcp(tmp, dest=dest)
    ) as tmp:  # replaces a folder there: the caller checked it may
        writer = dcp.FileSystemWriter(str(tmp), sync_files=True)
        recording = _RecordingFileSystem(writer.fs)
        writer.fs = recording  # type: ignore[assignment]  # duck-typed: the writer only calls its methods
        try:
            with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": meant
                warnings.simplefilter("ignore")
                _save_alone(dict(obj), writer)
        except CkptkitError:
            raise
        except OSError as e:
            raise CheckpointWriteError(describe_error(e, dest)) from e
        except (CheckpointException, ValueError, TypeError, AttributeError, RuntimeError, KeyError) as e:
            cause = (first_failure(e) or e) if isinstance(e, CheckpointException) else e  # DCP wraps each rank's
            # torch.save inside DCP's writer turns a failed write into "[enforce fail at
            # inline_container.cc] unexpected pos ..."; the OSError it swallowed (a full disk, a file
            # too large) is the cause, and blaming the checkpoint's contents would send the user to
            # --model-only, which fails the same way.
            failed = recording.error or (cause if isinstance(cause, OSError) else None)
            if failed is not None:
                raise CheckpointWriteError(describe_error(failed, dest)) from e
            raise ArgumentError(
                f"{dest}: torch.distributed.checkpoint cannot save this checkpoint ({why(cause)}); "
                f"{spell('model_only=True', '--model-only')} writes the weights alone"
            ) from e
        return sum(p.stat().st_size for p in tmp.iterdir())


class _RecordingStream(io.BufferedWriter):
    """A file DCP's writer writes into, remembering the first OSError a write or flush raised."""

    def __init__(self, raw: io.FileIO, fs: _RecordingFileSystem) -> None:
        super().__init__(raw)
        self._fs = fs

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as e:
            self._fs.error = self._fs.error or e
            raise

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as e:
            self._fs.error = self._fs.error or e
            raise


class _RecordingFileSystem:
    """DCP's local file system (``writer.fs``), whose written files keep the OSError that torch.save
    swallows; everything but ``create_stream`` is the wrapped one's."""

    def __init__(self, fs: Any) -> None:
        self._fs = fs
        self.error: OSError | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._fs, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if "w" not in mode:
            with self._fs.create_stream(path, mode) as stream:
                yield stream
            return
        with _RecordingStream(io.FileIO(path, mode), self) as stream:
            yield stream


def _save_alone(state: dict[str, Any], writer: Any) -> None:
    """``dcp.save`` in this process alone, even inside a process group (``no_dist=True``).

    torch 2.6's ``dcp.save`` has no ``no_dist`` (it infers it from whether a group exists);
    its ``_save_state_dict``, which ``dcp.save`` calls, takes it (as :func:`read_dcp` uses ``_load_state_dict``).
    """
    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.save).parameters:
        dcp.save(state, storage_writer=writer, no_dist=True)
    else:
        from torch.distributed.checkpoint.state_dict_saver import _save_state_dict

        _save_state_dict(state, storage_writer=writer, no_dist=True)


def read(
    path: str,
    *,
    fmt: str,
    placement: Placement,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    mmap: bool = True,
    zero_weights: str = "fp32",
) -> dict[str, Any]:
    """A DCP folder as one nested state dict, tensors on the placement's device."""
    device = placement.device(path, "a torch.distributed.checkpoint folder")
    return read_dcp(path, trust=trust, allow_globals=allow_globals, device=device)


def write(target: BinaryIO | Path, obj: Any, state: Any, *, dest: Path, plan: WritePlan) -> int:
    """``obj`` as a DCP folder at ``target``, through DCP's own writer."""
    assert isinstance(target, Path)  # a folder: its writer owns the temp folder and the swap
    return write_dcp(obj, target)


def unstack_tensors(obj: Any, source: str) -> Any:
    """A folder torch's reader loaded, each stacked layer a tensor of its own and each layer's
    ``_extra_state`` under its layer, at whatever level of the state dict they are, as
    :func:`~.megatron.unstack` lays the metadata out for the stream (where a layer is part of a
    chunk, or a value holds tensors, the folder is read here).

    Raises:
        CheckpointFormatError: nothing is stacked.
    """
    split = 0

    def walk(node: Any) -> Any:
        nonlocal split
        if not isinstance(node, dict):
            return node
        found = stacks(
            {k: tuple(v.shape) for k, v in node.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        )
        stacked = set(found.keys)
        out: dict[Any, Any] = {}
        for key, value in node.items():
            if key in stacked:  # each layer a copy: a view would keep (and a writer store) the whole stack
                out |= {layer_key(key, i): value[i].clone() for i in range(value.shape[0])}
                split += 1
            elif isinstance(key, str) and (extra := extra_state_key(key, found)) is not None:
                out[extra] = value
            else:
                out[key] = walk(value)
        return out

    result = walk(obj)
    if not split:
        raise no_stacks(source)
    return result
