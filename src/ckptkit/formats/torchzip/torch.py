"""torch's half of torch's formats: the zip written faster than ``torch.save``, and zip and legacy
files read by ``torch.load`` behind ckptkit's checks, whole pickled modules as their ``state_dict()``.

Writing. ``torch.save`` is two jobs: pickling (which storages, what the tensors are) and the zip
writer. The first is torch's own, reused as it is (``torch.serialization._save``, which takes any
object with ``write_record``). The second is ckptkit's ``ZipWriter``: each storage's bytes go to
the file in large writes straight from tensor memory, and their CRC-32 is computed on a second
thread during the write, where torch's writer runs a slow CRC after copying. The file is the
format ``torch.load`` reads, memory-mapped or not, with every CRC right. Where the private
``_save`` is missing or takes other arguments (another torch release), or an object needs what
this writer does not do (``skip_data``), the caller falls back to ``torch.save``.

Reading. Before torch reads a byte, the zip's structure and every declared storage size are
checked against the file (a flipped size bit cannot make torch allocate terabytes), and archives
torch would only warn about (TorchScript) are refused by name. When torch fails, the error says
what happened: the pickle needs globals the caller did not allow, a class cannot be imported, it
needs a process group, the device does not exist, or the file is damaged, which ckptkit says only
after its own checks have found the damage.

A whole pickled module (``torch.save(model, path)``) is read as its ``state_dict()``, trusted or
not: :mod:`.modulepickle` reads the pickle with every class an inert stand-in, and torch's own
loader drives that unpickler here, so storages are mapped and moved as ``torch.load`` does them
(``map_location``, ``mmap``) and the leaves are real tensors. Only torch's tensor rebuilders and a
few builtins are real: no module of the pickle is imported, no ``__setstate__`` runs.

Example:
    >>> load_pickled_module("model.pt", map_location="cpu").description  # doctest: +SKIP
    'DistributedDataParallel(ToyCNN)'
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import inspect
import os
import pickle
import queue
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ...errors import (
    NO_CUDA_FIX,
    ArgumentError,
    CheckpointFormatError,
    CheckpointWriteError,
    CkptkitError,
    ClassNotFoundError,
    DistributedError,
    UnsafeCheckpointError,
    cause,
    spell,
    summarize,
)
from ...io.fileio import Progress, local_file
from ..integrity import record_crc, zip_checks
from ..pickles.safety import (
    MODULE_WALK,
    AllowGlobals,
    global_name,
    needed_globals,
    resolve_globals,
    unsafe_error,
)
from ..spec import Placement, WritePlan
from . import modulepickle as mp
from .bounds import StorageFit, check_storage_bounds
from .container import TorchZip
from .detect import LEGACY
from .writer import ZipWriter

MapLocation = Any  # str | torch.device | dict[str, str] | Callable[[storage, str], storage], resolved by the caller


_PREFIX = "archive/"
_SAVE_PARAMETERS = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


class FallBack(Exception):
    """This object or this torch needs ``torch.save`` itself; nothing useful was written."""


# Host copies of device storages waiting for the writer, at most: the copy of the next storage
# overlaps the write of the previous ones, in bounded memory.
IN_FLIGHT = 512 << 20
OVERLAP = True  # benchmarks/bench_gpu.py switches it off for its A/B
_PINNED_LOCK = threading.Lock()
_PINNED: list[Any] = [0, False]  # saves inside _pinned_copies, and torch's setting before the first


class _Behind:
    """The records written in order by one thread while the caller's thread goes on (torch copying
    the next storage off the GPU), at most :data:`IN_FLIGHT` bytes waiting; the first error is
    raised to the caller at its next record or at :meth:`finish`."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], object], int, object] | None] = queue.SimpleQueue()
        self._held = 0
        self._error: BaseException | None = None
        self._room = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ckptkit-writer", daemon=True)
        self._thread.start()

    def submit(self, write: Callable[[], object], nbytes: int, keep: object) -> None:
        """Queue ``write`` (``keep``: what its bytes live in, alive until written)."""
        with self._room:
            while self._held and self._held + nbytes > IN_FLIGHT and self._error is None:
                self._room.wait()
            if self._error is not None:
                raise self._error
            self._held += nbytes
        self._queue.put((write, nbytes, keep))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            write, nbytes, _ = item
            try:
                if self._error is None:
                    write()
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread
                self._error = e
            finally:
                with self._room:
                    self._held -= nbytes
                    self._room.notify_all()

    def finish(self, *, failed: bool = False) -> None:
        """Wait for every record to be written; raise the first error (``failed``: the caller is
        raising already: write nothing more, and wait for the write under way whatever comes,
        since the caller closes the file next)."""
        if failed:
            self._error = self._error or CheckpointWriteError("stopped")
        self._queue.put(None)
        if not failed:
            self._thread.join()
        else:
            while self._thread.is_alive():
                with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: still wait
                    self._thread.join()
        if self._error is not None and not failed:
            raise self._error


