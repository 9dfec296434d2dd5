"""A pickled module tree as inert records, and ``nn.Module.state_dict()``'s walk over it.

:mod:`.modulepickle` reads a module pickle with every class an :class:`Instance` that only
records its arguments and state; this module holds those records and what is computed from
them without running any of the module's code: whether a record is a module
(:func:`is_module`), what it was (:func:`describe`, ``DistributedDataParallel(ToyCNN)``), and its
``state_dict()`` (:func:`state_dict`: a module's parameters, then its persistent buffers, then
its children, ``None`` entries skipped).

Not modelled (:class:`Unmodelled`): non-empty state-dict hooks, quantized modules, and anything
in the tree that is not a pickled module; each needs code the pickle does not hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import CheckpointFormatError
from ..pickles import reader as tp

# Wrapper classes and the attribute holding the module they wrap (for the description only).
WRAPPERS = {"DistributedDataParallel": "module", "DataParallel": "module", "OptimizedModule": "_orig_mod"}
MAX_MODULE_VISITS = 200_000  # the largest models have a few thousand modules


class Unmodelled(Exception):
    """A module whose ``state_dict()`` needs its own code (the message says why)."""


class Unbounded(CheckpointFormatError):
    """The walk would not end: a child shared along so many paths that its keys grow as 2**depth."""


class Instance:
    """An object of a class that was never imported: the class's name, its arguments, its state."""

    def __init__(self, cls: tp.Global, args: tuple[Any, ...]) -> None:
        self.cls, self.args = cls, args
        self.state: Any = None

    @property
    def attrs(self) -> Mapping[str, Any]:
        """Its ``__dict__`` as pickled (a ``(dict, slots)`` pair's dict)."""
        state = self.state[0] if isinstance(self.state, tuple) and len(self.state) == 2 else self.state
        return state if isinstance(state, Mapping) else {}

    def __repr__(self) -> str:
        return f"<{self.cls!r} stand-in>"


def is_module(obj: Any) -> bool:
    """True for a record holding the three dicts every ``nn.Module.__dict__`` has.

    Args:
        obj: anything the unpickler built.

    Returns:
        Whether ``obj`` is an :class:`Instance` whose ``_parameters``, ``_buffers`` and
        ``_modules`` are mappings.
    """
    return isinstance(obj, Instance) and all(
        isinstance(obj.attrs.get(k), Mapping) for k in ("_parameters", "_buffers", "_modules")
    )


def describe(module: Instance) -> str:
    """``ToyCNN``, or ``DistributedDataParallel(ToyCNN)`` for a wrapper around one."""
    names: list[str] = []
    node: Any = module
    while isinstance(node, Instance) and is_module(node) and len(names) < 8:
        names.append(node.cls.name)
        inner = WRAPPERS.get(node.cls.name)
        node = node.attrs["_modules"].get(inner) if inner else None
    return "(".join(names) + ")" * (len(names) - 1)


def state_dict(root: Instance, leaf: Callable[[str, Any], Any]) -> OrderedDict[str, Any]:
    """``root.state_dict()`` computed from the pickled attributes; ``leaf(key, value)`` gives each tensor.

    Iterative, in ``nn.Module.state_dict()``'s order (a module's entries, then each child's in
    turn), so no nesting depth makes it fail where the pickle itself loaded.

    Raises:
        Unmodelled: state-dict hooks, or a child that is not a pickled module.
        CheckpointFormatError: a module that contains itself, or one reached along so many paths
            that the walk would not end (:data:`MAX_MODULE_VISITS`).
    """
    out: OrderedDict[str, Any] = OrderedDict()
    active: set[int] = set()  # the modules on the path from the root: a cycle comes back to one
    todo: list[tuple[Any, str | None]] = [(root, "")]  # (module, prefix), or (module, None): leaving it
    visits = 0
    while todo:
        module, prefix = todo.pop()
        if prefix is None:
            active.discard(id(module))
            continue
        visits += 1
        if visits > MAX_MODULE_VISITS:  # a child shared along many paths: 2**depth visits from a few kB
            raise Unbounded(
                f"its modules would be visited more than {MAX_MODULE_VISITS:,} times (a submodule shared along many paths)"
            )
        where = prefix.rstrip(".") or "the top-level module"
        if not is_module(module):
            raise Unmodelled(f"{where} is a {type(module).__name__}, not a pickled module")
        if id(module) in active:
            raise CheckpointFormatError(f"module {where} contains itself")
        active.add(id(module))
        attrs = module.attrs
        if ".quantized" in getattr(module.cls, "module", ""):  # packed weights, saved by its own _save_to_state_dict
            raise Unmodelled(f"{where} ({module.cls.name}) is a quantized module, whose state_dict() is its own code")
        for hooks in ("_state_dict_hooks", "_state_dict_pre_hooks"):
            if attrs.get(hooks):
                raise Unmodelled(
                    f"{where} ({module.cls.name}) has {len(attrs[hooks])} {hooks}, which state_dict() would run"
                )
        for name, value in attrs["_parameters"].items():
            if value is not None:
                out[prefix + name] = leaf(prefix + name, value)
        skip = attrs.get("_non_persistent_buffers_set") or ()
        for name, value in attrs["_buffers"].items():
            if value is not None and name not in skip:
                out[prefix + name] = leaf(prefix + name, value)
        todo.append((module, None))
        todo += [
            (child, f"{prefix}{name}.") for name, child in reversed(attrs["_modules"].items()) if child is not None
        ]
    return out
