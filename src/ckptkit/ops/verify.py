"""Is this checkpoint intact, and can it be loaded without trusting it? One function answers
for every format, and the report it returns owns the decision to load.

Nothing runs pickled code: pickles are read through stand-ins or scanned opcode by opcode;
torch loads only files whose globals all passed torch's weights-only allowlist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import CheckpointFormatError, CkptkitError, UnsupportedCheckpointError, spell, summarize
from ..formats import registry
from ..formats.detect import check_exists
from ..formats.hf.index import shard_note
from ..formats.integrity import Check
from ..formats.pickles.safety import AllowGlobals, global_name, resolve_globals, unsafe_error
from ..formats.source import checkpoint_bytes
from ..formats.spec import CheckpointFormat, View
from ..io.fileio import Progress
from ..io.store import locate


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
    where = locate(path).pointed()  # a checkpoints folder or its latest: the checkpoint it names
    with contextlib.ExitStack() as stack:
        try:
            local = stack.enter_context(where.reading(checked=full))
        except CkptkitError as e:  # no such object, or its bytes differ from what ckptkit uploaded
            return VerifyReport(where.spelled, checks=[Check("format", "integrity", False, str(e))], error=e)
        report = _verify(local, full=full, progress=progress)
        try:
            stack.close()  # an object's bytes, all read: held against the CRC-32 recorded at upload
        except CkptkitError as e:
            report.checks.append(Check("object checksum", "integrity", False, str(e)))
            report.error = report.error or e
    report.path = where.spell(report.path, local)
    report.checks = [dataclasses.replace(c, detail=where.spell(c.detail, local)) for c in report.checks]
    report.notes = [where.spell(n, local) for n in report.notes]
    report.error = where.rename(report.error, local) if report.error is not None else None
    return report


def refuse_failing(path: Path, fmt: CheckpointFormat, *, opened: View | None = None) -> None:
    """Raise where ``verify`` would fail ``path`` on its structure (payload CRC-32s aside: a copy
    checks those as it reads the bytes), in verify's words: nothing is read or written from such
    a source. ``opened``: ``path`` as ``fmt.open`` read it, checked as it is
    (:attr:`~..formats.spec.CheckpointFormat.check_opened`), not read again.

    Raises:
        CheckpointFormatError: naming each failed check.

    Example:
        >>> refuse_failing(Path("model.pt"), registry.get("torch-zip"))  # doctest: +SKIP
    """
    try:
        if opened is not None:
            assert fmt.check_opened is not None  # only such a format's view is passed
            checks = fmt.check_opened(opened)
        else:
            checks = fmt.check(path, False, None)
    except CheckpointFormatError as e:  # the structure itself: the readers raise the same
        if type(e) is CheckpointFormatError and str(path) not in str(e):
            raise CheckpointFormatError(f"{path}: {e}") from None
        raise
    failed = [f"{c.name}: {c.detail}" for c in checks if c.kind == "integrity" and not c.ok]
    if failed:
        every = spell(f"verify_checkpoint({str(path)!r})", f"ckptkit verify {path}")
        raise CheckpointFormatError(
            f"{path}: fails verify ({summarize(failed, 3)}), so it is not read; {every} reports every check"
        )


def _verify(path: str, *, full: bool, progress: Callable[[int, int], None] | None) -> VerifyReport:
    report = VerifyReport(os.fspath(path))
    try:
        p = check_exists(path)
        report.format = registry.detect(p).name
    except CkptkitError as e:
        report.error = e
        report.checks.append(Check("format", "integrity", False, str(e)))
        return report
    report.checks.append(Check("format", "integrity", True, report.format))
    check = registry.get(report.format).check  # the same parser the format's readers use
    try:
        total = checkpoint_bytes(p, report.format)
        report.notes = [note] if p.is_file() and (note := shard_note(p)) else []
        read: Progress | None = (lambda n: progress(n, total)) if progress is not None else None
        report.checks += check(p, full, read)
    except CkptkitError as e:
        report.checks.append(Check("structure", "integrity", False, str(e)))
        if isinstance(e, UnsupportedCheckpointError):
            report.error = e  # intact, maybe: the gate raises this, not "failed verification"
    return report
