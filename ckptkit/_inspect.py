"""``ckptkit inspect``: what a checkpoint holds, read from its pickle or header alone.

For torch zip and safetensors files nothing is loaded but the pickle or header (torch is not
imported), so a multi-GB checkpoint is summarised in milliseconds. Legacy files and DCP folders
are loaded with torch (weights-only).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._errors import CheckpointFormatError, LayoutError
from ._formats import SAFETENSORS, ZIP, check_exists, checkpoint_globals, detect_format, filter_unsafe
from ._layout import find_model_state
from ._prefix import detect_prefixes

_ST_NAMES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
             "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16", "U32": "uint32",
             "U64": "uint64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
             "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz"}  # fmt: skip


@dataclass
class TensorInfo:
    name: str
    shape: list[int]
    dtype: str
    device: str
    nbytes: int


@dataclass
class CheckpointSummary:
    """What :func:`inspect_checkpoint` found. ``to_dict()`` gives the ``--json`` form."""

    path: str
    format: str
    file_bytes: int
    entries: list[dict[str, str]] = field(default_factory=list)
    weights_at: str | None = None
    prefixes: dict[str, Any] = field(default_factory=dict)
    tensors: list[TensorInfo] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)
    needs_trust: list[str] = field(default_factory=list)
    loaded_with_torch: bool = False

    @property
    def numel(self) -> int:
        return sum(_numel(t.shape) for t in self.tensors)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        out: Counter[str] = Counter()
        for t in self.tensors:
            out[t.dtype] += t.nbytes
        return dict(out.most_common())

    @property
    def devices(self) -> dict[str, int]:
        return dict(Counter(t.device for t in self.tensors).most_common())

    def groups(self) -> list[dict[str, Any]]:
        """Keys with numeric path parts folded: ``layers.*.attn.weight`` x32 (indices 0-31)."""
        out: dict[str, dict[str, Any]] = {}
        for t in self.tensors:
            pattern = re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", t.name)
            g = out.setdefault(pattern, {"pattern": pattern, "count": 0, "indices": [], "shapes": set(), "dtypes": set(), "nbytes": 0})
            g["count"] += 1
            g["indices"] += [int(x) for x in re.findall(r"(?:^|\.)(\d+)(?=\.)", t.name)[:1]]
            g["shapes"].add(tuple(t.shape))
            g["dtypes"].add(t.dtype)
            g["nbytes"] += t.nbytes
        for g in out.values():
            idx = sorted(set(g.pop("indices")))
            g["range"] = f"{idx[0]}-{idx[-1]}" if len(idx) > 1 else (str(idx[0]) if idx else "")
            g["shape"] = str(list(next(iter(g["shapes"])))) if len(g["shapes"]) == 1 else "various"
            g["dtype"] = ", ".join(sorted(g.pop("dtypes")))
            del g["shapes"]
        return list(out.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(numel=self.numel, bytes_by_dtype=self.bytes_by_dtype, devices=self.devices, tensor_count=len(self.tensors))
        return d


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _describe(value: Any, is_tensor: Any) -> tuple[str, str]:
    if is_tensor(value):
        return "tensor", ""
    if isinstance(value, Mapping):
        tensors = sum(1 for v in value.values() if is_tensor(v))
        if tensors and tensors == len(value):
            return "state dict", f"{tensors} tensors"
        return "dict", f"{len(value)} entries" + (f", {tensors} tensors" if tensors else "")
    if isinstance(value, (list, tuple)):
        return type(value).__name__, f"{len(value)} items"
    if isinstance(value, (int, float, str, bool)) or value is None:
        text = repr(value)
        return type(value).__name__, text if len(text) <= 60 else text[:57] + "..."
    return type(value).__name__, ""


def _fast(path: Path, fmt: str) -> tuple[Any, Any, Any, dict[str, Any]]:
    from . import _fastpath as fp
    from . import _lazy_pickle as lp

    src = fp.open_source(path, fmt)
    src.close()  # the names, shapes and offsets are read; no tensor bytes are needed

    def info(name: str, ref: Any) -> TensorInfo:
        if isinstance(ref, fp.StRef):
            dtype = _ST_NAMES.get(ref.dtype, ref.dtype)
            return TensorInfo(name, list(ref.shape), dtype, "cpu", ref.length)
        t = lp.tensor_of(ref)
        if t is None:
            raise CheckpointFormatError(f"{path}: entry {name} is not a tensor")
        return TensorInfo(name, list(t.shape), t.dtype, t.device, t.nbytes)

    meta: dict[str, Any] = dict(src.metadata or {})
    return src.obj, fp.is_leaf, info, meta


def _with_torch(path: Path, trust: bool) -> tuple[Any, Any, Any, dict[str, Any]]:
    import torch

    from ._load import read_checkpoint

    obj = read_checkpoint(path, map_location="cpu", trust=trust)

    def info(name: str, t: Any) -> TensorInfo:
        return TensorInfo(name, list(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), t.numel() * t.element_size())

    return obj, lambda v: isinstance(v, torch.Tensor), info, {}


def inspect_checkpoint(path: str | os.PathLike[str], *, key: str | None = None, trust: bool = False) -> CheckpointSummary:
    """Summarise a checkpoint: layout, where the weights are, prefixes, tensors, metadata.

    Example:
        >>> s = inspect_checkpoint("fixtures/ddp.pt")  # doctest: +SKIP
        >>> s.prefixes["leading"], len(s.tensors)  # doctest: +SKIP
        (['module.'], 7)
    """
    p = check_exists(path)
    fmt = detect_format(p)
    summary = CheckpointSummary(str(p), fmt, p.stat().st_size if p.is_file() else _folder_size(p))
    loaded = None
    if fmt in (ZIP, SAFETENSORS) and not trust:
        from ._lazy_pickle import UnsupportedGlobal

        try:
            loaded = _fast(p, fmt)
        except UnsupportedGlobal:
            unsafe = filter_unsafe(checkpoint_globals(p))
            if unsafe:
                # Describe what we can without running anything: the globals it needs.
                summary.needs_trust = unsafe
                return summary
    if loaded is None:
        loaded = _with_torch(p, trust)
        summary.loaded_with_torch = True
    obj, is_tensor, info, meta = loaded
    summary.metadata = meta
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            kind, detail = _describe(v, is_tensor)
            summary.entries.append({"name": str(k), "kind": kind, "detail": detail})
        ck = obj.get("ckptkit")
        if isinstance(ck, Mapping):
            summary.metadata.update({f"ckptkit.{k}": str(v) for k, v in ck.items()})
    try:
        where, state = find_model_state(obj, key=key, is_tensor=is_tensor, source=str(p))
    except LayoutError:
        return summary
    summary.weights_at = "/".join(where)
    info_prefix = detect_prefixes(state)
    summary.prefixes = {"leading": list(info_prefix.leading), "nested": list(info_prefix.nested), "common": info_prefix.common}
    summary.tensors = [info(k, v) for k, v in state.items() if is_tensor(v)]
    return summary


def _folder_size(p: Path) -> int:
    try:
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    except OSError as e:
        raise CheckpointFormatError(f"{p}: cannot read folder ({e})") from e
