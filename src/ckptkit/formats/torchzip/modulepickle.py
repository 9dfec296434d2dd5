"""Whole pickled modules (``torch.save(model, path)``) read as their ``state_dict()``, nothing run.

A module pickle builds each module with ``NEWOBJ`` (or ``copyreg._reconstructor`` in protocols
0-1) of its class, then ``BUILD`` with its ``__dict__``: ``_parameters``, ``_buffers``,
``_non_persistent_buffers_set``, ``_modules``, empty hook dicts, ``training``... Here every class
is an inert :class:`Instance` that only records that state (its module is never imported, so a
deleted class reads as well as ``torch.nn.Linear``), and the walk of ``nn.Module.state_dict()``
runs over those records: a module's parameters, then its persistent buffers, then its children,
``None`` entries skipped (those records and that walk are :mod:`.moduletree`; the unpickler
that builds them is here). Wrappers need nothing special: DDP and DataParallel hold the model in
``_modules["module"]``, torch.compile's ``OptimizedModule`` in ``_modules["_orig_mod"]``, so the
keys come out as their ``state_dict()`` names them. DDP's ``__setstate__`` (which needs a
process group) is never called.

What a module pickle may call (``REDUCE``) is closed: torch's tensor and parameter rebuilders
(also as ``_rebuild_from_type_v2`` of a plain ``torch.Tensor`` with attributes, as a buffer is
once torch.compile has run), ``OrderedDict``, ``set``, ``torch.device``...
(:func:`.pickleglobals.allowed_global`), the torch.compile wrapper and its context
(:data:`BUILT_BY_CALL`), ``getattr`` of a stand-in (a bound method in that context). Any other
call, or a global used as a value rather than as a class to build (a hook function,
``os.system`` stored away; torch's own names excepted, as an activation function kept as an
attribute), is listed by :class:`UnsafeModulePickle` unless the caller trusts the file. Nothing
is run either way; the refusal says what the pickle would run under ``torch.load``.

Not modelled (:class:`Unmodelled`): non-empty state-dict hooks, and a class that overrides
``get_extra_state`` (its ``_extra_state`` entry is made by code the pickle does not hold).
``state_dict()._metadata`` (each class's ``_version``) is not in the pickle either.
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import PICKLE_ERRORS, CheckpointFormatError
from ..pickles import globals as pg
from ..pickles import reader as tp
from .moduletree import Instance, Unmodelled, describe, is_module, state_dict
from .moduletree import Unbounded as Unbounded  # re-exported: callers catch mp.Unbounded

# Classes whose __reduce__ calls them with arguments: torch.compile's wrapper (pickled as
# OptimizedModule(mod, dynamo_ctx), no state) and its dynamo context.
_COMPILED = "torch._dynamo.eval_frame.OptimizedModule"
BUILT_BY_CALL = frozenset({_COMPILED, "torch._dynamo.eval_frame.OptimizeContext"})
# Globals that context holds as values (its backend's context-manager factory).
HARMLESS_VALUES = frozenset({"contextlib.nullcontext"})
_RECONSTRUCTOR, _OBJECT, _GETATTR = "copyreg._reconstructor", "builtins.object", "builtins.getattr"
# torch.Tensor.__reduce_ex__ of a tensor with a __dict__: _rebuild_from_type_v2(builder, torch.Tensor, args, attributes)
_FROM_TYPE, _TENSOR = "torch._tensor._rebuild_from_type_v2", "torch.Tensor"


class NotAModule(Exception):
    """The pickle's top-level object is not a module: read it as any other checkpoint."""


class UnsafeModulePickle(Exception):
    """A module pickle that calls, or names as values, globals outside the inert model walk."""

    def __init__(self, names: list[str], description: str) -> None:
        super().__init__(f"pickled {description} module needs {', '.join(names)}")
        self.names, self.description = names, description


@dataclass
class PickledModule:
    """A pickled module's ``state_dict()`` and what it was, e.g. ``DistributedDataParallel(ToyCNN)``."""

    state: OrderedDict[str, Any]
    description: str


