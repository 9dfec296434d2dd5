"""Load a checkpoint onto this process's device, safely, and into a model of any wrapping."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..distributed.devices import MapLocation
from ..formats.pickles.safety import AllowGlobals
from ..io.store import locate
from ..model.fit import load_into_model
from ..model.layout import find_model_state
from ..prefix import WRAPPER_PREFIXES
from .read import read_checkpoint
from .verify import verify_checkpoint

if TYPE_CHECKING:
    import torch


def load_for_rank(
    path: str | os.PathLike[str],
    *,
    model: torch.nn.Module | None = None,
    map_location: MapLocation = None,
    key: str | None = None,
    strict: bool = True,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    wrappers: Iterable[str] = WRAPPER_PREFIXES,
    mmap: bool = True,
    verify: bool = False,
) -> Any:
    """Load a checkpoint onto this process's device, and optionally into ``model``.

    Tensors saved on any accelerator (``cuda:N``) land on ``cuda:LOCAL_RANK`` of this process,
    or on the CPU when CUDA is unavailable, so a GPU-saved checkpoint opens on a CPU-only
    machine and no two ranks pile onto ``cuda:0``. Tensors saved on the CPU stay there. Not a
    collective: each rank reads the file itself.

    Args:
        path: a torch checkpoint (zip or legacy format), a ``.safetensors`` file, a
            ``torch.distributed.checkpoint`` folder, or a DeepSpeed ZeRO folder (its fp32 weights,
            as ``zero_to_fp32`` rebuilds them; one ZeRO-3 rank's file alone is refused). The last
            three record no device: they land on this rank's device. Or an object's URL
            (``s3://bucket/key.pt``), read once into a local staging file.
        model: when given, the weights are found in the checkpoint (top level, or under
            ``state_dict``/``model``/``model_state_dict``/``module``...), their wrapper prefixes
            (``module.``, ``_orig_mod.``, nested) adapted to ``model``'s, and loaded. Tied
            weights stored once (safetensors' ``save_model``, ``save_pretrained``) load as with
            ``safetensors.torch.load_model``: the names the model ties to the stored one share it.
        map_location: overrides the per-rank device mapping (as ``torch.load``'s).
        key: where the weights are, e.g. ``"ema"`` or ``"ema/model"``.
        strict: when True (default), any missing, unexpected or mis-shaped key raises
            :class:`StateDictMismatchError` listing all of them; when False those are skipped.
        trust: allow arbitrary unpickling. Only for files you trust: a pickle can run code.
        allow_globals: classes or functions to admit without trusting everything, e.g.
            ``[argparse.Namespace]`` or ``["argparse.Namespace"]``.
        wrappers: wrapper prefixes to adapt; add ``"model."`` for Lightning checkpoints.
        mmap: memory-map zip checkpoints instead of reading them into memory.
        verify: check integrity first (every zip CRC-32, ckptkit's safetensors CRCs, bounds,
            DCP shards): reads the whole file once; torch.load itself checks no CRC.

    Returns:
        The whole checkpoint object (so a training checkpoint's other entries are at hand).

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        CheckpointFormatError: damaged, or not a checkpoint.
        UnsupportedCheckpointError: a TorchScript or torch.export archive.
        UnsafeCheckpointError: the pickle needs globals that were not admitted.
        ClassNotFoundError: a trusted pickle's class cannot be imported.
        DistributedError: a trusted pickle needs a process group.
        ArgumentError: an option that cannot apply.
        LayoutError: the weights cannot be found in the checkpoint.
        StateDictMismatchError: the weights do not fit ``model`` (every key listed).

    Example:
        >>> ckpt = load_for_rank("ckpt.pt", model=model)  # doctest: +SKIP
        >>> optimizer.load_state_dict(ckpt["optimizer"])  # doctest: +SKIP
    """
    # an object's URL staged once, for the check and the load
    with locate(path).pointed().reading(whole=True) as source:
        if verify:
            verify_checkpoint(source).gate(trust=trust, allow_globals=allow_globals)
        obj = read_checkpoint(source, map_location=map_location, trust=trust, allow_globals=allow_globals, mmap=mmap)
        if model is not None:
            _, state_dict = find_model_state(obj, key=key, source=source)
            load_into_model(model, state_dict, strict=strict, wrappers=wrappers, source=source)
        return obj
