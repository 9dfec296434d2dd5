"""How a path's format is found: each format's :class:`Signature` (its package's ``detect.py``)
says whether a path is one, and :func:`detect_format` asks them in turn. This module knows no
format; ``registry.detect`` walks them all, and a format whose parts are other formats' files
(Hugging Face shards) walks the few it admits.

Example:
    >>> from ckptkit.formats.safetensors.detect import SIGNATURE
    >>> SIGNATURE.name, SIGNATURE.folder
    ('safetensors', False)
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CheckpointFormatError, CheckpointNotFoundError
from ..io.fileio import file_size, open_regular

HEAD = 16  # bytes each file signature is shown


@dataclass(frozen=True)
class Signature:
    """What a format looks like on disk.

    Attributes:
        name: the format's name, as reports spell it (``"safetensors"``).
        what: as messages name one (``"a safetensors file"``).
        matches: ``matches(path, head)``: whether ``path`` is one, from its first :data:`HEAD`
            bytes (``b""`` for a folder) or its files' names; it may raise for an intact file
            that ckptkit refuses (a TorchScript archive).
        folder: it is a folder (``matches`` sees only folders), a file (only files), or None:
            either (Hugging Face shards are a folder, or its index file).
        looks_for: for a folder format, the file that marks one, as the "not a checkpoint" message
            names it.
    """

    name: str
    what: str
    matches: Callable[[Path, bytes], bool] = field(repr=False)
    folder: bool | None = False
    looks_for: str = ""


def check_exists(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a Path, or raise CheckpointNotFoundError naming close matches."""
    p = Path(path)
    if p.exists():
        return p
    near: list[str] = []
    if p.parent.is_dir():
        near = difflib.get_close_matches(p.name, [c.name for c in p.parent.iterdir()], n=3, cutoff=0.6)
    hint = f"; similar names there: {', '.join(near)}" if near else ""
    raise CheckpointNotFoundError(f"{p}: no such file{hint}", filename=str(p))


def sniff(path: str | os.PathLike[str], among: Sequence[Signature]) -> Signature | None:
    """The first of ``among`` that ``path`` matches, or None (for a path that exists).

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        CheckpointFormatError: a FIFO, device or socket is at ``path``, or a file this user may
            not read.
    """
    p = check_exists(path)
    folder = p.is_dir()
    head = b""
    if not folder:
        with open_regular(p) as f:  # never a plain open: a FIFO would block it
            head = f.read(HEAD)
    return next((s for s in among if s.folder in (None, folder) and s.matches(p, head)), None)


def detect_format(path: str | os.PathLike[str], among: Sequence[Signature]) -> str:
    """The name of the first of ``among`` that ``path`` is.

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        UnsupportedCheckpointError: an intact file of a kind ckptkit does not read (a
            TorchScript or torch.export archive).
        CheckpointFormatError: none of them.
    """
    found = sniff(path, among)
    if found is not None:
        return found.name
    p = Path(path)
    if p.is_dir():
        marks = [s.looks_for for s in among if s.folder is not False and s.looks_for]
        listed = ", ".join(marks[:-1]) + (" or " if len(marks) > 1 else "") + marks[-1] if marks else "a checkpoint"
        raise CheckpointFormatError(f"{p}: is a folder without {listed}; give a file")
    with open_regular(p) as f:
        if file_size(f) == 0:
            raise CheckpointFormatError(f"{p}: file is empty")
        head = f.read(8)
    kinds = [s.what for s in among]
    expected = ", ".join(kinds[:-1]) + (", or " if len(kinds) > 1 else "") + kinds[-1]
    raise CheckpointFormatError(f"{p}: not a checkpoint ckptkit knows (expected {expected}; first bytes {head.hex()})")
