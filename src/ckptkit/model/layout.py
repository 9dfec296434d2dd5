"""Where the model weights live inside a checkpoint object.

Users meet a bare state dict, or a training checkpoint that nests one under ``state_dict``
(Lightning), ``model``, ``model_state_dict``, ``module`` (some DDP scripts) and friends; an EMA
copy beside them (``state_dict_ema``, ``model_ema``) is taken only when asked for by ``key``. The
lookup never imports torch: the caller says what counts as a tensor, so the same code serves
real tensors and the placeholders of the torch-free reader.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import LayoutError, spell, summarize
from ..formats.producers import is_ema_name
from ..prefix import check_prefix, strip_prefix

MODEL_KEYS: tuple[str, ...] = ("state_dict", "model", "model_state_dict", "module", "net", "network", "weights")


def _default_is_tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def is_state_dict(obj: Any, is_tensor: Callable[[Any], bool] | None = None) -> bool:
    """True for a mapping of string keys to tensors (``*_extra_state`` entries may be anything)."""
    if not isinstance(obj, Mapping) or not obj:
        return False
    is_tensor = is_tensor or _default_is_tensor
    seen_tensor = False
    for key, value in obj.items():
        if not isinstance(key, str):
            return False
        if is_tensor(value):
            seen_tensor = True
        elif not key.endswith("_extra_state"):
            return False
    return seen_tensor


def find_model_state(
    obj: Any,
    *,
    key: str | None = None,
    is_tensor: Callable[[Any], bool] | None = None,
    source: str = "checkpoint",
    option: str = "key",
) -> tuple[tuple[str, ...], Mapping[str, Any]]:
    """Locate the model state dict inside a loaded checkpoint.

    Args:
        obj: what the checkpoint holds.
        key: where the weights are, as ``"ema"`` or a path ``"ema/model"``; found
            automatically when omitted. A last part ending in ``.`` selects the keys under
            that prefix, which it removes: ``"student."``, ``"model/student."``.
        is_tensor: predicate for tensor values (default: ``isinstance(v, torch.Tensor)``).
        source: the file name, for error messages.
        option: the caller's name for ``key`` (``key_a`` for diff's first file), for messages.

    Returns:
        ``(path, state_dict)``, where ``path`` is ``()`` for a bare state dict, else the keys
        leading to it, e.g. ``("model",)``, and then the prefix selected, e.g. ``("model", "student.")``.

    Raises:
        LayoutError: no state dict at ``key``, or none of the usual places holds one.
    """
    is_tensor = is_tensor or _default_is_tensor
    say = spell(f"{option}=", "--" + option.replace("_", "-"))
    if key is not None and key.endswith("."):
        base, _, prefix = key.rpartition("/")
        path, state = find_model_state(obj, key=base or None, is_tensor=is_tensor, source=source, option=option)
        if not any(k.startswith(check_prefix(prefix)) for k in state):
            heads = list(dict.fromkeys(k.split(".")[0] + "." for k in state))
            raise LayoutError(f"{source}: no weight starts with {prefix!r} (they start with {summarize(heads)})")
        return (*path, prefix), select_prefix(state, prefix)
    if key is not None:
        node = obj
        path = tuple(p for p in key.split("/") if p)
        for depth, part in enumerate(path):
            if not isinstance(node, Mapping) or part not in node:
                where = "/".join(path[:depth]) or "the top level"
                have = list(node.keys()) if isinstance(node, Mapping) else []
                raise LayoutError(
                    f"{source}: no entry {part!r} at {where} (entries: {summarize([str(k) for k in have]) or 'none'})"
                )
            node = node[part]
        if not is_state_dict(node, is_tensor):
            raise LayoutError(f"{source}: entry {key!r} is not a state dict (a mapping of names to tensors)")
        return path, node
    if is_state_dict(obj, is_tensor):
        return (), obj
    if isinstance(obj, Mapping):
        for name in MODEL_KEYS:
            if name in obj and is_state_dict(obj[name], is_tensor):
                return (name,), obj[name]
        candidates = [str(k) for k, v in obj.items() if is_state_dict(v, is_tensor)]
        trained = [c for c in candidates if not is_ema_name(c)]
        if (
            len(candidates) > 1 and len(trained) == 1
        ):  # {"student": ..., "student_ema": ...}: an EMA copy is taken only by --key
            candidates = trained
        if len(candidates) == 1:
            return (candidates[0],), obj[candidates[0]]
        top = summarize([str(k) for k in obj.keys()]) or "none"
        if candidates:
            raise LayoutError(
                f"{source}: several entries hold state dicts ({summarize(candidates)}); say which with {say}"
            )
        raise LayoutError(
            f"{source}: no model state dict found; looked at the top level and at "
            f"{', '.join(MODEL_KEYS)} (top-level entries: {top}); say where with {say}"
        )
    raise LayoutError(f"{source}: holds a {type(obj).__name__}, not a state dict or a dict of entries")


def select_prefix(state_dict: Mapping[str, Any], prefix: str) -> OrderedDict[str, Any]:
    """The entries under ``prefix``, with it removed (a student's weights beside a teacher's).

    Example:
        >>> dict(select_prefix({"teacher.w": 1, "student.w": 2}, "student."))
        {'w': 2}
    """
    check_prefix(prefix)
    sub: OrderedDict[str, Any] = OrderedDict((k, v) for k, v in state_dict.items() if k.startswith(prefix))
    meta = getattr(state_dict, "_metadata", None)
    if meta is not None:
        sub._metadata = OrderedDict((p, v) for p, v in meta.items() if p == prefix[:-1] or p.startswith(prefix))  # type: ignore[attr-defined]
    return strip_prefix(sub, prefix)


def replace_at(obj: Any, path: tuple[str, ...], value: Any) -> Any:
    """Return ``obj`` with the entry at ``path`` replaced by ``value`` (containers copied shallowly)."""
    if not path:
        return value
    copy = obj.copy() if hasattr(obj, "copy") else dict(obj)
    copy[path[0]] = replace_at(obj[path[0]], path[1:], value)
    return copy