class _Records:
    """What ``torch.serialization._save`` writes to: PyTorchFileWriter's ``write_record``. With
    ``behind``, each record is written by its thread while torch copies the next storage."""

    def __init__(self, writer: ZipWriter, progress: Progress | None, behind: _Behind | None = None) -> None:
        self.writer, self.progress, self.behind = writer, progress, behind

    def write_record(self, name: str, data: Any, size: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray)):
            record = bytes(data[:size])
            self._write(lambda: self.writer.add_bytes(_PREFIX + name, record), len(record), record)
            return
        # A CPU UntypedStorage (torch copied any other device's to the CPU): its memory as it is.
        buf = (ctypes.c_ubyte * size).from_address(data.data_ptr()) if size else b""
        self._write(lambda: self.writer.add_buffer(_PREFIX + name, buf, self.progress), size, data)

    def _write(self, write: Callable[[], object], nbytes: int, keep: object) -> None:
        if self.behind is None:
            write()
        else:
            self.behind.submit(write, nbytes, keep)

    def write_record_metadata(self, name: str, size: int) -> None:
        raise FallBack("skip_data")


def save_zip(obj: Any, f: BinaryIO, *, progress: Progress | None = None) -> None:
    """Write ``obj`` to ``f`` in torch's zip format (what ``torch.save(obj, f)`` writes).

    Raises:
        FallBack: use ``torch.save`` (before anything but a partial file was written: the caller
            starts the file again).
    """
    save = getattr(torch.serialization, "_save", None)
    if save is None or list(inspect.signature(save).parameters)[:5] != _SAVE_PARAMETERS:
        raise FallBack("torch.serialization._save is not the one this writer knows")
    alignment = getattr(torch.serialization, "_get_storage_alignment", lambda: 64)()
    writer = ZipWriter(f, alignment=alignment)
    if not (OVERLAP and _on_a_device(obj)):
        save(obj, _Records(writer, progress), pickle, 2, False)  # protocol 2, as torch.save
    else:  # each storage's copy to the host overlaps the writing of the ones before it
        behind = _Behind()
        try:
            with _pinned_copies():
                save(obj, _Records(writer, progress, behind), pickle, 2, False)
            behind.finish()
        except BaseException:
            behind.finish(failed=True)
            raise
    writer.finish_torch_archive(_PREFIX)
    writer.close()


