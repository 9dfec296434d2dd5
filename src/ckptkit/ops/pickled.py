"""A whole pickled module (``torch.save(model, path)``) loaded as its ``state_dict()``, nothing run.

:mod:`ckptkit.formats.torchzip.modulepickle` reads the pickle with every class an inert stand-in; here
torch's own loader drives that unpickler, so storages are mapped and moved as ``torch.load``
does them (``map_location``, ``mmap``) and the leaves are real tensors. Only torch's tensor
rebuilders and a few builtins are real: no module of the pickle is imported, no ``__setstate__``
runs (DDP's would need a process group).

Example:
    >>> load_pickled_module("model.pt", map_location="cpu").description  # doctest: +SKIP
    'DistributedDataParallel(ToyCNN)'
"""

from __future__ import annotations

import importlib
import os
import types
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import CkptkitError, UnsafeCheckpointError, spell
from ..formats.torchzip import modulepickle as mp
from ..formats.torchzip.container import TorchZip

if TYPE_CHECKING:  # _devices imports torch; this module is also reached from convert's torch-free path
    from ..distributed.devices import MapLocation


def _detached(key: str, value: Any) -> Any:
    import torch

    if not isinstance(value, torch.Tensor):
        raise mp.Unmodelled(f"{key} is a {type(value).__name__}, not a tensor")
    return value.detach()  # what state_dict() holds: no Parameter, no autograd history


class _TorchModuleUnpickler(mp.ModuleUnpickler):
    def real_global(self, module: str, name: str) -> Any:
        # Only the names torchpickle models reach here (tensor rebuilders, dtypes, OrderedDict...).
        return getattr(importlib.import_module(module), name)


def load_pickled_module(
    path: str, *, map_location: MapLocation = None, mmap: bool = True, trust: bool = False, allow: Iterable[str] = ()
) -> mp.PickledModule:
    """The ``state_dict()`` of the module pickled in torch zip ``path``, as real tensors.

    Raises:
        NotAModule: the pickle holds something else. UnsafeModulePickle: it calls or names
        globals outside the model walk (unless ``trust``, or named in ``allow``). Unmodelled:
        its state dict needs its own code. Anything ``torch.load`` raises on a damaged file.
    """
    import torch

    unpickler = type("Unpickler", (_TorchModuleUnpickler,), {"trust": trust, "allow": frozenset(allow)})
    inert = types.ModuleType("ckptkit_inert_pickle")  # torch.load takes a module with an Unpickler
    inert.Unpickler = unpickler  # type: ignore[attr-defined]
    root = torch.load(path, map_location=map_location, pickle_module=inert, weights_only=False, mmap=mmap)
    return mp.PickledModule(mp.state_dict(root, _detached), mp.describe(root))


def pickled_module_name(path: str | os.PathLike[str]) -> str:
    """The class of the whole module a torch zip pickles, e.g. ``DataParallel(ToyCNN)``; ``""``
    if it pickles something else, or a module whose state_dict() needs its own code."""
    try:
        with TorchZip(path) as z:
            return mp.read_module(z.read(f"{z.prefix}data.pkl"), trust=True).description
    except (mp.NotAModule, mp.Unmodelled, CkptkitError):
        return ""


def unmodelled_error(source: str, reason: str) -> UnsafeCheckpointError:
    """The refusal for a module pickle whose ``state_dict()`` needs the module's own code."""
    return UnsafeCheckpointError(
        f"{source}: holds a pickled module whose state_dict() ckptkit cannot compute without running its code "
        f"({reason}). If you trust this file, pass {spell('trust=True', '--trust')} to load it with torch and call state_dict()"
    )
