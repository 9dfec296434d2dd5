"""``ckptkit inspect``: what a checkpoint holds, read from its pickle or header alone.

For torch zip and safetensors files nothing is loaded but the pickle or header (torch is not
imported), so a multi-GB checkpoint is summarised in milliseconds; DCP folders likewise (their
``.metadata`` and each chunk's zip header), unless the copy path would hand them to torch
(chunks split along a dimension other than the first). Legacy files are loaded with torch
(weights-only).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import LayoutError, PartialCheckpointError
from ..formats import registry
from ..formats import source as fp
from ..formats.detect import check_exists
from ..formats.hf.index import shard_note
from ..formats.pickles import reader as tp
from ..formats.pickles.safety import AllowGlobals, filter_unsafe, needed_globals, unsafe_error
from ..formats.source import checkpoint_bytes
from ..formats.spec import TensorInfo
from ..formats.torchzip import modulepickle as mp
from ..io.store import locate
from ..model.layout import TOP, find_model_state
from ..prefix import detect_prefixes
from .inspect_read import name_producer, read_view, read_with_torch


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
    trusted: bool = False
    pickled_module: str = ""  # a whole pickled module's class: the tensors are its state_dict()
    producer: dict[str, Any] | None = (
        None  # who wrote it, where its weights and EMA copy are (formats.producers.Producer)
    )
    notes: list[str] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(_numel(t.shape) for t in self.tensors)

    @property
    def bytes_by_dtype(self) -> dict[str, int]:
        """Bytes stored per dtype, each storage counted once (a tied weight is stored once)."""
        out: Counter[str] = Counter()
        for t in self.tensors:
            out[t.dtype] += t.stored
        return dict(out.most_common())

    @property
    def shared(self) -> int:
        """How many tensors share their storage with an earlier one (tied weights)."""
        return sum(1 for t in self.tensors if t.stored == 0 and t.nbytes)

    @property
    def devices(self) -> dict[str, int]:
        return dict(Counter(t.device for t in self.tensors).most_common())

    def groups(self) -> list[dict[str, Any]]:
        """Keys with numeric path parts folded: ``layers.*.attn.weight`` x32 (indices 0-31)."""
        out: dict[str, dict[str, Any]] = {}
        for t in self.tensors:
            pattern = re.sub(r"(?<=\.)\d+(?=\.)|^\d+(?=\.)", "*", t.name)
            g = out.setdefault(
                pattern, {"pattern": pattern, "count": 0, "indices": [], "shapes": set(), "dtypes": set(), "nbytes": 0}
            )
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
        d.update(
            numel=self.numel,
            bytes_by_dtype=self.bytes_by_dtype,
            devices=self.devices,
            tensor_count=len(self.tensors),
            shared=self.shared,
        )
        return d


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _count(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else many or one + 's'}"


def _describe(value: Any, is_tensor: Any) -> tuple[str, str]:
    if is_tensor(value):
        return "tensor", ""
    if isinstance(value, Mapping):
        tensors = sum(1 for v in value.values() if is_tensor(v))
        if tensors and tensors == len(value):
            return "state dict", _count(tensors, "tensor")
        return "dict", _count(len(value), "entry", "entries") + (f", {_count(tensors, 'tensor')}" if tensors else "")
    if isinstance(value, (list, tuple)):
        return type(value).__name__, _count(len(value), "item")
    if isinstance(value, (int, float, str, bool)) or value is None:
        text = repr(value)
        return type(value).__name__, text if len(text) <= 60 else text[:57] + "..."
    return type(value).__name__, ""


def inspect_checkpoint(
    path: str | os.PathLike[str], *, key: str | None = None, trust: bool = False, allow_globals: AllowGlobals = ()
) -> CheckpointSummary:
    """Summarise a checkpoint: layout, where the weights are, prefixes, tensors, metadata.

    A DeepSpeed ZeRO folder is described as the fp32 state dict ``zero_to_fp32`` rebuilds, its
    metadata saying which stage, how many ranks, which tag and where the weights are.

    Torch zip and safetensors files are read without torch (pickle or header only). A file
    whose pickle needs globals outside torch's allowlist (and ``allow_globals``) is described
    by what it needs (``needs_trust``) unless ``trust`` is given. A URL (``s3://bucket/key.pt``)
    is read whole into a local staging file first.

    Example:
        >>> s = inspect_checkpoint("fixtures/ddp.pt")  # doctest: +SKIP
        >>> s.prefixes["leading"], len(s.tensors)  # doctest: +SKIP
        (['module.'], 7)
    """
    where = locate(
        path
    ).pointed()  # a checkpoints folder or its latest: the checkpoint it names; an object's URL is staged in a local file, described under its URL
    with where.reading() as local:
        summary = _inspect(local, key=key, trust=trust, allow_globals=allow_globals)
    summary.path = where.spell(summary.path, local)
    summary.notes = [where.spell(n, local) for n in summary.notes]
    if summary.producer is not None:  # its notes may name a file of the folder (megatron's common.pt)
        summary.producer["notes"] = [where.spell(n, local) for n in summary.producer["notes"]]
    return summary


def _inspect(path: str, *, key: str | None, trust: bool, allow_globals: AllowGlobals) -> CheckpointSummary:
    p = check_exists(path)
    fmt = registry.detect(p)
    summary = CheckpointSummary(str(p), fmt.name, checkpoint_bytes(p, fmt.name))
    summary.notes = [note] if p.is_file() and (note := shard_note(p)) else []
    loaded = None
    if fmt.partial is not None:
        try:
            fmt.partial(p)
        except PartialCheckpointError as e:  # described as it is, with where its weights really are
            summary.notes.append(str(e))
    if fmt.open is not None and not (trust and fmt.trust_matters):  # trust: what torch builds is described
        try:
            loaded = read_view(fmt.open(p))
        except mp.UnsafeModulePickle as e:
            summary.needs_trust, summary.pickled_module = filter_unsafe(e.names, allow_globals), e.description
            if summary.needs_trust:
                return summary
        except fp.NeedsTorch:
            pass  # a pickled module whose state_dict() needs its code: torch's loader says what it needs
        except tp.UnsupportedGlobal:
            # One pickle's globals (a torch file's): torch's weights-only load says which it needs.
            # Folders (a shard's, DCP's metadata): torch reads them, applying ckptkit's safety rules.
            needs = needed_globals(p, allow_globals) if fmt.scan_globals else None
            if needs is not None and not needs.loads:  # allowing globals is not enough: say so, and why
                raise unsafe_error(str(p), needs.names, loads=False, why=needs.why) from None
            if needs is not None and needs.names:
                # Describe what we can without running anything: the globals it needs.
                summary.needs_trust = list(needs.names)
                return summary
    if loaded is None:
        loaded = read_with_torch(p, trust, allow_globals)
        summary.loaded_with_torch, summary.trusted = True, trust
    obj, is_tensor, info, meta, summary.pickled_module, hint, notes = loaded
    if hint is None and fmt.producer is not None:
        hint = fmt.producer(p)
    summary.notes += notes
    summary.metadata = meta
    try:
        where, state = find_model_state(obj, key=key, is_tensor=is_tensor, source=str(p))
    except LayoutError:
        where, state = None, {}
    if isinstance(obj, Mapping) and where != ():  # a bare state dict's entries are its tensors, listed below
        for k, v in obj.items():
            if where == (TOP,) and k in state:  # the weights themselves, listed below
                continue
            kind, detail = _describe(v, is_tensor)
            summary.entries.append({"name": str(k), "kind": kind, "detail": detail})
        ck = obj.get("ckptkit")
        if isinstance(ck, Mapping):
            summary.metadata.update({f"ckptkit.{k}": str(v) for k, v in ck.items()})
    if (
        producer := name_producer(obj, "/".join(where) if where is not None else None, is_tensor, hint=hint)
    ) is not None:
        summary.producer = asdict(producer)
    if where is None:
        return summary
    summary.weights_at = "/".join(where)
    found = detect_prefixes(state)
    summary.prefixes = {"leading": list(found.leading), "nested": list(found.nested), "common": found.common}
    seen: set[Any] = set()
    for k, v in state.items():
        if is_tensor(v):
            t, storage, size = info(k, v)
            t.stored = 0 if storage in seen else size
            seen.add(storage)
            summary.tensors.append(t)
    return summary
