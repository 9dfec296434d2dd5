"""Is this checkpoint intact, and can it be loaded without trusting it? One function answers
for every format, and the report it returns owns the decision to load.

Nothing runs pickled code: pickles are read through stand-ins or scanned opcode by opcode;
torch loads only files whose globals all passed torch's weights-only allowlist.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import (
    CheckpointFormatError,
    CkptkitError,
    UnsafeCheckpointError,
    UnsupportedCheckpointError,
)
from ..formats.deepspeed import zero_checks
from ..formats.detect import DCP, DEEPSPEED, HF, LEGACY, SAFETENSORS, ZIP, check_exists, detect_format
from ..formats.hf.index import read_index, shard_note
from ..formats.integrity import Check, safetensors_checks, zip_checks
from ..formats.pickles.reader import UnsupportedGlobal
from ..formats.source import NeedsTorch, checkpoint_bytes, open_source
from ..formats.torchzip.container import TorchZip
from ..io.fileio import Progress
from ..io.remote import is_url, renamed, staged_read, unstaged
from .safety import AllowGlobals, global_name, needed_globals, needs_text, resolve_globals, unsafe_error
from .verify_dcp import dcp_checks


@dataclass
class VerifyReport:
    """Each check with its kind (integrity or safety) and outcome.

    Attributes:
        path: what was checked.
        format: ``torch-zip``, ``torch-legacy``, ``safetensors``, ``dcp`` or ``unknown``.
        checks: every :class:`~ckptkit.formats.integrity.Check`, in the order run.
        error: the error that stopped checking early (no such file, not a checkpoint).
        notes: what the caller should know (the file is one shard of a sharded checkpoint).
    """

    path: str
    format: str = "unknown"
    checks: list[Check] = field(default_factory=list)
    error: CkptkitError | None = field(default=None, repr=False)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Every check passed."""
        return self.error is None and all(c.ok for c in self.checks)

    @property
    def intact(self) -> bool:
        """Every integrity check passed (safety aside): the bytes are what the file says."""
        return self.error is None and all(c.ok for c in self.checks if c.kind == "integrity")

    def gate(self, *, trust: bool = False, allow_globals: AllowGlobals = ()) -> None:
        """Raise unless a load with these options should go ahead.

        Damage always stops it; what the file needs beyond torch's allowlist stops it unless
        ``trust`` or ``allow_globals`` admits it.

        Raises:
            CheckpointFormatError: an integrity check failed.
            UnsafeCheckpointError: a safety check failed and the options do not admit it.
        """
        if self.error is not None:
            raise self.error
        damage = [f"{c.name}: {c.detail}" for c in self.checks if c.kind == "integrity" and not c.ok]
        if damage:
            raise CheckpointFormatError(f"{self.path}: failed verification: {'; '.join(damage)}")
        if trust:
            return
        allowed = {global_name(g) for g in resolve_globals(allow_globals)}
        needs = [g for c in self.checks if c.kind == "safety" and not c.ok for g in c.needs if g not in allowed]
        if needs:
            raise unsafe_error(self.path, list(dict.fromkeys(needs)))

    def to_dict(self) -> dict[str, Any]:
        checks = [c.to_dict() for c in self.checks]
        return {
            "path": self.path,
            "format": self.format,
            "ok": self.ok,
            "intact": self.intact,
            "checks": checks,
            "notes": self.notes,
        }


def verify_checkpoint(
    path: str | os.PathLike[str], *, full: bool = True, progress: Callable[[int, int], None] | None = None
) -> VerifyReport:
    """Check integrity (zip CRCs, header bounds, storage extents, DCP shards) and safety.

    Args:
        path: a checkpoint file, DCP folder, Hugging Face shards (folder or index: every shard is
            checked, and the index against what the shards hold), or a DeepSpeed ZeRO folder (its
            rank files' pickles, the rebuild's layout, and every record of the files it reads).
        full: read every payload byte (CRC-32s) and try a weights-only load where the
            torch-free checks cannot judge the pickle. ``False`` checks structure only (headers,
            pickles, bounds, shard sizes): what picking a checkpoint to resume from needs.
        progress: called as ``progress(bytes_read_now, bytes_total)`` while checksums are read.

    A URL (``s3://bucket/key.pt``) is read once into a local staging file and checked there; a
    ckptkit-written object's bytes are also held against the CRC-32 recorded at upload.

    Example:
        >>> verify_checkpoint("fixtures/ddp.pt").ok  # doctest: +SKIP
        True
    """
    if is_url(path):
        return _verify_url(path, full=full, progress=progress)
    report = VerifyReport(os.fspath(path))
    try:
        p = check_exists(path)
        report.format = detect_format(p)
    except CkptkitError as e:
        report.error = e
        report.checks.append(Check("format", "integrity", False, str(e)))
        return report
    report.checks.append(Check("format", "integrity", True, report.format))
    check = {ZIP: _zip, SAFETENSORS: _safetensors, LEGACY: _legacy, DCP: dcp_checks, HF: _hf, DEEPSPEED: _deepspeed}[
        report.format
    ]
    total = checkpoint_bytes(p, report.format)
    report.notes = [note] if p.is_file() and (note := shard_note(p)) else []
    read: Progress | None = (lambda n: progress(n, total)) if progress is not None else None
    try:
        report.checks += check(p, full, read)
    except CkptkitError as e:
        report.checks.append(Check("structure", "integrity", False, str(e)))
        if isinstance(e, UnsupportedCheckpointError):
            report.error = e  # intact, maybe: the gate raises this, not "failed verification"
    return report


