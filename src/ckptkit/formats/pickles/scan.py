"""The globals a pickle would import, listed without importing or running anything.

``pickletools.genops`` only decodes opcodes. A small stack simulation follows strings through
the memo so ``STACK_GLOBAL`` (protocol 4+) is resolved as well as the older ``GLOBAL``/``INST``
opcodes. Names come out as Python 3 resolves them: a protocol-2 pickle (what ``torch.save``
writes) spells ``builtins.set`` as ``__builtin__.set``, and the unpickler maps it back, so this
does too; otherwise a safe name would be reported as needing trust.

A ``numpy.dtype(code)`` call is listed with the ``numpy.dtypes`` class it builds, and numpy's
``RandomState`` constructor with the class it builds, which torch's weights-only unpickler must
allow too though the pickle never names them. This is a first guess: ``ckptkit.ops.safety.needed_globals``
confirms it by loading with torch's own weights-only unpickler.

Example:
    >>> import pickle
    >>> pickle_globals(pickle.dumps({1, 2}, protocol=2))
    ['builtins.set']
"""

from __future__ import annotations

import io
import os
import pickletools
import zipfile
from typing import Any, BinaryIO, cast

from ...errors import PARSE_ERRORS, CheckpointFormatError, CkptkitError, UnsupportedCheckpointError
from ...io.fileio import ClampedReader, open_regular
from ..detect import sniff
from ..dtypes import NUMPY_DTYPE_CLASSES
from ..torchzip.detect import LEGACY, TORCH_FILES, ZIP
from .globals import python3_name

_STRING_OPS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
)
_MARK = object()
# Builders whose result torch's unpickler must also admit (it BUILDs state into it), unnamed in the pickle.
_BUILDS = {"numpy.random._pickle.__randomstate_ctor": "numpy.random.mtrand.RandomState"}


def _python3_name(module: str, name: str, protocol: int) -> str:
    return ".".join(python3_name(module, name, protocol))  # what pickle.Unpickler(fix_imports=True) does


SHARDED_TENSOR = "torch.distributed._shard.sharded_tensor.api.ShardedTensor"


def sharded_tensor_error(data: bytes, source: str) -> UnsupportedCheckpointError | None:
    """Why a pickle of torch ShardedTensors (one rank's FSDP1 SHARDED or LOCAL state dict, as
    ``torch.save`` wrote it) cannot be read alone, and what to give instead; None for any other.

    Example:
        >>> sharded_tensor_error(b"\\x80\\x02}q\\x00.", "a.pt") is None
        True
    """
    try:
        found = pickle_globals(data)
    except CheckpointFormatError:
        return None
    if SHARDED_TENSOR not in found:
        return None
    others = sorted({g for g in found if g.startswith("torch.distributed.")} - {SHARDED_TENSOR})
    names = f"globals {SHARDED_TENSOR}" + (f" and {len(others)} more of torch.distributed" if others else "")
    if b"flat_param" in data:  # FSDP1's LOCAL_STATE_DICT: one flat parameter per FSDP unit
        return UnsupportedCheckpointError(
            f"{source}: one rank's FSDP LOCAL_STATE_DICT ({names}): this rank's slice of each flattened "
            "parameter (_flat_param), which needs its process group to load and is not weights on its own; give "
            "a FULL_STATE_DICT (FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT) on save), or the "
            "SHARDED_STATE_DICT saved with torch.distributed.checkpoint, which ckptkit reads whole"
        )
    return UnsupportedCheckpointError(
        f"{source}: one rank's FSDP SHARDED_STATE_DICT saved with torch.save ({names}): this rank's part of "
        "each weight, which needs its process group to load; save that state dict with "
        "torch.distributed.checkpoint.save instead (ckptkit reads the folder whole), or give a FULL_STATE_DICT"
    )


