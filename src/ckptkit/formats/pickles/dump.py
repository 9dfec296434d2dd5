"""torch's ``data.pkl`` written from ckptkit's stand-ins (:mod:`.torchpickle`), no torch.

The same calls and persistent ids torch writes (protocol 2): each tensor a
``torch._utils._rebuild_tensor_v2`` call on a storage persistent id, so ``torch.load`` reads
the result as if torch had written it.

Example:
    >>> data, keys = dumps({"w": new_tensor("0", "float32", (2,))})  # doctest: +SKIP
"""

from __future__ import annotations

import io
import math
import pickle
from collections import OrderedDict
from typing import Any

from ..dtypes import BY_NAME
from .reader import Global, StorageRef, TensorRef


class _Pickler(pickle._Pickler):  # type: ignore[name-defined,misc]
    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=2)
        self.storage_keys: dict[str, None] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            self.storage_keys[obj.key] = None
            return obj.pid
        return None

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, (Global, Built)):
            memo = self.memo.get(id(obj))  # type: ignore[attr-defined]  # pure-Python pickler internals
            if memo is not None:
                self.write(self.get(memo[0]))  # type: ignore[attr-defined]
                return
        if isinstance(obj, Global):
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode())  # type: ignore[attr-defined]
            self.memoize(obj)  # type: ignore[attr-defined]
            return
        if isinstance(obj, Built):  # as pickle saves a dataclass: cls.__new__(cls), then its state
            self.save(obj.cls)
            self.write(pickle.EMPTY_TUPLE + pickle.NEWOBJ)  # type: ignore[attr-defined]
            self.memoize(obj)  # type: ignore[attr-defined]
            if obj.state is not None:  # a dataclass without fields has none
                self.save(obj.state)
                self.write(pickle.BUILD)  # type: ignore[attr-defined]
            return
        super().save(obj, save_persistent_id)  # type: ignore[misc]


class Built:
    """An instance of the class ``cls`` stands for, pickled as pickle saves a dataclass
    (``NEWOBJ``, then ``BUILD`` with ``state``): DCP's metadata records, written without torch."""

    def __init__(self, cls: Global, state: Any) -> None:
        self.cls, self.state = cls, state


def dumps(obj: Any) -> tuple[bytes, list[str]]:
    """Pickle stand-in containers the way torch does (protocol 2: ``GLOBAL``, ``REDUCE``, ``BUILD``,
    which plain ``pickle.load`` also reads); also return the storage keys used."""
    buf = io.BytesIO()
    p = _Pickler(buf)
    p.dump(obj)
    return buf.getvalue(), list(p.storage_keys)


_GLOBALS: dict[tuple[str, str], Global] = {}


def global_(module: str, name: str) -> Global:
    """One stand-in a name, so a pickle written from new tensors memoizes each global once."""
    return _GLOBALS.setdefault((module, name), Global(module, name))


def new_tensor(key: str, dtype: str, shape: tuple[int, ...]) -> TensorRef:
    """A contiguous CPU tensor over all of storage ``key``, as ``torch.save`` pickles one.

    Example:
        >>> t = new_tensor("0", "bfloat16", (2, 3))
        >>> t.dtype, t.stride, t.storage.numel
        ('bfloat16', (3, 1), 6)
    """
    d = BY_NAME[dtype]
    numel = math.prod(shape)
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    hooks: OrderedDict[str, Any] = OrderedDict()
    if d.storage is not None:
        storage = StorageRef(("storage", global_("torch", d.storage), key, "cpu", numel))
        return TensorRef(global_("torch._utils", "_rebuild_tensor_v2"), (storage, 0, shape, stride, False, hooks))
    storage = StorageRef(("storage", global_("torch.storage", "UntypedStorage"), key, "cpu", numel * d.itemsize))
    return TensorRef(
        global_("torch._utils", "_rebuild_tensor_v3"),
        (storage, 0, shape, stride, False, hooks, global_("torch", d.name)),
    )