def _on_a_device(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` (a state dict, a training state: containers of tensors) holds a tensor that
    is not on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.device.type != "cpu"
    if depth > 32:
        return False
    if isinstance(obj, Mapping):
        return any(_on_a_device(v, depth + 1) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_on_a_device(v, depth + 1) for v in obj)
    return False


@contextlib.contextmanager
def _pinned_copies() -> Iterator[None]:
    """torch's ``_save`` copies device storages into pinned host memory (which its caching host
    allocator reuses once a storage is written) instead of pageable memory, where it can."""
    try:
        from torch.utils.serialization import config as serialization_config

        config = serialization_config.save
    except ImportError:  # torch before 2.7
        config = None
    if config is None or not hasattr(config, "use_pinned_memory_for_d2h"):
        yield  # an older torch: pageable copies, still overlapped
        return
    with _PINNED_LOCK:  # a process-wide setting: saves on several threads set and restore it once
        if _PINNED[0] == 0:
            _PINNED[1] = config.use_pinned_memory_for_d2h
            config.use_pinned_memory_for_d2h = True
        _PINNED[0] += 1
    try:
        yield
    finally:
        with _PINNED_LOCK:
            _PINNED[0] -= 1
            if _PINNED[0] == 0:
                config.use_pinned_memory_for_d2h = _PINNED[1]


def torch_load(
    source: str, fmt: str, *, map_location: MapLocation, trust: bool, allow_globals: AllowGlobals, mmap: bool
) -> Any:
    """Load a torch zip or legacy file with ``torch.load``; every failure is a CkptkitError."""
    import torch

    allowed = [] if trust else resolve_globals(allow_globals)
    kwargs: dict[str, Any] = {"map_location": map_location, "weights_only": not trust}
    source = local_file(source)  # torch opens the path itself
    with open(source, "rb") as f:
        check_storage_bounds(source, fmt, file=f)
        if fmt != LEGACY and mmap:
            kwargs["mmap"] = not TorchZip(source, file=f).compressed_storages  # torch maps stored records only
        # torch opens the file again (it needs a path to memory-map). /proc/self/fd names the file
        # opened and checked above even if the path was replaced since (a trainer saving "latest").
        pinned = f"/proc/self/fd/{f.fileno()}"
        target = pinned if os.path.exists(pinned) else source
        try:
            if trust and fmt != LEGACY and _holds_module(source, TorchZip(source, file=f), trust=True, allowed=allowed):
                return load_pickled_module(
                    target, map_location=map_location, mmap=kwargs.get("mmap", False), trust=True
                ).state
            with torch.serialization.safe_globals(allowed) if allowed else contextlib.nullcontext():
                obj = torch.load(target, **kwargs)
            # A trusted module the inert walk cannot model (state-dict hooks): its own state_dict().
            return obj.state_dict() if isinstance(obj, torch.nn.Module) else obj
        except CkptkitError:
            raise
        except MemoryError:
            raise  # reads are bounded above: this is not the file's doing
        except Exception as e:
            if not (isinstance(e, pickle.UnpicklingError) and not trust and fmt != LEGACY):
                raise _explain(e, source, target, fmt, f, trust=trust, allowed=allowed) from e
            if not _holds_module(source, TorchZip(source, file=f), trust=False, allowed=allowed):
                raise _explain(e, source, target, fmt, f, trust=trust, allowed=allowed) from e
        try:  # a whole pickled module, found safe to read above: its state_dict(), nothing run
            names = [global_name(g) for g in allowed]
            return load_pickled_module(
                target, map_location=map_location, mmap=kwargs.get("mmap", False), allow=names
            ).state
        except (CkptkitError, MemoryError):
            raise
        except Exception as e:
            raise _explain(e, source, target, fmt, f, trust=trust, allowed=allowed) from e


def _holds_module(source: str, z: TorchZip, *, trust: bool, allowed: list[Any]) -> bool:
    """Whether the zip pickles a whole module that the inert walk models (read without torch).

    Raises:
        UnsafeCheckpointError: a module pickle that calls or names other globals (unless
            ``trust`` or ``allowed``), or whose state_dict() needs its own code (unless ``trust``).
        CheckpointFormatError: a module pickle declaring a storage larger than its record (the
            bounds check stops at the first class, and torch allocates each storage as declared).
    """
    fits = StorageFit(z)
    try:
        mp.read_module(
            z.read(f"{z.prefix}data.pkl"), trust=trust, allow=[global_name(g) for g in allowed], on_storage=fits
        )
        modelled = True
    except mp.Unbounded as e:  # torch's state_dict() would not end either
        raise CheckpointFormatError(f"{source}: pickled module: {e}") from None
    except (mp.NotAModule, CheckpointFormatError):
        return False  # torch's loader reads it, and says what is wrong
    except mp.UnsafeModulePickle as e:
        raise unsafe_error(source, e.names, where=f" (a pickled {e.description} module)", beyond=MODULE_WALK) from None
    except mp.Unmodelled as e:
        if not trust:
            raise unmodelled_error(source, str(e)) from None
        modelled = False  # torch's loader builds the real module, and its state_dict() runs its code
    if fits.problems:
        raise CheckpointFormatError(f"{source}: {summarize(fits.problems, 2)}")
    return modelled


def _explain(
    e: Exception, source: str, target: str, fmt: str, f: BinaryIO, *, trust: bool, allowed: list[Any]
) -> CkptkitError:
    text = str(e)
    needs = None
    if isinstance(e, pickle.UnpicklingError) and not trust:
        # What to allow, found by loading with torch's weights-only unpickler (the static scan
        # first): the advice then works when followed, numpy.dtypes classes and all.
        with contextlib.suppress(CkptkitError):
            needs = needed_globals(target, allowed)
        if needs is not None and needs.names:
            return unsafe_error(source, needs.names, loads=needs.loads, why=needs.why)
    if isinstance(e, ImportError) or (isinstance(e, AttributeError) and "Can't get attribute" in text):
        missing = getattr(e, "name", None) or text
        return ClassNotFoundError(
            f"{source}: its pickle needs {missing!r}, which cannot be imported here ({type(e).__name__}: {text}). "
            "Make the module that defined the class importable (install it, or add its folder to PYTHONPATH), "
            f"or load a checkpoint that holds only a state dict, which needs no {spell('trust=True', '--trust')}"
        )
    if "process group" in text and "initialized" in text:
        return DistributedError(
            f"{source}: unpickling it needs a torch.distributed process group ({cause(e)}): it pickles an "
            "object that joins one when loaded, such as a DistributedDataParallel module. Save "
            "model.module.state_dict() instead, or load it inside a process group"
        )
    if "CUDA" in text and "is_available() is False" in text:
        return ArgumentError(f"{source}: {cause(e)}; {NO_CUDA_FIX}")
    if fmt == LEGACY:
        return CheckpointFormatError(
            f"{source}: torch cannot read this legacy-format checkpoint ({cause(e)}); the legacy format "
            "holds no checksums, so ckptkit cannot tell whether it is truncated, damaged or something else"
        )
    try:
        z = TorchZip(source, file=f)
        damage = [f"{c.name}: {c.detail}" for c in zip_checks(z, full=True)[0] if not c.ok and c.kind == "integrity"]
    except CheckpointFormatError as err:
        damage = [str(err)]
        if needs is not None and not needs.loads and _crcs_match(source, f):
            damage = []  # ckptkit's inert walk cannot follow it (a filled defaultdict); torch said why it stops
    if damage:
        return CheckpointFormatError(
            f"{source}: damaged torch zip checkpoint: {summarize(damage, 2)} (torch: {cause(e)})"
        )
    if needs is not None and not needs.loads:  # intact, every global admitted, and still beyond weights-only
        return unsafe_error(source, (), why=needs.why)
    return CheckpointFormatError(
        f"{source}: torch cannot load this checkpoint, though its zip structure and CRC-32s check out: {cause(e)}"
    )


def _crcs_match(source: str, f: BinaryIO) -> bool:
    try:
        z = TorchZip(source, file=f)
        return all(record_crc(z, r, None) == r.crc for r in z.records)
    except CheckpointFormatError:
        return False


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


def unmodelled_error(source: str, reason: str) -> UnsafeCheckpointError:
    """The refusal for a module pickle whose ``state_dict()`` needs the module's own code."""
    return UnsafeCheckpointError(
        f"{source}: holds a pickled module whose state_dict() ckptkit cannot compute without running its code "
        f"({reason}). If you trust this file, pass {spell('trust=True', '--trust')} to load it with torch and call state_dict()"
    )


def read(
    path: str,
    *,
    fmt: str,
    placement: Placement,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    mmap: bool = True,
    zero_weights: str = "fp32",
) -> Any:
    """A torch zip or legacy file through ``torch.load``, behind ckptkit's checks."""
    return torch_load(
        path, fmt, map_location=placement.map_location, trust=trust, allow_globals=allow_globals, mmap=mmap
    )


def write(target: BinaryIO | Path, obj: Any, state: Any, *, dest: Path, plan: WritePlan) -> None:
    """``obj`` pickled by torch into the open file ``target``, as a torch zip; errors name ``dest``."""
    assert not isinstance(target, Path)  # a file format: its writer gets the open file
    _torch_save(obj, target, dest)


def _torch_save(obj: Any, f: BinaryIO, dest: Path) -> None:
    writer = _RecordingWriter(f)
    try:
        try:
            save_zip(obj, writer)  # type: ignore[arg-type]  # a file-like object
        except FallBack:
            f.seek(0)
            f.truncate()
            torch.save(obj, writer)  # type: ignore[arg-type]
    except CkptkitError:
        raise
    except Exception as e:
        # torch's zip writer turns a failed write into "unexpected pos ..."; the OSError it
        # swallowed (disk full, file too large) is the cause worth reading.
        if writer.error is not None:
            raise writer.error from e
        if isinstance(e, OSError):
            raise
        raise CheckpointWriteError(f"cannot save {dest}: {type(e).__name__}: {e}") from e


class _RecordingWriter:
    """A file wrapper that remembers the first OSError a write raised."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        try:
            self._f.flush()
        except OSError as e:
            self.error = self.error or e
            raise

    def tell(self) -> int:
        return self._f.tell()

    def fileno(self) -> int:
        return self._f.fileno()
