"""torch.distributed.checkpoint folders, as the registry knows them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from ..spec import CheckpointFormat, View, WritePlan, entry_tree
from .check import dcp_checks, opened_checks
from .detect import DCP_METADATA, SIGNATURE, is_dcp_file
from .stream import open_dcp
from .write import write_dcp_entries


def _open(path: Path, *, lazy: bool = False, unstack_layers: bool = False, **_: Any) -> View:
    return open_dcp(path, lazy=lazy, unstack_layers=unstack_layers)


def write_entries(target: BinaryIO | Path, view: View, obj: Any, state: Any, plan: WritePlan) -> None:
    """``obj`` as a DCP folder at ``target``, each tensor's bytes copied from ``view``; the folder
    appears only once ``view`` found no damage."""
    assert isinstance(target, Path)  # a folder: its writer owns the temp folder and the swap
    write_dcp_entries(
        target,
        entry_tree(view, obj),
        source=view.name,
        progress=plan.progress,
        after=view.damage.raise_if_any,
        plan=plan,
    )


DCP_FORMAT = CheckpointFormat(
    signature=SIGNATURE,
    package="ckptkit.formats.dcp",
    check=dcp_checks,
    open=_open,
    check_opened=opened_checks,
    write_entries=write_entries,
    folder=True,
    owns=(is_dcp_file, "DCP files"),
    published_by=lambda name: name == DCP_METADATA,
    unstacks_layers=True,  # megatron-core's torch_dist folders
)
