"""torch.distributed.checkpoint folders, as the registry knows them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..spec import CheckpointFormat, View
from .check import dcp_checks
from .detect import DCP_METADATA, SIGNATURE, is_dcp_file
from .stream import open_dcp


def _open(path: Path, *, lazy: bool = False, unstack_layers: bool = False, **_: Any) -> View:
    return open_dcp(path, lazy=lazy, unstack_layers=unstack_layers)


DCP_FORMAT = CheckpointFormat(
    signature=SIGNATURE,
    package="ckptkit.formats.dcp",
    check=dcp_checks,
    open=_open,
    folder=True,  # written by DCP's own writer (its torch half): no torch-free writer
    owns=(is_dcp_file, "DCP files"),
    published_by=lambda name: name == DCP_METADATA,
    written_by="DCP output: written by torch.distributed.checkpoint",
    unstacks_layers=True,  # megatron-core's torch_dist folders
)
