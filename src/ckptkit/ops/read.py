"""Read any supported checkpoint as Python objects, safely, onto this rank's device."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import Any, Literal

from ..distributed.devices import MapLocation, Placement
from ..formats import registry
from ..formats.hf.index import shard_note
from ..formats.pickles.safety import AllowGlobals
from ..io.fileio import local_file
from ..io.store import locate
from .verify import refuse_failing


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    mmap: bool = True,
) -> Any:
    """Load a torch zip or legacy file, a safetensors file, a DCP folder, Hugging Face shards
    (their folder or index: one state dict, checked against the index), or a DeepSpeed ZeRO
    folder (the fp32 state dict ``zero_to_fp32`` rebuilds: ``formats.deepspeed.torch.read_deepspeed``) (no model involved).

    Not a collective: each rank reads the file itself. Safe by default: pickles load with
    ``weights_only=True``. A whole pickled module (``torch.save(model, path)``, DDP/DataParallel/
    torch.compile wrapped or not) gives its ``state_dict()``, read without importing its classes
    or running anything.

    Args:
        path: the checkpoint; or an object's URL (``s3://bucket/key.pt``, any fsspec URL), staged
            through a local file that is removed before this returns.
        map_location: as ``torch.load``'s; by default storages saved on any accelerator land on
            this rank's device (``cuda:LOCAL_RANK``, or the CPU without CUDA) and CPU storages stay
            on the CPU. Safetensors files and DCP folders take a device.
        trust: allow arbitrary unpickling. Only for files you trust: a pickle can run code.
        allow_globals: classes or functions to admit without trusting everything, as objects
            (``[argparse.Namespace]``) or dotted names (``["argparse.Namespace"]``).
        mmap: memory-map zip checkpoints instead of reading them into memory.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointFormatError: damaged, or not a checkpoint.
        UnsupportedCheckpointError: a TorchScript or torch.export archive.
        UnsafeCheckpointError: the pickle needs globals that were not admitted.
        ClassNotFoundError: a trusted pickle's class cannot be imported.
        ArgumentError: an option that cannot apply.
        PartialCheckpointError: one ZeRO-3 rank's file (the message names the folder to give).

    Example:
        >>> ckpt = read_checkpoint("fixtures/train_ckpt.pt", map_location="cpu")  # doctest: +SKIP
        >>> sorted(ckpt)  # doctest: +SKIP
        ['best_loss', 'epoch', 'model', 'optimizer', 'scheduler', 'step']
    """
    where = locate(path).pointed()  # a checkpoints folder or its latest: the checkpoint it names
    with where.reading(whole=True) as local:  # torch reads every byte
        if note := shard_note(Path(local)):  # one shard alone loads as a partial model: say so
            warnings.warn(where.spell(note, local), stacklevel=2)
        return read_source(local, map_location=map_location, trust=trust, allow_globals=allow_globals, mmap=mmap)


def read_source(
    source: str,
    *,
    map_location: MapLocation = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    mmap: bool = True,
    zero_weights: Literal["fp32", "module"] = "fp32",
    checked: bool = False,
) -> Any:
    """A local checkpoint read by its format's torch half (what :func:`read_checkpoint` does once
    the path is local; ``zero_weights`` for a DeepSpeed ZeRO folder). What ``verify`` fails on its
    structure is refused first, in its words (``checked``: the caller already did)."""
    fmt = registry.detect(source)
    if fmt.partial is not None:  # e.g. an intact torch zip whose weights are 0-element placeholders
        fmt.partial(Path(source))
    if not checked:
        refuse_failing(Path(source), fmt)  # verify's judgement: what it fails, no reader reads
    return fmt.torch().read(
        local_file(source),  # torch opens the paths itself: an object read elsewhere is fetched first
        fmt=fmt.name,
        placement=Placement(map_location, source),
        trust=trust,
        allow_globals=allow_globals,
        mmap=mmap,
        zero_weights=zero_weights,
    )
