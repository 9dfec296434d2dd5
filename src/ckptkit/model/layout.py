"""Where the model weights live inside a checkpoint object.

Users meet a bare state dict, or a training checkpoint that nests one under ``state_dict``
(Lightning), ``model``, ``model_state_dict``, ``module`` (some DDP scripts) and friends; an EMA
copy beside them (``state_dict_ema``, ``model_ema``) is taken only when asked for by ``key``.
torchtitan flattens the model's weights into the top level itself, beside ``optimizer``,
``lr_scheduler`` and ``train_state``: those tensors are the weights (path ``(TOP,)``). The
lookup never imports torch: the caller says what counts as a tensor, so the same code serves
real tensors and the placeholders of the torch-free reader.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ..errors import LayoutError, spell, summarize
from ..formats.producers import is_ema_name
from ..prefix import check_prefix, strip_prefix

MODEL_KEYS: tuple[str, ...] = ("state_dict", "model", "model_state_dict", "module", "net", "network", "weights")
TOP = "."  # a path's last part (and a key's): the tensors among that level's other entries


def prefix_of(path: tuple[str, ...]) -> str:
    """The prefix a path's last part selects (``"student."``), or ``""`` where it selects none.

    Example:
        >>> prefix_of(("model", "student.")), prefix_of((TOP,)), prefix_of(("model",))
        ('student.', '', '')
    """
    return path[-1] if path and path[-1] != TOP and path[-1].endswith(".") else ""


def tensors_at(node: Mapping[Any, Any], is_tensor: Callable[[Any], bool]) -> OrderedDict[str, Any]:
    """The tensor entries among ``node``'s entries (torchtitan's flattened weights).

    Example:
        >>> list(tensors_at({"layers.0.w": 1.0, "optimizer": {}}, lambda v: isinstance(v, float)))
        ['layers.0.w']
    """
    return OrderedDict((k, v) for k, v in node.items() if isinstance(k, str) and is_tensor(v))


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
            that prefix, which it removes: ``"student."``, ``"model/student."``; a last part
            ``.`` alone selects the tensors among that level's entries: ``"."`` the top level's.
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
    if key is not None and (key == TOP or key.endswith("/" + TOP)):
        base = key[: -len(TOP)].rstrip("/")
        node = _walk(obj, tuple(p for p in base.split("/") if p), source) if base else obj
        if not isinstance(node, Mapping) or not (flat := tensors_at(node, is_tensor)):
            raise LayoutError(f"{source}: no tensors among the entries at {base or 'the top level'}")
        return (*(p for p in base.split("/") if p), TOP), flat
    if key is not None and key.endswith("."):
        base, _, prefix = key.rpartition("/")
        path, state = find_model_state(obj, key=base or None, is_tensor=is_tensor, source=source, option=option)
        if not any(k.startswith(check_prefix(prefix)) for k in state):
            heads = list(dict.fromkeys(k.split(".")[0] + "." for k in state))
            raise LayoutError(f"{source}: no weight starts with {prefix!r} (they start with {summarize(heads)})")
        return (*path, prefix), select_prefix(state, prefix)
    if key is not None:
        path = tuple(p for p in key.split("/") if p)
        node = _walk(obj, path, source)
        if not is_state_dict(node, is_tensor):
            raise LayoutError(f"{source}: entry {key!r} is not a state dict (a mapping of names to tensors)")
        return path, node
    if is_state_dict(obj, is_tensor):
        return (), obj
    if isinstance(obj, Mapping):
        for name in MODEL_KEYS:
            if name in obj and is_state_dict(obj[name], is_tensor):
                return (name,), obj[name]
        # Module paths among other entries: the model's weights, flattened there (torchtitan). Before
        # the single-state-dict rule: torchtitan's train_state ({"step": tensor}) is one too.
        if (flat := tensors_at(obj, is_tensor)) and any("." in k for k in flat):
            return (TOP,), flat
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


def _walk(obj: Any, path: tuple[str, ...], source: str) -> Any:
    node = obj
    for depth, part in enumerate(path):
        if not isinstance(node, Mapping) or part not in node:
            where = "/".join(path[:depth]) or "the top level"
            have = list(node.keys()) if isinstance(node, Mapping) else []
            raise LayoutError(
                f"{source}: no entry {part!r} at {where} (entries: {summarize([str(k) for k in have]) or 'none'})"
            )
        node = node[part]
    return node


def replace_at(obj: Any, path: tuple[str, ...], value: Any, *, selected: Iterable[str] = ()) -> Any:
    """Return ``obj`` with the entry at ``path`` replaced by ``value`` (containers copied shallowly).
    A path ending in :data:`TOP` replaces the ``selected`` entries there by ``value``'s, in their place.

    Example:
        >>> replace_at({"a.w": 1, "opt": {}}, (TOP,), {"w": 2}, selected=["a.w"])
        {'w': 2, 'opt': {}}
    """
    if path == (TOP,):
        chosen, out, placed = set(selected), {}, False
        for k, v in obj.items():
            if k not in chosen:
                out[k] = v
            elif not placed:
                out.update(value)
                placed = True
        return out if placed else {**value, **out}
    if not path:
        return value
    copy = obj.copy() if hasattr(obj, "copy") else dict(obj)
    copy[path[0]] = replace_at(obj[path[0]], path[1:], value, selected=selected)
    return copy
