"""What :func:`ckptkit.convert_checkpoint` did: its report, and the facts the report names."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..model.layout import is_state_dict
from ..prefix import detect_prefixes


@dataclass
class ConvertReport:
    """What :func:`convert_checkpoint` did.

    Attributes:
        source, destination: the paths.
        source_format, destination_format: e.g. ``torch-zip``, ``safetensors``.
        weights_at: where the weights were in the source (``""`` for the top level).
        tensors: number of weight tensors.
        renamed: how many weight keys are written under another name than the source's (with
            ``key="student."``, every key that lost ``student.``).
        prefix_before, prefix_after: the leading part of the renamed keys before and after
            (``"module."`` and ``""`` for DDP -> single, ``"student."`` and ``""`` for
            ``key="student."``); both the leading wrappers when none was renamed.
        dropped: top-level entries not written (with ``model_only``).
        left: other entries that also hold wrapped weights (an EMA copy), left as they were;
            convert them with ``key=``.
        tied: for a safetensors output, ``"alias is target"`` for each tensor stored once and
            re-tied on load (``safetensors.torch.load_model`` or ckptkit's loaders do that); for
            Hugging Face shards, each tied tensor the index metadata records instead.
        fast: True when torch was never imported (names rewritten, tensor bytes copied).
        fallback_reason: why the torch path was used, when it was.
        bytes: size of the written file (of every file, for a folder).
        shards: for a Hugging Face sharded output, how many shard files.
        notes: what the caller should know (the source is one shard of a sharded checkpoint;
            what ``dtype`` cast, what ``sanitize`` changed).
        cast: with ``dtype``, the names of the tensors cast (as written).
        merged: with ``merge_adapter``, the weights the adapter was merged into (as the source names them).
        sanitized: with ``sanitize``, each change, ``"key/path: what -> what"``.
        unread: the source's checksummed records not copied, so not read nor checked (the
            optimizer state a model-only copy leaves behind); ``verify`` checks every one.
    """

    source: str
    destination: str
    source_format: str
    destination_format: str
    weights_at: str
    tensors: int
    renamed: int
    prefix_before: str
    prefix_after: str
    dropped: list[str] = field(default_factory=list)
    left: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    fast: bool = True
    fallback_reason: str = ""
    bytes: int = 0
    shards: int = 0
    notes: list[str] = field(default_factory=list)
    pickled_module: str = ""
    cast: list[str] = field(default_factory=list)
    merged: list[str] = field(default_factory=list)
    sanitized: list[str] = field(default_factory=list)
    unread: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def other_wrapped_weights(obj: Any, path: tuple[str, ...], is_tensor: Any) -> list[str]:
    """Where else ``obj`` holds a state dict with wrapper prefixes (an EMA copy, a teacher)."""
    found: list[str] = []
    todo: list[tuple[tuple[str, ...], Any]] = [((), obj)]
    while todo:
        where, node = todo.pop(0)
        if not isinstance(node, Mapping) or len(where) > 3:
            continue
        if where and where != path and is_state_dict(node, is_tensor) and detect_prefixes(node).wrapped:
            found.append("/".join(where))
            continue
        todo += [((*where, str(k)), v) for k, v in node.items() if (*where, str(k)) != path]
    return found


def renamed_prefixes(before: Sequence[str], after: Sequence[str]) -> tuple[str, str]:
    """The leading part most renamed keys lost and gained: ``("module.", "")`` for DDP -> single.

    Example:
        >>> renamed_prefixes(["fc.w", "fc.b"], ["model.fc.w", "model.fc.b"])
        ('', 'model.')
    """
    changes: Counter[tuple[str, str]] = Counter()
    for a, b in zip(before, after, strict=True):
        if a == b:
            continue
        x, y = a.split("."), b.split(".")
        same = 0
        while same < min(len(x), len(y)) and x[-1 - same] == y[-1 - same]:
            same += 1
        changes[
            (
                ".".join(x[: len(x) - same]) + "." if len(x) > same else "",
                ".".join(y[: len(y) - same]) + "." if len(y) > same else "",
            )
        ] += 1
    if not changes:
        lead = detect_prefixes(before).prefix
        return lead, lead
    return changes.most_common(1)[0][0]
