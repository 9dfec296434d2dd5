"""What ``inspect`` reads of a checkpoint: its object tree, what counts as a tensor there, and each
tensor's description, torch-free where the format allows (a pickle or header alone; a DCP folder's
``.metadata``; a ZeRO folder's pickles), else loaded with torch.

Example:
    >>> obj, is_tensor, info, meta, module = read_fast(Path("fixtures/ddp.pt"), "torch-zip")  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointFormatError
from ..formats import source as fp
from ..formats.dcp import stream as dcps
from ..formats.deepspeed import stream as dss
from ..formats.detect import DEEPSPEED, HF
from ..formats.dtypes import BY_SAFETENSORS
from ..formats.hf.folders import describe_folder
from ..formats.pickles import reader as tp
from ..formats.producers import Producer, generic_ema, is_averaged, recognise
from .safety import AllowGlobals


@dataclass
class TensorInfo:
    """One weight tensor. ``stored`` is the size of its storage, 0 when an earlier tensor
    shares it (tied weights are stored once)."""

    name: str
    shape: list[int]
    dtype: str
    device: str
    nbytes: int
    stored: int = 0


_Info = Callable[[str, Any], tuple[TensorInfo, Any, int]]  # (info, storage identity, storage bytes)


def read_fast(path: Path, fmt: str) -> tuple[Any, Any, _Info, dict[str, Any], str]:
    src = fp.open_source(path, fmt)
    src.close()  # the names, shapes and offsets are read; no tensor bytes are needed

    def info(name: str, ref: Any) -> tuple[TensorInfo, Any, int]:
        if isinstance(ref, fp.StRef):  # an alias is the same object as its target
            dtype = BY_SAFETENSORS[ref.dtype].name if ref.dtype in BY_SAFETENSORS else ref.dtype
            return TensorInfo(name, list(ref.shape), dtype, "cpu", ref.length), id(ref), ref.length
        t = tp.tensor_of(ref)
        if t is None:
            raise CheckpointFormatError(f"{path}: entry {name} is not a tensor")
        storage = (id(src.part(ref)), t.storage.key)  # keys repeat across shards
        return TensorInfo(name, list(t.shape), t.dtype, t.device, t.nbytes), storage, tp.storage_nbytes(t.storage)

    meta: dict[str, Any] = dict(src.metadata or {})
    return src.obj, fp.is_leaf, info, meta, src.module


def read_dcp(path: Path) -> tuple[Any, Any, _Info, dict[str, Any], str]:
    src = dcps.open_dcp(path)
    src.close()  # shapes, dtypes and where the bytes are: enough to describe it

    def info(name: str, t: dcps.DcpTensor) -> tuple[TensorInfo, Any, int]:
        return TensorInfo(name, list(t.shape), t.dtype, "cpu", t.nbytes), id(t), t.nbytes

    return src.obj, dcps.is_leaf, info, {}, ""


def read_deepspeed(path: Path) -> tuple[Any, Any, _Info, dict[str, Any], str]:
    src = dss.open_deepspeed(path)
    src.close()  # the rebuilt names, shapes and dtypes: read from the pickles alone

    def info(name: str, t: dss.DsTensor) -> tuple[TensorInfo, Any, int]:
        return TensorInfo(name, list(t.shape), t.dtype, "cpu", t.nbytes), id(t), t.nbytes

    meta = {"deepspeed": src.description, "weights": src.weights_from}
    return src.obj, dss.is_leaf, info, meta, ""


def read_with_torch(
    path: Path, trust: bool, allow_globals: AllowGlobals
) -> tuple[Any, Any, _Info, dict[str, Any], str]:
    import torch

    from .read import read_checkpoint  # deferred: the torch-free path above needs no torch

    obj = read_checkpoint(path, map_location="cpu", trust=trust, allow_globals=allow_globals)

    def info(name: str, t: Any) -> tuple[TensorInfo, Any, int]:
        storage = t.untyped_storage()
        size = t.numel() * t.element_size()
        return (
            TensorInfo(name, list(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), size),
            storage.data_ptr(),
            storage.nbytes(),
        )

    return obj, lambda v: isinstance(v, torch.Tensor), info, {}, ""


def name_producer(
    path: Path,
    fmt: str,
    obj: Any,
    weights_at: str | None,
    is_tensor: Callable[[Any], bool],
    *,
    meta: dict[str, Any] | None = None,
) -> Producer | None:
    """Who wrote the checkpoint (:mod:`.formats.producers`, :mod:`.formats.hf.folders`), where its
    weights and any EMA copy are; None where no rule recognises it.

    Example:
        >>> name_producer(Path("last.pth.tar"), "torch-zip", {"state_dict": {}, "arch": "vit"}, "state_dict", bool).name  # doctest: +SKIP
        'timm'
    """
    found: Producer | None = None
    if fmt == DEEPSPEED:
        found = Producer(
            "deepspeed",
            str((meta or {}).get("deepspeed", "DeepSpeed ZeRO checkpoint folder")),
            weights=weights_at,
            notes=[str((meta or {}).get("weights", ""))],
        )
    elif fmt == HF and path.is_dir():
        found = describe_folder(path)
    if found is None:
        found = recognise(obj, is_tensor=is_tensor)
    if (
        found is not None
        and found.ema is None
        and found.name not in ("deepspeed", "hf-trainer", "accelerate", "hf-pretrained")
    ):
        found.ema = generic_ema(obj, found.weights or weights_at, is_tensor)
    if found is None and (ema := generic_ema(obj, weights_at, is_tensor)):
        averaged = is_averaged(obj[ema], is_tensor)
        found = Producer(
            "averaged-model" if averaged else "training-checkpoint",
            f"a training checkpoint whose {ema} is a torch.optim.swa_utils.AveragedModel (SWA/EMA)"
            if averaged
            else "a training checkpoint (no framework's marks)",
            weights=weights_at,
            ema=ema,
        )
    if found is not None and found.weights is None:
        found.weights = weights_at
    return found
