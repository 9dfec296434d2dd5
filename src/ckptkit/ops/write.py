"""The one write path: a suffix picks the format, the bytes go to an atomic, durable file, and
every failure comes back as a :class:`CkptkitError` naming its cause.

``save_on_master``, ``AsyncSaver``, ``convert`` and the trainer all write through here, so they
agree on suffixes (case-insensitive) and on errors.

Example:
    >>> format_for("model.SafeTensors").name, format_for("model_best.pth.tar").name
    ('safetensors', 'torch-zip')
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..formats import registry
from ..formats.integrity import check_written, kept_for_check
from ..formats.spec import CheckpointFormat, WritePlan
from ..formats.torchzip.detect import ZIP
from ..io.atomic import atomic_write
from ..io.store import locate


def format_for(path: str | os.PathLike[str], *, default: str | None = ZIP) -> CheckpointFormat:
    """The format a destination's suffix names; ``default`` for other suffixes (None: refuse them).

    Raises:
        ArgumentError: an unknown suffix and no default.
    """
    return registry.for_suffix(path, default=default)


def write_checkpoint(obj: Any, path: str | os.PathLike[str]) -> None:
    """Write ``obj`` to ``path`` atomically and durably, in the format its suffix names.

    Not a collective: every caller writes (use :func:`save_on_master` under DDP). A URL
    (``s3://bucket/key.pt``, any fsspec URL; ``pip install 'ckptkit[s3]'``) is streamed to the
    store as it is written (another store's: staged in a local file, then uploaded), checked, and
    committed whole or not at all, then checked by the store's CRC-32 of it or read back.
    ``.safetensors`` takes a mapping of tensors or an ``nn.Module`` (its state dict; tied
    tensors are stored once and re-tied on load). Any other suffix gets torch's zip format.

    Raises:
        CheckpointWriteError: the write failed (disk full, permission, an object that cannot be
            pickled); the previous file at ``path`` is untouched.
        ArgumentError: ``obj`` does not fit the format.

    Example:
        >>> write_checkpoint(model.state_dict(), "model.safetensors")  # doctest: +SKIP
    """
    with locate(path).writing() as local:
        dest = Path(local)
        write_file(obj, obj, format_for(dest), dest)


def write_file(obj: Any, state: Any, fmt: CheckpointFormat, dest: Path, plan: WritePlan | None = None) -> Any:
    """``obj`` (``state``, for a format that holds tensors only) written by ``fmt``'s torch half to
    ``dest``: a file atomically, checked before it replaces ``dest``; a folder by its own writer."""
    plan = plan or WritePlan(source=str(dest))
    if fmt.folder:
        return fmt.torch().write(dest, obj, state, dest=dest, plan=plan)
    check = lambda tmp: check_written(tmp, fmt.name, dest=dest)  # noqa: E731
    with atomic_write(dest, check=check, kept=kept_for_check(fmt.name)) as f:
        return fmt.torch().write(f, obj, state, dest=dest, plan=plan)