def pickle_globals(stream: BinaryIO | bytes) -> list[str]:
    """Every global (``module.qualname``) one pickle in ``stream`` would import, in order.

    Raises:
        CheckpointFormatError: the bytes are not a well-formed pickle.
    """
    if isinstance(stream, (bytes, bytearray)):
        stream = io.BytesIO(stream)
    stack: list[Any] = []
    memo: dict[int, Any] = {}
    found: list[str] = []
    protocol = 0
    try:
        for op, arg, _pos in pickletools.genops(stream):
            name = op.name
            if name == "PROTO":
                protocol = cast(int, arg)
                continue
            if name == "MARK":
                stack.append(_MARK)
                continue
            if name in ("PUT", "BINPUT", "LONG_BINPUT"):
                memo[cast(int, arg)] = stack[-1] if stack else None
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = stack[-1] if stack else None
                continue
            popped = _pop(stack, op)
            value: Any = None
            if name in _STRING_OPS:
                value = arg.decode("latin-1") if isinstance(arg, bytes) else arg
            elif name in ("GET", "BINGET", "LONG_BINGET"):
                value = memo.get(cast(int, arg))
            elif name in ("GLOBAL", "INST"):
                module, _, qual = str(arg).partition(" ")
                value = _python3_name(module, qual, protocol)
                found += [value, _BUILDS[value]] if value in _BUILDS else [value]
            elif name in ("TUPLE", "TUPLE1", "TUPLE2", "TUPLE3"):
                value = tuple(popped)
            elif name == "REDUCE" and popped and popped[0] == "numpy.dtype":
                args = popped[1] if len(popped) > 1 else None
                code = args[0] if isinstance(args, tuple) and args else None
                if isinstance(code, str) and code in NUMPY_DTYPE_CLASSES:
                    found.append(f"numpy.dtypes.{NUMPY_DTYPE_CLASSES[code]}")  # what numpy.dtype(code) builds
            elif name == "STACK_GLOBAL":
                module, qual = (popped + [None, None])[:2]
                ok = isinstance(module, str) and isinstance(qual, str)
                value = _python3_name(module, qual, protocol) if ok else "<dynamic>"
                found += [value, _BUILDS[value]] if value in _BUILDS else [value]
            stack.extend([value] * len(op.stack_after))
    except CkptkitError:
        raise  # the store's failure while a URL's object was read: not the pickle's damage
    except PARSE_ERRORS as e:
        raise CheckpointFormatError(f"malformed pickle: {type(e).__name__}: {e}") from e
    return found


def _pop(stack: list[Any], op: pickletools.OpcodeInfo) -> list[Any]:
    """The values ``op`` takes off the stack, in order: those below a mark, then those above it."""
    before = op.stack_before
    above: list[Any] = []
    if pickletools.markobject in before:
        while stack and (item := stack.pop()) is not _MARK:
            above.append(item)
        above.reverse()
        count = before.index(pickletools.markobject)
    else:
        count = len(before)
    popped = [stack.pop() if stack else None for _ in range(count)]
    popped.reverse()
    return popped + above


def checkpoint_globals(path: str | os.PathLike[str]) -> list[str]:
    """The globals a torch checkpoint's pickle(s) need, de-duplicated, in first-use order."""
    found = sniff(path, TORCH_FILES)
    fmt = found.name if found is not None else ""
    names: list[str] = []
    if fmt == ZIP:
        try:
            with open_regular(path) as f, zipfile.ZipFile(f) as zf:
                pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
                if not pkl:
                    raise CheckpointFormatError(f"{path}: zip archive has no data.pkl, so it is not a torch checkpoint")
                for n in pkl:
                    names += pickle_globals(zf.read(n))
        except PARSE_ERRORS as e:
            if isinstance(e, CkptkitError):  # its own judgement, or the store's failure (a URL's object)
                raise
            raise CheckpointFormatError(f"{path}: damaged zip archive ({type(e).__name__}: {e})") from e
    elif fmt == LEGACY:
        with open_regular(path) as f:
            reader = ClampedReader(f)
            for _ in range(4):  # magic number, protocol version, sys info, the object itself
                names += pickle_globals(reader)  # type: ignore[arg-type]
    return list(dict.fromkeys(names))
