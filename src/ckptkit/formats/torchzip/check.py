"""What ``verify`` reports of a torch zip or legacy file.

The zip's structure, every record's CRC-32, and its pickle read through the same inert
stand-ins the readers use (:func:`~ckptkit.formats.integrity.zip_checks`); where the stand-ins
cannot judge the pickle, the globals it needs (torch's weights-only allowlist, confirmed by
torch's own unpickler) and, with ``full``, a weights-only load through the torch half.

Example:
    >>> [c.name for c in zip_check(Path("fixtures/ddp.pt"), False, None)]  # doctest: +SKIP
    ['zip structure', 'safe to load', 'tensors fit their storages']
"""

from __future__ import annotations

from pathlib import Path

from ...errors import CkptkitError, UnsafeCheckpointError
from ...io.fileio import Progress
from ..integrity import Check, zip_checks
from ..pickles.safety import needed_globals, needs_text, unsafe_error
from .container import TorchZip
from .detect import LEGACY, ZIP


def zip_check(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    with TorchZip(p) as z:  # every read through one open file: the version opened, even if replaced
        checks, needs_torch = zip_checks(z, full=full, progress=progress)
    if needs_torch:
        checks.append(safe := _globals_safe(p))
        if safe.ok and full:
            checks.append(_torch_loads(p, ZIP))
    return checks


def legacy_check(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    checks = [_globals_safe(p)]
    if checks[0].ok and full:
        checks.append(_torch_loads(p, LEGACY))
    if full:
        checks.append(
            Check("checksums", "integrity", True, "the legacy format stores none; convert to torch zip to get CRC-32s")
        )
    return checks


def _globals_safe(p: Path) -> Check:
    needs = needed_globals(p)  # the static scan, confirmed by torch's weights-only unpickler
    unsafe = list(needs.names)
    detail = f"pickle {needs_text(unsafe)}" if unsafe else "only weights-only globals"
    if not needs.loads:  # allowing globals is not enough: only trust is advised
        detail = f"{unsafe_error(p.name, unsafe, loads=False, why=needs.why)}".removeprefix(
            f"{p.name}: refused to load: "
        )
    return Check("safe to load", "safety", needs.loads and not unsafe, detail, tuple(unsafe))


def _torch_loads(p: Path, fmt: str) -> Check:
    from .torch import torch_load  # deferred: verify runs without torch where the checks above suffice

    name = "loads with torch (weights-only)"
    try:
        torch_load(str(p), fmt, map_location="cpu", trust=False, allow_globals=(), mmap=True)
    except UnsafeCheckpointError as e:
        return Check(name, "safety", False, str(e), e.globals)
    except CkptkitError as e:  # damage, or an intact file torch still refuses: either way not loadable
        return Check(name, "integrity", False, str(e))
    return Check(name, "integrity", True)