class ModuleUnpickler(tp._Unpickler):
    """torch's stand-in unpickler with every other class an :class:`Instance`.

    Subclasses set ``trust`` (refuse nothing) and ``allow`` (names not to refuse); torch's loader
    constructs it with ``encoding=`` and sets ``persistent_load`` itself, and a subclass's
    :meth:`real_global` then hands back torch's own rebuilders, so the leaves are real tensors.
    """

    trust = False
    allow: frozenset[str] = frozenset()
    stack: list[Any]  # the pure-Python unpickler's own
    proto: int

    def __init__(self, file: Any, *, on_storage: Callable[[tp.StorageRef], None] | None = None, **_: Any) -> None:
        super().__init__(file, on_storage)
        self._names: dict[int, str] = {}  # id of each global handed out -> its name
        self._stand_ins: dict[str, tp.Global] = {}
        self._used: set[str] = set()  # stand-ins used as classes to build, or as allowed calls
        self._refused: list[str] = []

    def real_global(self, module: str, name: str) -> Any:
        return super().find_class(module, name)

    def find_class(self, module: str, name: str) -> Any:
        module, name = pg.python3_name(module, name, self.proto)
        full = f"{module}.{name}"
        if (module, name) in pg.REAL_GLOBALS or pg.allowed_global(module, name):
            obj = self.real_global(module, name)
        else:
            obj = self._stand_ins.setdefault(full, tp.Global(module, name))
        self._names[id(obj)] = full
        return obj

    def _build_instance(self, cls: Any, args: tuple[Any, ...]) -> Instance:
        name = self._names.get(id(cls), "")
        if name not in self._stand_ins:
            raise CheckpointFormatError(f"pickle builds an object of {name or type(cls).__name__} with NEWOBJ")
        self._used.add(name)
        return Instance(cls, args)

    def _call(self, func: Any, args: tuple[Any, ...]) -> Any:
        name = self._names.get(id(func))
        if name is None:  # calling an object the pickle built: a method call, code by definition
            self._refused.append(f"a call of {type(func).__name__} {func!r:.60}")
            return tp.Call(tp.Global("?", "?"), args)
        if name not in self._stand_ins:
            if not isinstance(func, tp.Global) and any(isinstance(a, (tp.Call, tp.Global, Instance)) for a in args):
                return tp.Call(tp.Global(*name.rsplit(".", 1)), args)  # a real builder is never handed a stand-in
            return func(*args)  # torch's rebuilders, OrderedDict, set, torch.device: real or stand-in
        if name == _RECONSTRUCTOR and len(args) == 3 and self._names.get(id(args[1])) == _OBJECT:
            self._used.update((name, _OBJECT))
            return self._build_instance(args[0], ())
        if name in BUILT_BY_CALL:
            self._used.add(name)
            inst = Instance(func, args)
            if name == _COMPILED and args:  # OptimizedModule(mod, ctx).__init__ registers mod as _orig_mod
                inst.state = {"_parameters": {}, "_buffers": {}, "_modules": {"_orig_mod": args[0]}}
            return inst
        if (
            name == _FROM_TYPE
            and len(args) == 4
            and self._names.get(id(args[1])) == _TENSOR
            and isinstance(args[2], tuple)
        ):
            # A plain tensor with Python attributes: a buffer torch.compile has run on carries
            # _dynamo_static_input_type. state_dict() detaches it, attributes dropped; so here.
            self._used.update((name, _TENSOR))
            return self._call(args[0], args[2])
        if name == _GETATTR and len(args) == 2 and isinstance(args[0], Instance) and isinstance(args[1], str):
            self._used.add(name)
            return tp.Call(func, args)
        self._refused.append(name)
        return tp.Call(func, args)

    def _load_newobj(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._build_instance(self.stack[-1], tuple(args))

    def _load_newobj_ex(self) -> None:
        self.stack.pop()  # keyword arguments: recorded nowhere, as a stand-in's __new__ takes none
        args = self.stack.pop()
        self.stack[-1] = self._build_instance(self.stack[-1], tuple(args))

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        self.stack[-1] = self._call(self.stack[-1], tuple(args))

    def _load_build(self) -> None:
        inst = self.stack[-2]
        if isinstance(inst, Instance):
            inst.state = self.stack.pop()
            return
        if not isinstance(inst, (tp.Call, Mapping)) or id(inst) in self._names:
            raise CheckpointFormatError(f"pickle sets the state of a {type(inst).__name__}")
        pickle._Unpickler.load_build(self)  # type: ignore[attr-defined]  # a recorded call, or an OrderedDict's attributes (a state dict's _metadata)

    dispatch: ClassVar[dict[int, Any]] = dict(tp._Unpickler.dispatch)
    dispatch.update(
        {b"\x81"[0]: _load_newobj, b"\x92"[0]: _load_newobj_ex, b"R"[0]: _load_reduce, b"b"[0]: _load_build}
    )

    def load(self) -> Any:
        root = super().load()
        if not is_module(root):
            raise NotAModule(f"the pickle holds a {getattr(getattr(root, 'cls', None), 'name', type(root).__name__)}")
        # A global kept as a value is imported by torch.load, never called: torch's own names
        # (an activation function as an attribute) are torch's code; any other is refused.
        unused = [
            n
            for n in self._stand_ins
            if n not in self._used and n not in HARMLESS_VALUES and not n.startswith("torch.")
        ]
        unsafe = [n for n in dict.fromkeys(self._refused + unused) if n not in self.allow]
        if unsafe and not self.trust:
            raise UnsafeModulePickle(unsafe, describe(root))
        return root


def _tensor_ref(key: str, value: Any) -> tp.TensorRef:
    t = tp.tensor_of(value)  # state_dict() detaches: a parameter's entry is its plain tensor
    if t is None:
        raise Unmodelled(f"{key} is a {type(value).__name__}, not a tensor")
    return t


def read_module(
    data: bytes,
    *,
    trust: bool = False,
    allow: Iterable[str] = (),
    on_storage: Callable[[tp.StorageRef], None] | None = None,
) -> PickledModule:
    """A pickled module's ``state_dict()`` as :class:`~torchpickle.TensorRef` leaves, without torch.

    Example:
        >>> read_module(pickle.dumps({"w": 1}, protocol=2))
        Traceback (most recent call last):
        ...
        ckptkit.formats.torchzip.modulepickle.NotAModule: the pickle holds a dict

    Raises:
        NotAModule, UnsafeModulePickle (unless ``trust``; ``allow``: names admitted), Unmodelled,
        CheckpointFormatError: the bytes are not a well-formed pickle.
    """
    unpickler = ModuleUnpickler(io.BytesIO(data), on_storage=on_storage)
    unpickler.trust, unpickler.allow = trust, frozenset(allow)
    try:
        root = unpickler.load()
        return PickledModule(state_dict(root, _tensor_ref), describe(root))
    except CheckpointFormatError:
        raise
    except PICKLE_ERRORS as e:  # RecursionError included: a hostile nesting depth
        raise CheckpointFormatError(f"malformed pickle: {type(e).__name__}: {e}") from e
