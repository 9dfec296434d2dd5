"""What ``ckptkit verify`` reports of a ``torch.distributed.checkpoint`` folder.

Example:
    >>> [c.name for c in dcp_checks(Path("ckpt_dcp"), False, None)]  # doctest: +SKIP
    ['safe to load', 'metadata', 'non-tensor entries safe to load', 'shards present and long enough']
"""

from __future__ import annotations

import io
import zipfile
from pathlib import Path
from typing import Any

from ...errors import PARSE_ERRORS, CheckpointFormatError, CkptkitError, summarize
from ...io.fileio import Progress
from ..integrity import Check
from ..pickles.reader import UnsupportedGlobal
from ..pickles.safety import filter_unsafe, needs_text
from ..pickles.scan import pickle_globals
from ..source import NeedsTorch
from . import unsafe_metadata_globals
from .stream import chunk_crc_check, open_dcp


def dcp_checks(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    """A DCP folder's checks: its ``.metadata`` globals, then (torch's reader) its entries and shards,
    and with ``full`` every chunk's CRC-32 where ckptkit's own reader can read them."""
    unsafe = unsafe_metadata_globals(p)
    detail = f".metadata {needs_text(unsafe, beyond='DCP')}" if unsafe else "DCP metadata classes only"
    checks = [Check("safe to load", "safety", not unsafe, detail, tuple(unsafe))]
    if unsafe:
        return checks
    try:  # ckptkit's own reader first: what it refuses (a planner_data index of 10**14), torch's must not see
        src = open_dcp(p)
    except CheckpointFormatError as e:
        return [*checks, Check("metadata", "integrity", False, str(e))]
    except (NeedsTorch, UnsupportedGlobal):
        pass  # laid out beyond the torch-free reader: torch's reader checks it below
    else:
        try:
            checks += [chunk_crc_check(src, progress)] if full else []
        finally:
            src.close()
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(p)).read_metadata()
    except Exception as e:  # .metadata passed the allowlist; anything else is damage
        return [*checks, Check("metadata", "integrity", False, f"{type(e).__name__}: {e}")]
    try:
        checks.append(Check("metadata", "integrity", True, f"{len(meta.state_dict_metadata)} entries"))
        return checks + _entries(p, meta) + [_shards(p, meta)]
    except PARSE_ERRORS as e:  # DCP's own classes holding the wrong things: a damaged .metadata
        return [*checks, Check("metadata", "integrity", False, f".metadata is malformed ({type(e).__name__}: {e})")]


def _shards(p: Path, meta: Any) -> Check:
    problems, sizes = [], {}
    for index, info in (meta.storage_data or {}).items():
        shard = p / info.relative_path
        if shard not in sizes:
            sizes[shard] = shard.stat().st_size if shard.is_file() else -1
        if sizes[shard] < 0:
            problems.append(f"{info.relative_path} missing ({index.fqn})")
        elif info.offset + info.length > sizes[shard]:
            problems.append(f"{index.fqn}: bytes {info.offset}+{info.length} past the end of {info.relative_path}")
    detail = summarize(sorted(set(problems)), 3) if problems else f"{len(sizes)} shard file(s)"
    return Check("shards present and long enough", "integrity", not problems, detail)


def _entries(p: Path, meta: Any) -> list[Check]:
    """Non-tensor DCP entries are torch.save'd pickles inside the shards: list their globals."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    unsafe: dict[str, list[str]] = {}
    unreadable: list[str] = []
    for index, info in (meta.storage_data or {}).items():
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        shard = p / info.relative_path
        if not shard.is_file():
            continue  # reported by the shard check
        with open(shard, "rb") as f:
            f.seek(info.offset)
            blob = f.read(min(info.length, max(0, shard.stat().st_size - info.offset)))
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as zf:
                names = [g for n in zf.namelist() if n.endswith("data.pkl") for g in pickle_globals(zf.read(n))]
        except (CkptkitError, *PARSE_ERRORS):  # type: ignore[misc]
            unreadable.append(index.fqn)
            continue
        bad = filter_unsafe(names)
        if bad:
            unsafe[index.fqn] = bad
    needs = tuple(dict.fromkeys(g for gs in unsafe.values() for g in gs))
    detail = f"{summarize(list(unsafe), 3)}: {needs_text(needs)}" if unsafe else "weights-only globals"
    checks = [Check("non-tensor entries safe to load", "safety", not unsafe, detail, needs)]
    if unreadable:
        checks.append(
            Check("non-tensor entries readable", "integrity", False, f"damaged pickles: {summarize(unreadable)}")
        )
    return checks
