"""Where each key of a DCP folder goes in the nested state dict, checked as torch's reader checks it.

torch's reader (its ``_EmptyStateDictLoadPlanner``, which ``read_checkpoint`` loads with) places
each key of ``state_dict_metadata`` at its ``planner_data`` path with ``set_element``, flattens the
nested dict back (``flatten_state_dict``: names and list indices joined by dots, a list that holds
no tensor nor dict kept as one value) and requires each flattened key in the metadata ("Missing
key in checkpoint state_dict"). :func:`key_paths` asks the same without building anything, for
ckptkit's own parser and for the folders it hands to torch's reader.

Example:
    >>> key_paths({"model.w": True, "step": False}, {"model.w": ("model", "w"), "step": ("step",)})
    {'model.w': ('model', 'w'), 'step': ('step',)}
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ...errors import CheckpointFormatError, summarize
from . import DAMAGED

# torch's own save leaves a gap in a list for an empty dict in it, which its reader then cannot load
_GAP = (
    "torch's reader cannot load a list with gaps; torch's save leaves one for an empty dict in a list "
    "(save again without it), else the folder is damaged (restore it from a good copy)"
)


@dataclass(eq=False)
class _Node:
    """A container torch's reader builds in the nested state dict: a list where its keys are ints.
    ``children``: a name or index -> a container, or the key placed there."""

    path: tuple[str | int, ...]
    is_list: bool
    children: dict[str | int, _Node | str] = field(default_factory=dict)


def key_paths(kinds: Mapping[str, bool], planner_data: Any) -> dict[str, tuple[str | int, ...]]:
    """Each key's place in the nested state dict, checked to come back as itself.

    ``kinds``: each key of ``state_dict_metadata`` (in order) -> whether it is a tensor. torch's
    reader places each key at its ``planner_data`` path (at the top where it has none), then
    flattens that nested dict back (names and list indices joined by dots; a list holding no
    tensor nor dict is one value, not its items) and requires each flattened key in the metadata.
    A path that does not come back as its own key is damage (a renamed key, an edited path), and is
    refused here rather than read as something else, before any reader builds a list from it.

    Raises:
        CheckpointFormatError: naming the key whose path does not come back as itself.
    """
    if planner_data is None:
        planner_data = {}
    if not isinstance(planner_data, Mapping):
        raise CheckpointFormatError(
            f".metadata's planner_data is a {type(planner_data).__name__}, not a dict: {DAMAGED}"
        )
    root, paths = _Node((), False), {}
    for key in kinds:
        if type(key) is not str:
            raise CheckpointFormatError(
                f".metadata names an entry {key!r:.40}, not a str; torch's reader flattens it back to {str(key)!r:.40}: {DAMAGED}"
            )
        paths[key] = _place(root, key, planner_data[key] if key in planner_data else (key,), len(kinds))
    _check_lists(root, kinds)
    return paths


def _place(root: _Node, key: str, value: Any, entries: int) -> tuple[str | int, ...]:
    """Put ``key`` at path ``value`` under ``root``, as torch's ``set_element`` would (without
    building its lists: an index of 10**14 is one number here)."""
    said = f".metadata's planner_data puts key {key!r} at {value!r:.80}"
    if (
        not isinstance(value, (tuple, list))
        or not value
        or type(value[0]) is not str
        or not all(type(p) is str or type(p) is int for p in value)
    ):
        raise CheckpointFormatError(f"{said}, not a path of a name then names and list indices: {DAMAGED}")
    path = tuple(value)
    bad = [p for p in path if type(p) is int and not 0 <= p < entries]
    if bad:  # a list that long would have gaps; building it would take the memory first
        raise CheckpointFormatError(
            f".metadata's planner_data path {list(path)!r:.80} has list index {bad[0]}, "
            f"beyond the folder's {entries} entries: {_GAP}"
        )
    joined = ".".join(map(str, path))
    if joined != key:
        raise CheckpointFormatError(f"{said}, which torch's reader flattens back to key {joined!r:.80}: {DAMAGED}")
    node = root
    for depth, name in enumerate(path[:-1]):
        is_list = type(path[depth + 1]) is int
        child = node.children.setdefault(name, _Node(path[: depth + 1], is_list))
        if isinstance(child, str):
            raise CheckpointFormatError(f"{said}, inside the value of key {child!r}: {DAMAGED}")
        if child.is_list != is_list:
            holds = "list indices" if child.is_list else "names"
            raise CheckpointFormatError(f"{said}, where {_dotted(child.path)} holds {holds}: {DAMAGED}")
        node = child
    there = node.children.setdefault(path[-1], key)
    if there != key:
        what = f"key {there!r}" if isinstance(there, str) else f"the keys under {_dotted(there.path)}"
        raise CheckpointFormatError(f"{said}, where {what} already is: {DAMAGED}")
    return path


def _check_lists(root: _Node, kinds: Mapping[str, bool]) -> None:
    """Each list torch's reader would build is flattened back item by item: no gaps (a gap, None,
    comes back as a key the metadata lacks), and a tensor or dict in it (else it is one value)."""
    order, todo = [], [root]
    while todo:
        node = todo.pop()
        order.append(node)
        todo += [c for c in node.children.values() if isinstance(c, _Node)]
    walked: dict[int, bool] = {}  # id(node) -> torch's flattening goes into it
    for node in reversed(order):  # each container after those inside it
        if not node.is_list:
            walked[id(node)] = True
            continue
        gap = next((i for i in range(len(node.children)) if i not in node.children), None)
        if gap is not None:
            raise CheckpointFormatError(
                f".metadata's planner_data fills list {_dotted(node.path)} at {sorted(node.children)[:6]} "
                f"but not at {gap}, which torch's reader reads back as key {_dotted((*node.path, gap))!r}: {_GAP}"
            )
        walked[id(node)] = any(kinds[c] if isinstance(c, str) else walked[id(c)] for c in node.children.values())
        if not walked[id(node)]:
            keys = [c for c in node.children.values() if isinstance(c, str)]
            raise CheckpointFormatError(
                f".metadata's planner_data puts keys {summarize(keys, 3)} in list {_dotted(node.path)} of plain "
                f"values only, which torch's reader reads back as one key {_dotted(node.path)!r}: {DAMAGED}"
            )


def _dotted(path: tuple[str | int, ...]) -> str:
    return ".".join(map(str, path))
