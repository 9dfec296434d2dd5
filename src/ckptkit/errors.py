"""The exceptions ckptkit raises on purpose.

Every error derives from :class:`CkptkitError` and also from the built-in a caller would
catch without knowing ckptkit (``FileNotFoundError``, ``ValueError``, ``KeyError``,
``OSError``, ``RuntimeError``). Messages name the file or key, what was expected, what was
found, and the fix. This module imports nothing heavy: the CLI uses it before torch loads.

Example:
    >>> from ckptkit.errors import CheckpointNotFoundError, CkptkitError
    >>> issubclass(CheckpointNotFoundError, FileNotFoundError) and issubclass(CheckpointNotFoundError, CkptkitError)
    True
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
import struct
import zipfile
import zlib
from collections.abc import Iterator, Sequence

__all__ = [
    "ArgumentError",
    "CheckpointFormatError",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "CkptkitError",
    "ClassNotFoundError",
    "DistributedError",
    "LayoutError",
    "PartialCheckpointError",
    "ResumeError",
    "StateDictMismatchError",
    "StorageError",
    "UnsafeCheckpointError",
    "UnsupportedCheckpointError",
    "cli_spelling",
    "spell",
]


# The fix for a map_location naming CUDA where there is none (torch's reader and ckptkit's check say it).
NO_CUDA_FIX = 'pass map_location="cpu", or leave it out to load onto this rank\'s device'


class CkptkitError(Exception):
    """Base class of every error ckptkit raises on purpose."""

    def __str__(self) -> str:
        # KeyError's own __str__ wraps the message in quotes; ours read as sentences.
        return str(self.args[0]) if self.args else ""


class ArgumentError(CkptkitError, ValueError):
    """A caller passed an argument ckptkit cannot act on."""


class CheckpointNotFoundError(CkptkitError, FileNotFoundError):
    """The checkpoint path does not exist (or is not the kind of path expected)."""

    def __init__(self, message: str, filename: str | None = None) -> None:
        super().__init__(message)
        self.filename = filename


class CheckpointFormatError(CkptkitError, ValueError):
    """The file is not a checkpoint ckptkit can read, or it is damaged (the message says which)."""


class UnsupportedCheckpointError(CheckpointFormatError):
    """An intact file of a kind ckptkit does not read (a TorchScript or torch.export archive)."""


class PartialCheckpointError(CheckpointFormatError):
    """The path is one part of a checkpoint that is only whole as a folder (a DeepSpeed ZeRO-3
    rank's model-state file, whose parameters are 0-element placeholders), or a folder that would
    read as part of its weights (a sentence-transformers model with weights in several module
    folders); the message names what to give instead."""


class ClassNotFoundError(CkptkitError, ImportError):
    """A class or factory cannot be imported here: one a trusted pickle names, or a ``--model``."""


class UnsafeCheckpointError(CkptkitError, ValueError):
    """Loading the file would unpickle globals outside the weights-only allowlist.

    Attributes:
        globals: the fully qualified names the file asks for, e.g. ``argparse.Namespace``.
    """

    def __init__(self, message: str, globals_: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.globals = tuple(globals_)


class LayoutError(CkptkitError, KeyError):
    """The model weights could not be found inside the checkpoint."""


class StateDictMismatchError(CkptkitError, KeyError):
    """A state dict does not fit its target model.

    Attributes:
        missing: target keys the checkpoint lacks.
        unexpected: checkpoint keys the target lacks.
        mismatched: ``(key, checkpoint_shape, target_shape)`` for keys present on both sides.
    """

    def __init__(
        self,
        message: str,
        *,
        missing: Sequence[str] = (),
        unexpected: Sequence[str] = (),
        mismatched: Sequence[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    ) -> None:
        super().__init__(message)
        self.missing = list(missing)
        self.unexpected = list(unexpected)
        self.mismatched = list(mismatched)


class CheckpointWriteError(CkptkitError, OSError):
    """Writing a checkpoint failed; the previous file at the path is untouched."""


class StorageError(CkptkitError, OSError):
    """An object store (an ``s3://`` or other fsspec URL) failed a request, or an object changed
    while it was read; the message names the URL and what to check."""


class DistributedError(CkptkitError, RuntimeError):
    """A collective across ranks failed or timed out (a peer died, hung, or skipped a call)."""


class ResumeError(CkptkitError, ValueError):
    """A training checkpoint cannot restore the objects it was given."""


# What third-party parsers (zipfile, pickle, struct, json, torch's loaders) raise on damaged or
# hostile bytes. Parser boundaries turn exactly these into CheckpointFormatError. MemoryError is
# deliberately absent: with bounded reads it would mean a bug here, not a bad file.
PARSE_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    EOFError,
    IndexError,
    KeyError,
    TypeError,
    AttributeError,
    OverflowError,
    NotImplementedError,
    RuntimeError,
    RecursionError,
    struct.error,
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    OSError,
    AssertionError,  # torch's legacy loader asserts on file content
)


PICKLE_ERRORS: tuple[type[BaseException], ...] = (pickle.UnpicklingError, *PARSE_ERRORS)


_CLI_SPELLING: contextvars.ContextVar[bool] = contextvars.ContextVar("ckptkit_cli_spelling", default=False)


def spell(keyword: str, flag: str) -> str:
    """An option as the caller spells it: ``flag`` under the command line, else ``keyword``.

    Example:
        >>> spell("trust=True", "--trust")
        'trust=True'
        >>> with cli_spelling():
        ...     spell("trust=True", "--trust")
        '--trust'
    """
    return flag if _CLI_SPELLING.get() else keyword


@contextlib.contextmanager
def cli_spelling() -> Iterator[None]:
    """Within this block, error messages name command-line flags instead of keywords."""
    token = _CLI_SPELLING.set(True)
    try:
        yield
    finally:
        _CLI_SPELLING.reset(token)


def cause(e: BaseException, *, typed: bool = True) -> str:
    """Why ``e`` happened, in one line: ``Type: first line of its message`` (``typed=False``: the
    line alone, or the type where the message is empty). torch's weights-only errors give the
    reason after their boilerplate; quoted file content never brings a line break with it.

    Example:
        >>> cause(ValueError("bad header\\n  at byte 8"))
        'ValueError: bad header'
        >>> cause(RuntimeError("Weights only load failed. WeightsUnpickler error: \\n\\nbad opcode"), typed=False)
        'bad opcode'
    """
    text = str(e)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    text = text.split("Check the documentation of torch.load", 1)[0]
    line = next((s.strip() for s in text.splitlines() if s.strip()), "")
    if not line:
        return type(e).__name__
    return f"{type(e).__name__}: {line}" if typed else line


def summarize(items: Sequence[str], limit: int = 6) -> str:
    """Join ``items`` for a message, eliding the tail: ``a, b, c ... and 12 more``."""
    shown = ", ".join(items[:limit])
    rest = len(items) - limit
    return f"{shown} ... and {rest} more" if rest > 0 else shown
