"""The one write path: a suffix picks the format, the bytes go to an atomic, durable file, and
every failure comes back as a :class:`CkptkitError` naming its cause.

``save_on_master``, ``AsyncSaver``, ``convert`` and the trainer all write through here, so they
agree on suffixes (case-insensitive) and on errors.

Example:
    >>> format_for("model.SafeTensors"), format_for("model_best.pth.tar")
    ('safetensors', 'torch-zip')
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ArgumentError, CheckpointWriteError, CkptkitError
from ..formats.detect import SAFETENSORS, ZIP, Format
from ..formats.integrity import check_written
from ..io.atomic import atomic_write
from ..io.remote import is_url
from ..io.upload import staged_write

# .tar: torchvision's ImageNet example saves "model_best.pth.tar", a plain torch file.
SUFFIX_FORMATS: dict[str, Format] = {
    ".pt": ZIP,
    ".pth": ZIP,
    ".bin": ZIP,
    ".ckpt": ZIP,
    ".tar": ZIP,
    ".safetensors": SAFETENSORS,
}


def format_for(path: str | os.PathLike[str], *, default: Format | None = ZIP) -> Format:
    """The format a destination's suffix names; ``default`` for other suffixes (None: refuse them).

    Raises:
        ArgumentError: an unknown suffix and no default.
    """
    suffix = Path(path).suffix.lower()
    fmt = SUFFIX_FORMATS.get(suffix, default)
    if fmt is None:
        raise ArgumentError(
            f"{path}: unknown output suffix {suffix or '(none)'!r}; use one of {', '.join(SUFFIX_FORMATS)}"
        )
    return fmt


def write_checkpoint(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` atomically and durably, in the format its suffix names.

    Not a collective: every caller writes (use :func:`save_on_master` under DDP). A URL
    (``s3://bucket/key.pt``, any fsspec URL; ``pip install 'ckptkit[s3]'``) is written to a local
    staging file, checked, uploaded (the object appears whole or not at all) and read back.
    ``.safetensors`` takes a mapping of tensors or an ``nn.Module`` (its state dict; tied
    tensors are stored once and re-tied on load). Any other suffix gets torch's zip format.

    Raises:
        CheckpointWriteError: the write failed (disk full, permission, an object that cannot be
            pickled); the previous file at ``path`` is untouched.
        ArgumentError: ``obj`` does not fit the format.

    Example:
        >>> write_checkpoint(model.state_dict(), "model.safetensors")  # doctest: +SKIP
    """
    if is_url(path):
        with staged_write(path) as local:
            write_checkpoint(obj, local)
        return
    dest = Path(path)
    fmt = format_for(dest)
    with atomic_write(dest, check=lambda tmp: check_written(tmp, fmt, dest=dest)) as f:
        write_to(f, obj, fmt, dest)


def write_to(f: BinaryIO, obj: Any, fmt: Format, dest: Path) -> None:
    """Serialise ``obj`` into the open file ``f`` as ``fmt``; errors name ``dest``."""
    if fmt == SAFETENSORS:
        from ..formats.safetensors.torch import save_tensors

        if hasattr(obj, "state_dict") and hasattr(obj, "named_modules"):
            obj = obj.state_dict()
        if not isinstance(obj, Mapping):
            raise ArgumentError(f"{dest}: safetensors holds a mapping of tensors, not a {type(obj).__name__}")
        save_tensors(f, obj, source=str(dest))
        return
    _torch_save(obj, f, dest)


def _torch_save(obj: Any, f: BinaryIO, dest: Path) -> None:
    import torch

    from ..formats.torchzip.torch import FallBack, save_zip  # deferred: torch is imported only to save a torch file

    writer = _RecordingWriter(f)
    try:
        try:
            save_zip(obj, writer)  # type: ignore[arg-type]  # a file-like object
        except FallBack:
            f.seek(0)
            f.truncate()
            torch.save(obj, writer)  # type: ignore[arg-type]
    except CkptkitError:
        raise
    except Exception as e:
        # torch's zip writer turns a failed write into "unexpected pos ..."; the OSError it
        # swallowed (disk full, file too large) is the cause worth reading.
        if writer.error is not None:
            raise writer.error from e
        if isinstance(e, OSError):
            raise
        raise CheckpointWriteError(f"cannot save {dest}: {type(e).__name__}: {e}") from e


class _RecordingWriter:
    """A file wrapper that remembers the first OSError a write raised."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def tell(self) -> int:
        return self._f.tell()

    def fileno(self) -> int:
        return self._f.fileno()
