"""torch's own formats, as the registry knows them: the zip ``torch.save`` writes, and the legacy
format before it (read by torch alone)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO

from ...errors import CkptkitError
from ..deepspeed.files import refuse_rank_file
from ..source import open_source
from ..spec import CheckpointFormat, View, WritePlan, entry_tree
from . import modulepickle as mp
from .check import legacy_check, zip_check
from .container import TorchZip
from .detect import LEGACY_SIGNATURE, ZIP, ZIP_SIGNATURE
from .writer import write_torch_zip


def _open(path: Path, **_: Any) -> View:
    return open_source(path, ZIP)


def pickled_module_name(path: str | os.PathLike[str]) -> str:
    """The class of the whole module a torch zip pickles, e.g. ``DataParallel(ToyCNN)``; ``""``
    if it pickles something else, or a module whose state_dict() needs its own code."""
    try:
        with TorchZip(path) as z:
            return mp.read_module(z.read(f"{z.prefix}data.pkl"), trust=True).description
    except (mp.NotAModule, mp.Unmodelled, CkptkitError):
        return ""


def write_entries(target: BinaryIO | Path, view: View, obj: Any, state: Any, plan: WritePlan) -> None:
    """A torch zip of ``obj`` whose tensors are ``view``'s entries: a torch zip's storages copied as
    they are (views and all) where nothing is cast, else tensor by tensor."""
    assert not isinstance(target, Path)  # a file format: its writer gets the open file
    zipped = view.records() if plan.copy_storages else None
    if zipped is not None:
        records, prefix, byteorder = zipped
        write_torch_zip(target, obj, records=records, prefix=prefix, byteorder=byteorder, progress=plan.progress)
        return
    write_torch_zip(target, entry_tree(view, obj), progress=plan.progress)


TORCH_ZIP = CheckpointFormat(
    signature=ZIP_SIGNATURE,
    package="ckptkit.formats.torchzip",
    check=zip_check,
    open=_open,
    write_entries=write_entries,
    # .tar: torchvision's ImageNet example saves "model_best.pth.tar", a plain torch file.
    suffixes=(".pt", ".pth", ".bin", ".ckpt", ".tar"),
    device_tags=True,
    scan_globals=True,
    partial=refuse_rank_file,
    module_name=pickled_module_name,
)

TORCH_LEGACY = CheckpointFormat(
    signature=LEGACY_SIGNATURE,
    package="ckptkit.formats.torchzip",
    check=legacy_check,
    device_tags=True,
    scan_globals=True,
)
