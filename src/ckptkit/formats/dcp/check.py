"""What ``ckptkit verify`` reports of a ``torch.distributed.checkpoint`` folder.

Example:
    >>> [c.name for c in dcp_checks(Path("ckpt_dcp"), False, None)]  # doctest: +SKIP
    ['safe to load', 'metadata', 'non-tensor entries safe to load', 'shards present and long enough']
"""

from __future__ import annotations

from pathlib import Path

from ...errors import PARSE_ERRORS, CheckpointFormatError, CkptkitError, summarize
from ...io.fileio import Progress, open_regular
from ..integrity import Check, refuse_failed
from ..pickles.reader import UnsupportedGlobal
from ..pickles.safety import filter_unsafe, needs_text
from ..pickles.scan import pickle_globals
from ..source import NeedsTorch
from ..spec import View
from ..torchzip.container import SliceReader, TorchZip
from . import unsafe_metadata_globals
from .meta import BytesEntry, Stored, TensorEntry, chunks_in_order
from .stream import DcpSource, chunk_crc_check, open_dcp


def dcp_checks(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    """A DCP folder's checks: its ``.metadata`` globals, its entries and shards (read by ckptkit's
    own reader, the one convert copies through; torch's reader where a folder is laid out beyond
    it), and with ``full`` every chunk's CRC-32 where ckptkit's own reader can read them."""
    try:  # ckptkit's own reader first: what it refuses (a planner_data index of 10**14), torch's must not see
        src = open_dcp(p)
    except (CheckpointFormatError, NeedsTorch) as e:  # UnsupportedGlobal is a CheckpointFormatError
        failure = e
    else:
        try:
            return opened_checks(src, full=full, progress=progress)
        finally:
            src.close()
    # Read whole, .metadata named DCP's classes only (its unpickler takes no other): else list every global
    unsafe = unsafe_metadata_globals(p)
    if unsafe:
        return [_safe(unsafe)]
    if isinstance(failure, (NeedsTorch, UnsupportedGlobal)):
        return [_safe([]), *_torch_checks(p)]  # laid out beyond the torch-free reader: torch's reader checks it
    return [_safe([]), Check("metadata", "integrity", False, str(failure))]


def _safe(unsafe: list[str]) -> Check:
    detail = f".metadata {needs_text(unsafe, beyond='DCP')}" if unsafe else "DCP metadata classes only"
    return Check("safe to load", "safety", not unsafe, detail, tuple(unsafe))


def opened_checks(src: View, *, full: bool = False, progress: Progress | None = None) -> list[Check]:
    """:func:`dcp_checks` of a folder already opened whole (``open_dcp`` without ``lazy``: its
    metadata and every chunk's header read, as the check reads them), so a convert opens it once.

    Example:
        >>> [c.name for c in opened_checks(open_dcp("ckpt_dcp"))]  # doctest: +SKIP
        ['safe to load', 'metadata', 'non-tensor entries safe to load', 'shards present and long enough']
    """
    assert isinstance(src, DcpSource) and src.meta is not None and not src.lazy  # as open_dcp(p) returns it
    p, meta = src.folder, src.meta
    stored = [(e.fqn, c.stored) for e in meta.entries.values() if isinstance(e, TensorEntry) for c in e.chunks]
    blobs = [(e.fqn, e.stored) for e in meta.entries.values() if isinstance(e, BytesEntry)]
    checks = [_safe([]), Check("metadata", "integrity", True, f"{len(meta.entries)} entries")]
    checks += [*_entries(p, blobs), _shards(p, stored + blobs)]
    return checks + ([chunk_crc_check(src, progress)] if full else [])


def check_written_dcp(path: Path, *, dest: Path) -> None:
    """A DCP writer's check of the folder it wrote at ``path``, before it replaces ``dest``
    (:func:`~..integrity.check_written`'s, for a folder only this package reads).

    Raises:
        CheckpointWriteError: naming ``dest`` and what failed; nothing is published.
    """
    refuse_failed(dcp_checks(path, False, None), path, dest=dest)


def _torch_checks(p: Path) -> list[Check]:
    """The metadata, entries and shards as torch's own reader reads them: what the load that
    read_checkpoint runs plans (:func:`~.torch.planned`), each tensor's chunks tiling it, and each
    read's bytes in the folder, a torch.save zip where no transform stands between."""
    from .torch import planned  # deferred: torch, for a folder laid out beyond ckptkit's own reader

    try:
        meta, transformed = planned(p)
        for e in meta.entries.values():
            if isinstance(e, TensorEntry):
                chunks_in_order(p, e)  # as ckptkit's own reader requires: torch's reads a gap as garbage
    except CheckpointFormatError as e:
        return [Check("metadata", "integrity", False, str(e))]
    stored = [(e.fqn, c.stored) for e in meta.entries.values() if isinstance(e, TensorEntry) for c in e.chunks]
    blobs = [(e.fqn, e.stored) for e in meta.entries.values() if isinstance(e, BytesEntry)]
    found = Check("metadata", "integrity", True, f"{len(meta.entries)} entries")
    plain = [(fqn, at) for fqn, at in blobs if at not in transformed]  # torch's reader undoes the others
    return [found, *_entries(p, plain), _shards(p, stored + blobs, transformed=transformed)]


def _shards(p: Path, stored: list[tuple[str, Stored]], *, transformed: set[Stored] | None = None) -> Check:
    """Each item's bytes inside the folder's files. Given ``transformed`` (the items stored through
    transforms), every other item must also be a torch.save zip, as torch's reader loads it
    (without it, ckptkit's own reader has read those zips' headers already)."""
    problems, sizes = [], {}
    for fqn, at in stored:
        shard = p / at.file
        if Path(at.file).is_absolute() or ".." in Path(at.file).parts:
            problems.append(f"{fqn}: stored in {at.file!r}, outside the folder")
            continue
        if shard not in sizes:
            sizes[shard] = shard.stat().st_size if shard.is_file() else -1
        if sizes[shard] < 0:
            problems.append(f"{at.file} missing ({fqn})")
        elif not isinstance(at.offset, int) or not isinstance(at.length, int) or at.offset < 0 or at.length <= 0:
            problems.append(f"{fqn}: stored at offset {at.offset!r}, length {at.length!r} of {at.file}")
        elif at.offset + at.length > sizes[shard]:
            problems.append(f"{fqn}: bytes {at.offset}+{at.length} past the end of {at.file}")
        elif transformed is not None and at not in transformed and (why := _not_a_zip(shard, at)):
            problems.append(f"{fqn}: {why}")
    detail = summarize(sorted(set(problems)), 3) if problems else f"{len(sizes)} shard file(s)"
    return Check("shards present and long enough", "integrity", not problems, detail)


def _not_a_zip(shard: Path, at: Stored) -> str | None:
    """Why torch.load cannot open ``at``'s bytes as the zip torch.save writes (its headers, end
    records and directory, read through windows as ckptkit's own reader reads them), or None."""
    with open_regular(shard) as f:
        view = SliceReader(f, at.offset, at.length, window=4096)
        if view.read(4) != b"PK\x03\x04":
            return f"no torch.save zip at offset {at.offset} of {at.file}"
        try:
            TorchZip(f"{shard}@{at.offset}", file=view)  # type: ignore[arg-type]
        except CheckpointFormatError as e:
            return str(e)
    return None


def _entries(p: Path, blobs: list[tuple[str, Stored]]) -> list[Check]:
    """Non-tensor DCP entries are torch.save'd pickles inside the shards: list their globals."""
    unsafe: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for fqn, at in blobs:
        shard = p / at.file
        if not shard.is_file() or at.offset < 0 or at.length <= 0:
            continue  # reported by the shard check
        length = min(at.length, max(0, shard.stat().st_size - at.offset))
        try:  # its pickle alone, through windows: a tensor inside a value (a tuple of them) is not read
            with open_regular(shard) as f:
                z = TorchZip(f"{shard}@{at.offset}", file=SliceReader(f, at.offset, length, window=4096))  # type: ignore[arg-type]
                names = pickle_globals(z.read(f"{z.prefix}data.pkl"))
        except (CkptkitError, *PARSE_ERRORS):  # type: ignore[misc]
            unreadable.append(fqn)
            continue
        bad = filter_unsafe(names)
        if bad:
            unsafe[fqn] = bad
    needs = tuple(dict.fromkeys(g for gs in unsafe.values() for g in gs))
    detail = f"{summarize(list(unsafe), 3)}: {needs_text(needs)}" if unsafe else "weights-only globals"
    checks = [Check("non-tensor entries safe to load", "safety", not unsafe, detail, needs)]
    if unreadable:
        checks.append(
            Check("non-tensor entries readable", "integrity", False, f"damaged pickles: {summarize(unreadable)}")
        )
    return checks
