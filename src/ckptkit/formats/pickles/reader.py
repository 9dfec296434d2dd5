"""torch's pickles read and written through inert stand-ins: no torch, nothing run.

torch writes ``data.pkl`` with protocol 2: containers are ordinary dicts/OrderedDicts/lists,
and each tensor is a call ``torch._utils._rebuild_tensor_v2(storage, offset, size, stride,
...)`` whose storage is a persistent id ``('storage', torch.FloatStorage, key, location,
numel)``. Unpickling with the pure-Python unpickler and a ``find_class`` that hands back
inert stand-ins for an allowlist of torch names (and refuses every other global) yields the
real containers with :class:`TensorRef` leaves. Renaming keys is then plain dict work, and
:func:`.torchdump.dumps` writes the result back as the same calls and persistent ids. Tensor payloads
are never touched: they stay in the zip records.

Anything outside the allowlist (numpy scalars, argparse.Namespace, code payloads) raises
:class:`UnsupportedGlobal`; callers fall back to torch's own weights-only loader, which
applies torch's rules and ckptkit's trust option.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, SupportsIndex

from ...errors import PICKLE_ERRORS, CheckpointFormatError
from ..dtypes import BY_NAME, BY_STORAGE
from .globals import PARAM_BUILDERS, REAL_GLOBALS, TENSOR_BUILDERS, allowed_global, python3_name


class UnsupportedGlobal(CheckpointFormatError):
    """The pickle names a global the torch-free reader does not model (use torch's loader)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"pickle needs global {name}")
        self.name = name


class UnsupportedOpcode(UnsupportedGlobal):
    """The pickle uses an opcode torch's weights-only unpickler refuses (``LIST``, ``DUP``, framing):
    ``torch.load`` reads it only with ``weights_only=False``, so the stand-ins do not either."""

    def __init__(self, opcode: str) -> None:
        CheckpointFormatError.__init__(
            self, f"pickle uses opcode {opcode}, which torch's weights-only loader refuses (it loads only if trusted)"
        )
        self.name = f"opcode {opcode}"


# The arguments torch's builders take (torch._utils): the weights-only unpickler calls them, so
# a call with more or fewer is refused there.
_ARITY = {
    "_rebuild_tensor_v2": (6, 7),
    "_rebuild_tensor_v3": (7, 8),
    "_rebuild_parameter": (3, 3),
    "_rebuild_parameter_with_state": (4, 4),
}


class Global:
    """Stands for a global such as ``torch.FloatStorage``; calling it records the call."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    @property
    def is_storage(self) -> bool:
        """A storage class (``torch.FloatStorage``, ``torch.QInt8Storage``, ``torch.storage.UntypedStorage``)."""
        return self.module in ("torch", "torch.storage") and self.name.endswith("Storage")

    def __call__(self, *args: Any) -> Any:
        if self.is_storage or (self.module == "torch" and self.name in BY_NAME):
            # torch's weights-only unpickler hands these back as markers it cannot call
            raise CheckpointFormatError(f"pickle calls {self!r}, which torch's weights-only loader cannot call")
        if self.module == "torch._utils" and self.name in _ARITY:
            low, high = _ARITY[self.name]
            if not low <= len(args) <= high:
                took = f"{low}" if low == high else f"{low} or {high}"
                raise CheckpointFormatError(f"{self!r} called with {len(args)} arguments; it takes {took}")
            _check_builder(self, args)
        if self.module == "torch._utils" and self.name in TENSOR_BUILDERS:
            return TensorRef(self, args)
        if self.module == "torch._utils" and self.name in PARAM_BUILDERS:
            return ParamRef(self, args)
        return Call(self, args)

    def __repr__(self) -> str:
        return f"{self.module}.{self.name}"


def _check_builder(func: Global, args: tuple[Any, ...]) -> None:
    """What torch's builders require of their arguments (torch._utils), beyond their number: an
    int offset, a bool requires_grad, which only a floating-point or complex tensor may set.

    An argument that is itself a recorded call (what a module pickle's walk makes of a global it
    does not run) is left to the safety check, which names that global: it is no damage."""
    modelled = (TensorRef, ParamRef)
    if any(
        isinstance(a, Global) or (isinstance(a, Call) and not isinstance(a, modelled) and a.func.name != "Size")
        for a in args[:5]
    ):
        return
    if func.name in PARAM_BUILDERS:
        data, requires_grad = args[0], args[1]
        dtype = data.dtype if isinstance(data, TensorRef) else None
    else:
        storage, offset, requires_grad = args[0], args[1], args[4]
        if type(offset) is not int:
            raise CheckpointFormatError(f"{func!r} called with storage offset {offset!r:.40}; torch needs an int")
        dtype = TensorRef(func, args).dtype if isinstance(storage, StorageRef) else None
    if type(requires_grad) is not bool:
        raise CheckpointFormatError(f"{func!r} called with requires_grad {requires_grad!r:.40}; torch needs a bool")
    if requires_grad and dtype is not None and not dtype.startswith(("float", "bfloat", "complex")):
        raise CheckpointFormatError(
            f"{func!r} sets requires_grad on a {dtype} tensor; torch allows it only for floating-point and complex ones"
        )


class Call:
    """A recorded call of an allowed global (``torch.Size((2, 3))``, ``torch.device('cpu')``)."""

    def __init__(self, func: Global, args: tuple[Any, ...]) -> None:
        self.func, self.args = func, args
        self.state: Any = None

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __setitem__(self, key: Any, value: Any) -> None:
        # A mapping built by a call (a filled collections.defaultdict): its items, recorded.
        self.__dict__.setdefault("items", {})[key] = value

    def __reduce_ex__(self, protocol: SupportsIndex) -> tuple[Any, ...]:
        return (self.func, tuple(self.args)) if self.state is None else (self.func, tuple(self.args), self.state)

    def __repr__(self) -> str:
        return f"{self.func!r}{self.args!r}"


@dataclass
class StorageRef:
    """A persistent id ``('storage', type, key, location, numel)``: tensor bytes in record ``data/<key>``."""

    pid: tuple[Any, ...]

    @property
    def key(self) -> str:
        return str(self.pid[2])

    @property
    def location(self) -> str:
        return str(self.pid[3])

    @property
    def numel(self) -> int:
        return int(self.pid[4])

    @property
    def type_name(self) -> str:
        return self.pid[1].name


class TensorRef(Call):
    """A tensor inside a torch pickle: where its bytes are, and its dtype, shape and stride."""

    def _arg(self, i: int) -> Any:
        if len(self.args) <= i:
            raise CheckpointFormatError(f"{self.func!r} called with {len(self.args)} arguments")
        return self.args[i]

    @property
    def storage(self) -> StorageRef:
        s = self._arg(0)
        if not isinstance(s, StorageRef):
            raise CheckpointFormatError("tensor without a storage")
        return s

    @property
    def offset(self) -> int:
        return int(self._arg(1))

    @property
    def shape(self) -> tuple[int, ...]:
        return _ints(self._arg(2), "size")

    @property
    def stride(self) -> tuple[int, ...]:
        return _ints(self._arg(3), "stride")

    @property
    def dtype(self) -> str:
        if self.func.name == "_rebuild_tensor_v3":
            d = self._arg(6)
            return d.name if isinstance(d, Global) else str(d)
        d = BY_STORAGE.get(self.storage.type_name)
        return d.name if d is not None else "unknown"

    @property
    def itemsize(self) -> int:
        d = BY_NAME.get(self.dtype)
        return d.itemsize if d is not None else 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize

    @property
    def device(self) -> str:
        return self.storage.location

    def is_contiguous(self) -> bool:
        if len(self.stride) == len(self.shape) and 0 in self.shape:
            return True  # as torch's is_contiguous: an empty tensor is, whatever its strides
        expected, acc = [], 1
        for d in reversed(self.shape):
            expected.append(acc)
            acc *= d
        if len(self.stride) != len(self.shape):
            return False
        return all(s == e for s, e, d in zip(self.stride, reversed(expected), self.shape, strict=True) if d != 1)

    def byte_range(self) -> tuple[int, int]:
        """``(start, length)`` of a contiguous tensor's bytes within its storage record."""
        return self.offset * self.itemsize, self.nbytes


class ParamRef(Call):
    """``nn.Parameter`` around a tensor: behaves as its tensor for layout and sizes."""

    @property
    def tensor(self) -> TensorRef:
        t = self.args[0] if self.args else None
        if not isinstance(t, TensorRef):
            raise CheckpointFormatError("parameter without a tensor")
        return t

    def __getattr__(self, name: str) -> Any:
        if name in ("func", "args", "state"):
            raise AttributeError(name)
        return getattr(self.tensor, name)


def _ints(value: Any, what: str) -> tuple[int, ...]:
    """A tensor's size or stride, as the tuple of ints torch requires."""
    if isinstance(value, Call) and value.func.name == "Size":
        value = value.args[0] if value.args else ()
    if not isinstance(value, (tuple, list)) or not all(type(d) is int for d in value):
        found = type(value).__name__ if not isinstance(value, (tuple, list)) else repr(value)[:60]
        raise CheckpointFormatError(f"tensor {what} must be a tuple of ints, found {found}")
    if any(d < 0 for d in value):  # torch cannot build it: "negative dimension", "negative stride"
        raise CheckpointFormatError(f"tensor {what} {list(value)!r:.60} has a negative entry")
    return tuple(value)


def tensor_of(value: Any) -> TensorRef | None:
    """The TensorRef behind a tensor or parameter stand-in, else None."""
    if isinstance(value, TensorRef):
        return value
    if isinstance(value, ParamRef):
        return value.tensor
    return None


def is_tensor(value: Any) -> bool:
    return isinstance(value, (TensorRef, ParamRef))


class _Unpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    def __init__(self, file: Any, on_storage: Callable[[StorageRef], None] | None = None) -> None:
        super().__init__(file)
        self._globals: dict[tuple[str, str], Global] = {}
        self._on_storage = on_storage
        self._memory = file if isinstance(file, io.BytesIO) else None

    def load(self) -> Any:
        """pickle's own loop; for a pickle in memory, reading from it directly: frames (protocol
        4+) only guide buffering, and the pure-Python unpickler's frame reader costs a call per
        opcode (a third of a DCP ``.metadata`` read). The C unpickler reads frames the same way."""
        if self._memory is None:
            return super().load()
        self.read, self.readline, self.readinto = self._memory.read, self._memory.readline, self._memory.readinto
        self.metastack: list[Any] = []
        self.stack: list[Any] = []
        self.append, self.proto = self.stack.append, 0
        read, dispatch = self.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError
                dispatch[key[0]](self)  # type: ignore[arg-type]
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def _frame(self) -> None:
        if self._memory is None:
            return pickle._Unpickler.load_frame(self)  # type: ignore[attr-defined,no-any-return]
        (size,) = struct.unpack("<Q", self.read(8))
        if size > len(self._memory.getbuffer()) - self._memory.tell():  # as C's: a frame's bytes must be there
            raise pickle.UnpicklingError("pickle data was truncated")
        return None

    # Protocol 5's BYTEARRAY8 allocates its claimed length before reading (bytearray(n)): a
    # flipped length bit asks for terabytes. torch writes protocol 2, so refuse those opcodes.
    def _refuse_buffers(self) -> None:
        raise CheckpointFormatError("pickle uses protocol-5 buffer opcodes, which torch checkpoints never contain")

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch.update(
        dict.fromkeys(
            (op[0] for op in (pickle.BYTEARRAY8, pickle.NEXT_BUFFER, pickle.READONLY_BUFFER)),
            _refuse_buffers,  # type: ignore[arg-type]  # typeshed types _Unpickler's handlers as Unpickler's
        )
    )
    dispatch[pickle.FRAME[0]] = _frame  # type: ignore[assignment]

    def find_class(self, module: str, name: str) -> Any:
        module, name = python3_name(module, name, self.proto)  # type: ignore[attr-defined]
        real = REAL_GLOBALS.get((module, name))
        if real is not None:
            return real
        if not allowed_global(module, name):
            raise UnsupportedGlobal(f"{module}.{name}")
        return self._globals.setdefault((module, name), Global(module, name))

    def persistent_load(self, pid: Any) -> Any:
        if not (
            isinstance(pid, tuple)
            and len(pid) >= 5
            and pid[0] == "storage"
            and isinstance(pid[1], Global)
            and pid[1].is_storage
        ):
            raise CheckpointFormatError(f"unexpected persistent id {pid!r:.80}")
        ref = StorageRef(pid)
        if self._on_storage is not None:
            self._on_storage(ref)
        return ref


def storage_nbytes(ref: StorageRef) -> int:
    """Bytes a storage declares: elements x element size (UntypedStorage counts bytes)."""
    if not isinstance(ref.pid[4], int) or ref.pid[4] < 0:
        raise CheckpointFormatError(f"storage {ref.key} declares {ref.pid[4]!r} elements")
    d = BY_STORAGE.get(ref.type_name)
    size = d.itemsize if d is not None else 1  # UntypedStorage counts bytes
    return ref.numel * size


# The opcodes torch's weights-only unpickler (torch._weights_only_unpickler.Unpickler.load) reads;
# it refuses every other one, so a plain torch pickle read here is refused for the same opcodes
# (tests/formats/test_pickles.py holds this list against torch's source).
WEIGHTS_ONLY_OPCODES = frozenset(
    {
        "APPEND", "APPENDS", "BINFLOAT", "BINGET", "BININT", "BININT1", "BININT2", "BINPERSID",
        "BINPUT", "BINUNICODE", "BUILD", "EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "EMPTY_TUPLE",
        "GLOBAL", "LONG1", "LONG_BINGET", "LONG_BINPUT", "MARK", "NEWFALSE", "NEWOBJ", "NEWTRUE",
        "NONE", "PROTO", "REDUCE", "SETITEM", "SETITEMS", "SHORT_BINSTRING", "STOP", "TUPLE",
        "TUPLE1", "TUPLE2", "TUPLE3",
    }
)  # fmt: skip
_OPCODE_NAMES = {op.code.encode("latin-1")[0]: op.name for op in pickletools.opcodes}


def _refusal(name: str) -> Callable[[Any], None]:
    def refuse(self: Any) -> None:
        raise UnsupportedOpcode(name)

    return refuse


class WeightsOnlyUnpickler(_Unpickler):
    """The stand-ins' reader for a pickle torch loads with ``weights_only=True`` (a torch zip's or a
    legacy file's): the opcodes torch's weights-only unpickler lacks are refused, as it refuses them."""

    dispatch = {
        code: handler
        if _OPCODE_NAMES.get(code) in WEIGHTS_ONLY_OPCODES or handler is _Unpickler._refuse_buffers
        else _refusal(_OPCODE_NAMES.get(code, "?"))
        for code, handler in _Unpickler.dispatch.items()
    }


def loads(
    data: bytes | BinaryIO,
    *,
    on_storage: Callable[[StorageRef], None] | None = None,
    unpickler: type[_Unpickler] | None = None,
) -> Any:
    """Unpickle a torch ``data.pkl`` into containers with stand-in leaves.

    ``on_storage`` sees every storage reference as it is read (to bound declared sizes);
    ``unpickler``: a subclass with other stand-ins (DCP's ``.metadata``), the same guards; by
    default, :class:`WeightsOnlyUnpickler`.

    Raises:
        UnsupportedGlobal: a global outside the allowlist, or an opcode torch's weights-only
            loader refuses (:class:`UnsupportedOpcode`); nothing was run.
        CheckpointFormatError: the bytes are not a well-formed torch pickle.
    """
    try:
        return (unpickler or WeightsOnlyUnpickler)(
            io.BytesIO(data) if isinstance(data, bytes) else data, on_storage
        ).load()
    except CheckpointFormatError:
        raise
    except PICKLE_ERRORS as e:
        raise CheckpointFormatError(f"malformed pickle: {type(e).__name__}: {e}") from e
