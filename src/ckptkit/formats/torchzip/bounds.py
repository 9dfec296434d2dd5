"""Refuse a torch checkpoint whose pickle declares storages or tensors larger than their bytes.

torch allocates each storage at the size its pickle declares before reading the bytes, so
one flipped bit in a size can ask for terabytes. Walking the pickle through ckptkit's inert
stand-ins first (nothing is imported or run) checks every declared size against its zip
record, or for the legacy format against the file, as soon as the reference is read: a huge
storage placed before a forbidden global is caught too.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import CheckpointFormatError, summarize
from ...io.fileio import ClampedReader, file_size
from ..pickles import reader as lp
from .container import TorchZip
from .detect import LEGACY, ZIP


def check_storage_bounds(path: str | os.PathLike[str], fmt: str, *, file: BinaryIO) -> None:
    """Raise CheckpointFormatError if a declared storage cannot fit its bytes.

    Stops quietly at a global the stand-ins do not model: torch's weights-only loader refuses
    it before reading further, and with ``trust`` the caller accepted arbitrary pickles.
    ``file``: the open file to read; ``path`` names it in messages.
    """
    p = Path(path)
    if fmt == ZIP:
        z = TorchZip(p, file=file)

        fit = StorageFit(z)

        def check_zip(ref: lp.StorageRef) -> None:
            why = fit.problem(ref)
            if why is not None:
                raise CheckpointFormatError(f"{p}: {why}")

        source: bytes | object = z.read(f"{z.prefix}data.pkl")
        _walk(source, check_zip)
    elif fmt == LEGACY:
        size = file_size(file)
        first: dict[str, lp.StorageRef] = {}

        def check_legacy(ref: lp.StorageRef) -> None:
            if len(ref.pid) != 6:  # the legacy loader unpacks (storage, type, key, location, numel, view)
                raise CheckpointFormatError(
                    f"{p}: storage {ref.key} has a persistent id of {len(ref.pid)} items; torch reads a legacy file's as 6"
                )
            if lp.storage_nbytes(ref) > size:
                raise CheckpointFormatError(
                    f"{p}: storage {ref.key} declares {lp.storage_nbytes(ref)} bytes, more than the whole file ({size})"
                )
            first.setdefault(ref.key, ref)

        file.seek(0)
        reader = ClampedReader(file)
        for _ in range(3):  # magic number, protocol version, system info: plain values
            _walk(reader, None)
        if _walk(reader, check_legacy):
            _legacy_storages(p, reader, first, size)


def storage_problem(ref: lp.StorageRef, z: TorchZip) -> str | None:
    """Why a storage the pickle declares does not fit the zip (a missing record, one of another
    size than declared), or None."""
    if len(ref.pid) != 5:  # torch's zip loader unpacks exactly (storage, type, key, location, numel)
        return f"storage {ref.key} has a persistent id of {len(ref.pid)} items; torch reads a zip's as 5"
    rec = z.by_name.get(f"{z.prefix}data/{ref.key}")
    if rec is None:
        return f"the pickle refers to storage {ref.key}, which the zip lacks"
    need = lp.storage_nbytes(ref)
    if need == rec.size:
        return None
    # torch.load refuses a record of any other size (a longer one too: "record size does not match")
    return f"storage {ref.key} declares {need} bytes but its record holds {rec.size}"


class StorageFit:
    """An ``on_storage`` callback holding each storage the pickle declares against its zip record,
    as the pickle is read; what does not fit is collected in ``problems``.

    torch reads a record once, as its first reference declares it, and gives every later
    reference that storage: a later one declaring another type or size would get other values
    than it says (or none), so it is refused here.

    Example:
        >>> fit = StorageFit(z)  # doctest: +SKIP
        >>> lp.loads(z.read(f"{z.prefix}data.pkl"), on_storage=fit); fit.problems  # doctest: +SKIP
        []
    """

    def __init__(self, z: TorchZip) -> None:
        self.z = z
        self.problems: list[str] = []
        self._first: dict[str, lp.StorageRef] = {}

    def __call__(self, ref: lp.StorageRef) -> None:
        why = self.problem(ref)
        if why is not None:
            self.problems.append(why)

    def problem(self, ref: lp.StorageRef) -> str | None:
        """Why ``ref`` does not fit (see :func:`storage_problem`), or None."""
        first = self._first.setdefault(ref.key, ref)
        if first is not ref and (first.type_name, first.pid[4]) != (ref.type_name, ref.pid[4]):
            return (
                f"storage {ref.key} is declared as {first.pid[4]!r:.20} of {first.type_name} and as "
                f"{ref.pid[4]!r:.20} of {ref.type_name}; torch would read both as the first"
            )
        return storage_problem(ref, self.z)


def _walk(source: object, check: object) -> bool:
    """Read one pickle through the stand-ins; False where it names a global they do not model."""
    try:
        lp.loads(source, on_storage=check)  # type: ignore[arg-type]
    except lp.UnsupportedGlobal:
        return False
    return True


_NOT_AS_SAVED = (
    "; torch cannot load it as saved, and as the legacy format holds no checksums, ckptkit cannot tell "
    "whether it is truncated, damaged or written by something else"
)


def _legacy_storages(p: Path, reader: ClampedReader, used: dict[str, lp.StorageRef], size: int) -> None:
    """What torch's legacy loader requires after the pickle: the list of stored keys, then each
    storage as an 8-byte element count and its bytes, in that order. A key the pickle uses but the
    file does not store gets uninitialised memory from torch, and one it stores but the pickle never
    uses fails its load: both are refused, as is a count other than the pickle declares."""
    keys = lp.loads(reader)  # type: ignore[arg-type]  # a file, clamped
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise CheckpointFormatError(f"{p}: the list of stored storages is a {type(keys).__name__}, not a list of keys")
    missing = sorted(set(used) - set(keys))
    extra = sorted(set(keys) - set(used))
    if missing or extra or len(set(keys)) != len(keys):
        what = (
            f"storage(s) {summarize(missing, 3)} used but not stored"
            if missing
            else f"storage(s) {summarize(extra, 3)} stored but never used"
            if extra
            else "a storage stored twice"
        )
        raise CheckpointFormatError(f"{p}: {what}{_NOT_AS_SAVED}")
    for key in keys:
        head = reader.read(8)
        count = int.from_bytes(head, "little", signed=True) if len(head) == 8 else -1
        ref = used[key]
        if count != ref.numel:
            raise CheckpointFormatError(
                f"{p}: storage {key} is stored with {count} elements, the pickle declares {ref.numel}{_NOT_AS_SAVED}"
            )
        end = reader.tell() + lp.storage_nbytes(ref)
        if end > size:
            raise CheckpointFormatError(f"{p}: storage {key} runs past the end of the file{_NOT_AS_SAVED}")
        reader.seek(end)


def tensors_in(obj: Any) -> list[tuple[Callable[[], str], lp.TensorRef]]:
    """``(where, tensor)`` for every tensor stand-in in nested dicts, lists and tuples; ``where()``
    spells its path (``"model/fc.weight"``, ``"[0]"``).

    Each container is walked once, however many paths reach it (a pickle may share one list
    between two tuples, 60 times over), and a path is spelled only when asked for: the work is
    linear in the pickle's size, not in its paths or its depth.
    """
    labels: list[tuple[int, str, str]] = [(-1, "", "")]  # a container's (parent, separator, key)

    def where(parent: int, sep: str, key: str) -> str:
        parts = [(sep, key)] if key else []
        while parent > 0:
            parent, up_sep, up_key = labels[parent]
            parts.append((up_sep, up_key))
        path = ""
        for s, k in reversed(parts):
            path = f"{path}{s}{k}" if path or s == "" else k
        return path or "<root>"

    found: list[tuple[Callable[[], str], lp.TensorRef]] = []
    seen: set[int] = set()
    stack: list[tuple[int, str, str, Any]] = [(0, "", "", obj)]
    while stack:
        parent, sep, key, node = stack.pop()
        t = lp.tensor_of(node)
        if t is not None:
            found.append((functools.partial(where, parent, sep, key), t))
        elif isinstance(node, (dict, list, tuple)) and id(node) not in seen:
            seen.add(id(node))
            labels.append((parent, sep, key))
            me = len(labels) - 1
            if isinstance(node, dict):
                stack += [(me, "/", str(k), v) for k, v in node.items()]
            else:
                stack += [(me, "", f"[{i}]", v) for i, v in enumerate(node)]
    return found


def tensor_problem(t: lp.TensorRef, storage_bytes: int) -> str | None:
    """Why torch could not build this tensor view over ``storage_bytes`` bytes, or None.

    torch checks these only when it loads the file; a rewrite that copies storages untouched
    would otherwise pass a broken view through.
    """
    shape, stride, offset = t.shape, t.stride, t.offset
    if len(shape) != len(stride):
        return f"{len(shape)} dimensions but {len(stride)} strides"
    if offset < 0 or any(d < 0 for d in shape) or any(s < 0 for s in stride):
        return f"negative offset, size or stride (offset {offset}, size {list(shape)}, stride {list(stride)})"
    if t.numel == 0 or not t.itemsize:
        return None
    need = (offset + sum((d - 1) * s for d, s in zip(shape, stride, strict=True)) + 1) * t.itemsize
    return f"needs {need} bytes, storage has {storage_bytes}" if need > storage_bytes else None


def tensor_problems(obj: Any, z: TorchZip) -> list[str]:
    """``"where: why"`` for every tensor view in ``obj`` that does not fit its storage record."""
    problems = []
    for where, t in tensors_in(obj):
        try:
            why = tensor_problem(t, z.storage(t.storage.key).size)
        except CheckpointFormatError:
            why = f"storage {t.storage.key} missing"
        if why is not None:
            problems.append(f"{where()}: {why}")
    return problems


def check_tensors(obj: Any, z: TorchZip, source: str) -> None:
    """Raise CheckpointFormatError naming every tensor view that does not fit its storage record."""
    problems = tensor_problems(obj, z)
    if problems:
        raise CheckpointFormatError(f"{source}: damaged tensor records: {summarize(problems, 3)}")