def _verify_url(url: str, *, full: bool, progress: Callable[[int, int], None] | None) -> VerifyReport:
    """The local checks on a staged copy, reported under the URL."""
    try:
        with staged_read(url) as local:
            report = verify_checkpoint(local, full=full, progress=progress)
    except CkptkitError as e:  # no such object, or its bytes differ from what ckptkit uploaded
        return VerifyReport(url, checks=[Check("format", "integrity", False, str(e))], error=e)
    report.path = url
    report.checks = [dataclasses.replace(c, detail=unstaged(c.detail, local, url)) for c in report.checks]
    report.notes = [unstaged(n, local, url) for n in report.notes]
    report.error = renamed(report.error, local, url) if report.error is not None else None
    return report


def _globals_safe(p: Path) -> Check:
    needs = needed_globals(p)  # the static scan, confirmed by torch's weights-only unpickler
    unsafe = list(needs.names)
    detail = f"pickle {needs_text(unsafe)}" if unsafe else "only weights-only globals"
    if not needs.loads:  # allowing globals is not enough: only trust is advised
        detail = f"{unsafe_error(p.name, unsafe, loads=False, why=needs.why)}".removeprefix(
            f"{p.name}: refused to load: "
        )
    return Check("safe to load", "safety", needs.loads and not unsafe, detail, tuple(unsafe))


def _torch_loads(p: Path, fmt: Any) -> Check:
    from .torchload import torch_load  # deferred: verify runs without torch where the checks above suffice

    name = "loads with torch (weights-only)"
    try:
        torch_load(str(p), fmt, map_location="cpu", trust=False, allow_globals=(), mmap=True)
    except UnsafeCheckpointError as e:
        return Check(name, "safety", False, str(e), e.globals)
    except CkptkitError as e:  # damage, or an intact file torch still refuses: either way not loadable
        return Check(name, "integrity", False, str(e))
    return Check(name, "integrity", True)


def _zip(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    with TorchZip(p) as z:  # every read through one open file: the version opened, even if replaced
        checks, needs_torch = zip_checks(z, full=full, progress=progress)
    if needs_torch:
        checks.append(safe := _globals_safe(p))
        if safe.ok and full:
            checks.append(_torch_loads(p, ZIP))
    return checks


def _safetensors(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    with open(p, "rb") as f:
        return safetensors_checks(f, str(p), full=full, progress=progress)


def _legacy(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    checks = [_globals_safe(p)]
    if checks[0].ok and full:
        checks.append(_torch_loads(p, LEGACY))
    if full:
        checks.append(
            Check("checksums", "integrity", True, "the legacy format stores none; convert to torch zip to get CRC-32s")
        )
    return checks


def _deepspeed(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    return zero_checks(p, full=full, progress=progress)


def _hf(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    """Each shard checked as a file of its own (check names prefixed with the shard's), and the index
    against the tensors the shards hold."""
    index = read_index(p)
    checks = [Check("index", "integrity", True, f"{len(index.weight_map)} tensors in {len(index.shards)} shard(s)")]
    for shard in index.shards:
        path = index.folder / shard
        try:
            fmt = detect_format(path)
            if fmt not in (ZIP, SAFETENSORS, LEGACY):
                raise CheckpointFormatError(f"{path}: a {fmt} is not a shard")
            found = {ZIP: _zip, SAFETENSORS: _safetensors, LEGACY: _legacy}[fmt](path, full, progress)
        except CkptkitError as e:
            found = [Check("structure", "integrity", False, str(e))]
        checks += [dataclasses.replace(c, name=f"{shard}: {c.name}") for c in found]
    name = "index matches the shards"
    try:
        open_source(p, HF).close()  # opens every shard and holds its tensor names against the index
    except NeedsTorch as e:
        return [*checks, Check(name, "integrity", True, f"not compared without torch ({e})")]
    except CheckpointFormatError as e:  # the pickle stand-ins' UnsupportedGlobal included
        ok = isinstance(e, UnsupportedGlobal)
        return [
            *checks,
            Check(name, "integrity", ok, "not compared: a shard needs torch to list its tensors" if ok else str(e)),
        ]
    return [*checks, Check(name, "integrity", True, "each shard holds exactly the tensors the index puts in it")]
