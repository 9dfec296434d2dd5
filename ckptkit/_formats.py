"""Recognise checkpoint formats and list the globals a pickle asks for, without running it.

``pickletools.genops`` only decodes opcodes; nothing is imported or called. A small stack
simulation follows strings through the memo so ``STACK_GLOBAL`` (protocol 4+, what torch
writes) is resolved as well as the older ``GLOBAL``/``INST`` opcodes.
"""

from __future__ import annotations

import difflib
import io
import os
import pickletools
import struct
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, cast

from ._errors import PARSE_ERRORS, CheckpointFormatError, CheckpointNotFoundError

ZIP, LEGACY, SAFETENSORS, DCP = "torch-zip", "torch-legacy", "safetensors", "dcp"
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # pickle of 0x1950a86a20f9469cfc6c
_STRING_OPS = frozenset(
    {"STRING", "BINSTRING", "SHORT_BINSTRING", "UNICODE", "BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8"}
)
_MARK = object()


class ClampedReader:
    """A read-only file view whose reads never ask for more than is left.

    ``file.read(n)`` allocates ``n`` bytes before reading, so a pickle length field flipped to
    2**40 would ask for a terabyte; every pickle read from a file goes through this instead.
    """

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._end = os.fstat(f.fileno()).st_size

    def _left(self, n: int | None) -> int:
        left = max(0, self._end - self._f.tell())
        return left if n is None or n < 0 else min(n, left)

    def read(self, n: int | None = -1) -> bytes:
        return self._f.read(self._left(n))

    def readline(self, limit: int | None = -1) -> bytes:
        return self._f.readline(self._left(limit))

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf)
        data = self.read(len(view))
        view[: len(data)] = data
        return len(data)

    def tell(self) -> int:
        return self._f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)


def check_exists(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a Path, or raise CheckpointNotFoundError naming close matches."""
    p = Path(path)
    if p.exists():
        return p
    near: list[str] = []
    if p.parent.is_dir():
        near = difflib.get_close_matches(p.name, [c.name for c in p.parent.iterdir()], n=3, cutoff=0.6)
    hint = f"; similar names there: {', '.join(near)}" if near else ""
    raise CheckpointNotFoundError(f"{p}: no such file{hint}", filename=str(p))


def detect_format(path: str | os.PathLike[str]) -> str:
    """Return ZIP, LEGACY, SAFETENSORS or DCP for ``path``; raise CheckpointFormatError otherwise."""
    p = check_exists(path)
    if p.is_dir():
        if (p / ".metadata").is_file():
            return DCP
        raise CheckpointFormatError(
            f"{p}: is a folder without a .metadata file, so not a torch.distributed.checkpoint; give a file"
        )
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(16)
    if size == 0:
        raise CheckpointFormatError(f"{p}: file is empty")
    if head.startswith(b"PK\x03\x04"):
        return ZIP
    if head.startswith(_LEGACY_MAGIC):
        return LEGACY
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n <= size:
            return SAFETENSORS
    raise CheckpointFormatError(
        f"{p}: not a checkpoint ckptkit knows (expected a torch zip or legacy file, safetensors, "
        f"or a torch.distributed.checkpoint folder; first bytes {head[:8].hex()})"
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
    try:
        for op, arg, _pos in pickletools.genops(stream):
            name = op.name
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
                value = f"{module}.{qual}"
                found.append(value)
            elif name == "STACK_GLOBAL":
                module, qual = (popped + [None, None])[:2]
                value = f"{module}.{qual}" if isinstance(module, str) and isinstance(qual, str) else "<dynamic>"
                found.append(value)
            stack.extend([value] * len(op.stack_after))
    except PARSE_ERRORS as e:
        raise CheckpointFormatError(f"malformed pickle: {type(e).__name__}: {e}") from e
    return found


def _pop(stack: list[Any], op: pickletools.OpcodeInfo) -> list[Any]:
    before = op.stack_before
    if pickletools.markobject in before:
        while stack and stack.pop() is not _MARK:
            pass
        count = before.index(pickletools.markobject)
    else:
        count = len(before)
    popped = [stack.pop() if stack else None for _ in range(count)]
    popped.reverse()
    return popped


def checkpoint_globals(path: str | os.PathLike[str]) -> list[str]:
    """The globals a torch checkpoint's pickle(s) need, de-duplicated, in first-use order."""
    fmt = detect_format(path)
    names: list[str] = []
    if fmt == ZIP:
        try:
            with zipfile.ZipFile(path) as zf:
                pkl = [n for n in zf.namelist() if n.endswith("data.pkl")]
                if not pkl:
                    raise CheckpointFormatError(f"{path}: zip archive has no data.pkl, so it is not a torch checkpoint")
                for n in pkl:
                    names += pickle_globals(zf.read(n))
        except PARSE_ERRORS as e:
            if isinstance(e, CheckpointFormatError):
                raise
            raise CheckpointFormatError(f"{path}: damaged zip archive ({type(e).__name__}: {e})") from e
    elif fmt == LEGACY:
        with open(path, "rb") as f:
            reader = ClampedReader(f)
            for _ in range(4):  # magic number, protocol version, sys info, the object itself
                names += pickle_globals(reader)  # type: ignore[arg-type]
    return list(dict.fromkeys(names))


def unsafe_globals(path: str | os.PathLike[str]) -> list[str]:
    """The globals in ``path`` that torch's weights-only unpickler would refuse."""
    return filter_unsafe(checkpoint_globals(path))


def filter_unsafe(names: list[str]) -> list[str]:
    """Keep the names torch's weights-only unpickler would refuse (its allowlist + safe_globals)."""
    import torch

    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed = set(_get_allowed_globals())
        fallback = False
    except ImportError:  # the private allowlist moved: only for this message, trust torch.*
        allowed, fallback = {"collections.OrderedDict"}, True
    for g in torch.serialization.get_safe_globals():
        obj = g[0] if isinstance(g, tuple) else g
        allowed.add(f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}")
    return [g for g in names if g not in allowed and not (fallback and g.startswith("torch."))]
