"""``convert --trust --sanitize``: an old checkpoint's object tree made loadable by
``torch.load(weights_only=True)``, torch's default since 2.6.

Training scripts used to pickle whatever they had: ``argparse.Namespace`` arguments (fairseq),
dataclass configs, numpy arrays and scalars, numpy's RNG state (e3nn, LlamaFactory). A
weights-only load refuses each of them. :func:`sanitize` rebuilds the tree (loaded with
``trust``) from plain values a weights-only load reads, and says what it changed, key path by key
path; tensors are the same objects, so their bytes are written as they were. Anything else it
cannot read stays an error naming where it is and its class: sanitizing never drops data silently.

Example:
    >>> import argparse
    >>> sanitize({"args": argparse.Namespace(lr=0.1)}, source="old.pt")
    ({'args': {'lr': 0.1}}, ['args: argparse.Namespace -> dict'])
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Callable
from pathlib import PurePath
from typing import Any

import numpy as np
import torch

from ..errors import UnsupportedCheckpointError, spell

_get_allowed_globals: Callable[[], dict[str, Any]]  # torch's is an lru_cache wrapper, the fallback a function
try:  # torch's own allowlist: private, in every torch ckptkit supports; without it only the caller's are known
    from torch._weights_only_unpickler import _get_allowed_globals
except ImportError:  # pragma: no cover

    def _get_allowed_globals() -> dict[str, Any]:
        return {}


# torch objects a weights-only load builds besides tensors (by torch's own allowlist, see _allowed)
_TORCH_PLAIN = (torch.Size, torch.dtype, torch.device, torch.memory_format, torch.layout)
_PLAIN = (type(None), bool, int, float, complex, str, bytes, bytearray)
_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set)  # exact types: a subclass pickles by its own name


class SanitizeError(UnsupportedCheckpointError):
    """A value a weights-only load cannot read, and that ``sanitize`` has no plain form for."""


def sanitize(obj: Any, *, source: str) -> tuple[Any, list[str]]:
    """``obj`` with every value a weights-only load refuses turned into plain values; returns it
    and the changes, one ``"key/path: what -> what"`` each.

    Namespaces and dataclass instances become dicts; numpy arrays tensors (strings and objects:
    lists); numpy scalars Python values; numpy RNG state (``get_state()``'s tuple, a bit
    generator's ``state`` dict, a ``RandomState`` or ``Generator`` itself) its state as lists, ints
    and strings; a ``defaultdict`` a dict, a ``frozenset`` a set, a path a string. Containers with
    nothing to change are kept as they are (a state dict's ``_metadata`` too).

    Raises:
        SanitizeError: another class a weights-only load refuses, naming its key path and class.

    Example:
        >>> import numpy as np
        >>> sanitize({"epoch": np.int64(3)}, source="old.pt")
        ({'epoch': 3}, ['epoch: numpy.int64 -> int'])
    """
    walk = _Walk(source)
    return walk.value(obj, ""), walk.changes


class _Walk:
    def __init__(self, source: str) -> None:
        self.source = source
        self.changes: list[str] = []
        self.done: dict[int, Any] = {}  # id of a converted object -> its plain form (shared stays shared)
        self.keep: list[Any] = []  # the converted originals, alive while their ids are keys above

    def note(self, path: str, what: str, into: str) -> None:
        self.changes.append(f"{path or '(top level)'}: {what} -> {into}")

    def value(self, v: Any, path: str) -> Any:
        if isinstance(v, torch.Tensor) or type(v) in _PLAIN or isinstance(v, _TORCH_PLAIN):
            return v  # tensors as they are: their bytes are written unchanged
        if id(v) in self.done:
            return self.done[id(v)]
        new = self._converted(v, path)
        if new is not v:
            self.done[id(v)] = new
            self.keep.append(v)
        return new

    def _converted(self, v: Any, path: str) -> Any:
        if type(v) in _CONTAINERS:
            return self._container(v, path)
        if isinstance(v, np.generic):  # before str and float: np.str_ and np.float64 subclass them
            plain = v.item()
            self.note(path, f"numpy.{type(v).__name__}", type(plain).__name__)
            return self.value(plain, path)
        if isinstance(v, np.ndarray):
            return self._array(v, path)
        if isinstance(v, np.dtype):
            self.note(path, "numpy.dtype", "str")
            return str(v)
        if isinstance(v, np.random.RandomState):
            self.note(
                path, "numpy.random.RandomState", "its get_state() as plain values (np.random.set_state takes them)"
            )
            return _plain_rng(v.get_state())
        if isinstance(v, np.random.Generator):
            state = v.bit_generator.state
            self.note(
                path, "numpy.random.Generator", f"its bit_generator.state ({state['bit_generator']}) as plain values"
            )
            return _plain_rng(state)
        if isinstance(v, argparse.Namespace):
            return self._as_dict(v, vars(v), path, "argparse.Namespace")
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            fields = {f.name: getattr(v, f.name) for f in dataclasses.fields(v)}  # not asdict(): it deep-copies tensors
            return self._as_dict(v, fields, path, f"{_name(type(v))} (a dataclass)")
        if isinstance(v, defaultdict):
            return self._as_dict(v, v, path, "collections.defaultdict", into="dict (its default factory dropped)")
        if isinstance(v, frozenset):
            self.note(path, "frozenset", "set")
            return {self.value(x, f"{path}/{i}") for i, x in enumerate(v)}
        if isinstance(v, PurePath):
            self.note(path, _name(type(v)), "str")
            return str(v)
        if _allowed(v):
            return v
        raise self._refuse(v, path)

    def _container(self, v: Any, path: str) -> Any:
        if type(v) is tuple and _is_legacy_rng(v):
            self.note(
                path,
                "numpy RNG state (np.random.get_state()'s MT19937 tuple)",
                "plain values (np.random.set_state takes them)",
            )
            return _plain_rng(v)
        if isinstance(v, dict):
            if _is_bit_generator_state(v):
                self.note(
                    path,
                    f"numpy RNG state ({v['bit_generator']} bit_generator.state)",
                    "plain values (arrays as lists)",
                )
                return _plain_rng(v)
            items = [(self.value(k, f"{path}/[key {k!r}]"), self.value(x, _join(path, k))) for k, x in v.items()]
            if all(a is k and b is x for (a, b), (k, x) in zip(items, v.items(), strict=True)):
                return v
            new = type(v)()
            for a, b in items:  # not type(v)(items): a Counter would count the pairs
                new[a] = b
            if hasattr(v, "__dict__"):  # a state dict's _metadata (torch's versions)
                new.__dict__.update(v.__dict__)
            return new
        values = [self.value(x, _join(path, i)) for i, x in enumerate(v)]
        if all(a is b for a, b in zip(values, v, strict=True)):
            return v
        return set(values) if isinstance(v, set) else type(v)(values)

    def _as_dict(self, v: Any, fields: Any, path: str, what: str, *, into: str = "dict") -> dict[Any, Any]:
        self.note(path, what, into)
        new: dict[Any, Any] = {}
        self.done[id(v)] = new  # before its values: one that holds itself stays one dict
        self.keep.append(v)
        for k, x in fields.items():
            new[self.value(k, f"{path}/[key {k!r}]")] = self.value(x, _join(path, k))
        return new

    def _array(self, v: np.ndarray, path: str) -> Any:
        kind = f"numpy.ndarray {v.dtype} {tuple(v.shape)}"
        if v.dtype.kind in "biufc" and v.dtype.itemsize > 0:
            try:  # native byte order, contiguous, its own memory: what torch.from_numpy takes
                t = torch.from_numpy(np.array(v, dtype=v.dtype.newbyteorder("="), order="C", copy=True))
            except TypeError:  # a dtype torch has no tensor for (float128, uint64 on an old torch)
                pass
            else:
                self.note(path, kind, f"tensor {str(t.dtype).removeprefix('torch.')}")
                return t
        self.note(path, kind, "list")
        return self.value(v.tolist(), path)

    def _refuse(self, v: Any, path: str) -> SanitizeError:
        cls = _name(type(v))
        return SanitizeError(
            f"{self.source}: {path or 'the top level'} is a {cls}, which torch.load(weights_only=True) cannot read "
            f"and {spell('sanitize=True', '--sanitize')} has no plain form for; convert it to plain values (a dict of numbers, strings, "
            f"lists, tensors) where it is made and save again, or write the weights alone with "
            f"{spell('model_only=True', '--model-only')}, or keep it and load the output with "
            f"torch.serialization.add_safe_globals([{cls}])"
        )


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _allowed(v: Any) -> bool:
    """Whether a weights-only load builds ``v``'s class: torch's allowlist, and what the caller added."""
    cls = type(v)
    return _name(cls) in _get_allowed_globals() or cls in torch.serialization.get_safe_globals()


def _is_legacy_rng(v: tuple[Any, ...]) -> bool:
    return len(v) == 5 and v[0] == "MT19937" and isinstance(v[1], np.ndarray) and v[1].dtype == np.uint32


def _is_bit_generator_state(v: dict[Any, Any]) -> bool:
    return isinstance(v.get("bit_generator"), str) and isinstance(v.get("state"), dict)


def _plain_rng(v: Any) -> Any:
    """numpy RNG state as lists, ints, floats and strings (each value exact: uint32/uint64 as int)."""
    if isinstance(v, np.ndarray):
        return v.tolist()
    if isinstance(v, np.generic):
        return v.item()
    if isinstance(v, dict):
        return {k: _plain_rng(x) for k, x in v.items()}
    if isinstance(v, (tuple, list)):
        return type(v)(_plain_rng(x) for x in v)
    return v
