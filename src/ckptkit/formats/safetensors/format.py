"""safetensors, as the registry knows it."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from ...io.fileio import Progress, open_regular
from ..integrity import Check, safetensors_checks
from ..source import open_source
from ..spec import CheckpointFormat, View, WritePlan, entries_of
from .codec import parse_aliases, read_header, write_safetensors
from .detect import SAFETENSORS, SIGNATURE


def check(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    with open_regular(p) as f:
        return safetensors_checks(f, str(p), full=full, progress=progress)


def _open(path: Path, **_: Any) -> View:
    return open_source(path, SAFETENSORS)


def tied_names(dest: Path) -> list[str]:
    """The names a written file stores once, each as ``"alias is target"``."""
    with open(dest, "rb") as f:
        header, _ = read_header(f, source=str(dest))
    meta = header.pop("__metadata__", None) or {}
    return [f"{alias} is {target}" for _, alias, target in parse_aliases(meta, header, str(dest))]


def write_entries(target: BinaryIO | Path, view: View, obj: Any, state: Any, plan: WritePlan) -> None:
    """The weights ``state`` as one safetensors file, each tensor's bytes copied from ``view``."""
    assert not isinstance(target, Path)  # a file format: its writer gets the open file
    tensors = entries_of(view, state)
    write_safetensors(target, tensors, view.output_metadata(), source=view.name, progress=plan.progress)


SAFETENSORS_FORMAT = CheckpointFormat(
    signature=SIGNATURE,
    package="ckptkit.formats.safetensors",
    check=check,
    open=_open,
    write_entries=write_entries,
    suffixes=(".safetensors",),
    tensors_only=True,
    keeps_metadata=True,
    ties=tied_names,
)
