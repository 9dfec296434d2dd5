"""Hugging Face shard folders (and their ``*.index.json``), as the registry knows them."""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from ..producers import Producer
from ..source import open_source
from ..spec import CheckpointFormat, View, WritePlan, entries_of
from .check import hf_check
from .detect import HF, SIGNATURE
from .folders import describe_folder
from .write import Written, write_shards


def _open(path: Path, **_: Any) -> View:
    return open_source(path, HF)


def write_entries(target: BinaryIO | Path, view: View, obj: Any, state: Any, plan: WritePlan) -> Written:
    """The weights ``state`` as a folder of safetensors shards at ``target``, each tensor's bytes
    copied from ``view``; the folder appears only once ``view`` found no damage."""
    assert isinstance(target, Path)  # a folder: its writer owns the temp folder and the swap
    tensors = entries_of(view, state)
    return write_shards(
        target,
        tensors,
        max_shard_size=plan.max_shard_size,
        source=view.name,
        progress=plan.progress,
        after=view.damage.raise_if_any,
        metadata=view.output_metadata(),
        write_plan=plan,
    )


def producer(path: Path) -> Producer | None:
    """A Trainer ``checkpoint-N/``, an Accelerate ``save_state`` or a ``save_pretrained`` folder,
    named by what its files are (an index file alone says nothing of who wrote it)."""
    return describe_folder(path) if path.is_dir() else None


HF_FORMAT = CheckpointFormat(
    signature=SIGNATURE,
    package="ckptkit.formats.hf",
    check=hf_check,
    open=_open,
    write_entries=write_entries,
    folder=True,
    tensors_only=True,
    keeps_metadata=True,
    published_by=lambda name: name.endswith(".index.json"),
    producer=producer,
)
