"""torch's own files as detection sees them: a zip whose first record is a local header (what
``torch.save`` writes), or the legacy format's magic number; and the zips torch writes for programs,
which are refused by name.

Example:
    >>> from pathlib import Path
    >>> ZIP_SIGNATURE.matches(Path("model.pt"), b"PK\\x03\\x04")  # doctest: +SKIP
    True
"""

from __future__ import annotations

import zipfile
from pathlib import Path

from ...errors import PARSE_ERRORS, CkptkitError, UnsupportedCheckpointError
from ...io.fileio import open_regular
from ..detect import Signature

ZIP = "torch-zip"
LEGACY = "torch-legacy"

_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # pickle of 0x1950a86a20f9469cfc6c


def _is_zip(p: Path, head: bytes) -> bool:
    if not head.startswith(b"PK\x03\x04"):
        return False
    _refuse_programs(p)
    return True


def _refuse_programs(p: Path) -> None:
    """Raise for the zip archives torch writes for programs rather than checkpoints."""
    try:
        with open_regular(p) as f, zipfile.ZipFile(f) as z:
            names = z.namelist()
    except CkptkitError:
        raise  # the store's failure (a URL's object), or what is at the path: not the zip's damage
    except PARSE_ERRORS:
        return  # damaged: the zip reader says how, with the details
    base = {n.split("/", 1)[1] if "/" in n else n for n in names}
    if "constants.pkl" in base or any(n.startswith("code/") for n in base):
        raise UnsupportedCheckpointError(
            f"{p}: is a TorchScript archive (torch.jit.save): a compiled program, not a checkpoint. "
            f"Load it with torch.jit.load({str(p)!r}) and save its state_dict() to get one"
        )
    # torch 2.6's torch.export.save wrote serialized_exported_program.json, later ones a PT2 archive
    if "archive_format" in base or "models/model.json" in base or "serialized_exported_program.json" in base:
        raise UnsupportedCheckpointError(
            f"{p}: is a torch.export archive (torch.export.save): a program, not a checkpoint. "
            f"Load it with torch.export.load({str(p)!r}) and save .module().state_dict() to get one"
        )


ZIP_SIGNATURE = Signature(ZIP, "a torch zip file", _is_zip)
LEGACY_SIGNATURE = Signature(LEGACY, "a legacy torch file", lambda p, head: head.startswith(_LEGACY_MAGIC))
# torch.load's files: what a pickle scan or torch's own unpickler can be tried on
TORCH_FILES = (ZIP_SIGNATURE, LEGACY_SIGNATURE)
