"""``torch.load`` behind ckptkit's checks, with its failures told by what happened.

Before torch reads a byte, the zip's structure and every declared storage size are checked
against the file (a flipped size bit cannot make torch allocate terabytes), and archives torch
would only warn about (TorchScript) are refused by name. When torch fails, the
error says what happened: the pickle needs globals the caller did not allow, a class cannot be
imported, it needs a process group, the device does not exist, or the file is damaged, which
ckptkit says only after its own checks have found the damage.

A zip that pickles a whole module (``torch.save(model, path)``) is read as its ``state_dict()``
by the inert walk of :mod:`._pickled`, trusted or not: nothing in it is imported or run.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from typing import Any, BinaryIO

from ..distributed.devices import NO_CUDA_FIX, MapLocation, check_device, device_for_rank, restore_to
from ..errors import (
    ArgumentError,
    CheckpointFormatError,
    CkptkitError,
    ClassNotFoundError,
    DistributedError,
    spell,
    summarize,
)
from ..formats.detect import LEGACY, Format
from ..formats.integrity import record_crc, zip_checks
from ..formats.pickles.reader import StorageRef
from ..formats.torchzip import modulepickle as mp
from ..formats.torchzip.bounds import check_storage_bounds, storage_problem
from ..formats.torchzip.container import TorchZip
from .pickled import load_pickled_module, unmodelled_error
from .safety import MODULE_WALK, AllowGlobals, global_name, needed_globals, resolve_globals, torch_reason, unsafe_error


def torch_load(
    source: str, fmt: Format, *, map_location: MapLocation, trust: bool, allow_globals: AllowGlobals, mmap: bool
) -> Any:
    """Load a torch zip or legacy file with ``torch.load``; every failure is a CkptkitError."""
    import torch

    allowed = [] if trust else resolve_globals(allow_globals)
    if map_location is None:
        map_location = restore_to(device_for_rank())
    else:
        check_device(map_location, source)
    kwargs: dict[str, Any] = {"map_location": map_location, "weights_only": not trust}
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
    problems: list[str] = []

    def fits(ref: StorageRef) -> None:
        why = storage_problem(ref, z)
        if why is not None:
            problems.append(why)

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
    if problems:
        raise CheckpointFormatError(f"{source}: {summarize(problems, 2)}")
    return modelled


def _reason(e: BaseException) -> str:
    # torch puts its reason after "WeightsUnpickler error:", on the same line or the next ones: an
    # empty remainder of that line once made "torch cannot load this checkpoint...:" end in nothing.
    if "WeightsUnpickler error:" in str(e):
        return torch_reason(e)
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def _explain(
    e: Exception, source: str, target: str, fmt: Format, f: BinaryIO, *, trust: bool, allowed: list[Any]
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
            f"{source}: unpickling it needs a torch.distributed process group ({_reason(e)}): it pickles an "
            "object that joins one when loaded, such as a DistributedDataParallel module. Save "
            "model.module.state_dict() instead, or load it inside a process group"
        )
    if "CUDA" in text and "is_available() is False" in text:
        return ArgumentError(f"{source}: {_reason(e)}; {NO_CUDA_FIX}")
    if fmt == LEGACY:
        return CheckpointFormatError(
            f"{source}: torch cannot read this legacy-format checkpoint ({_reason(e)}); the legacy format "
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
            f"{source}: damaged torch zip checkpoint: {summarize(damage, 2)} (torch: {_reason(e)})"
        )
    if needs is not None and not needs.loads:  # intact, every global admitted, and still beyond weights-only
        return unsafe_error(source, (), why=needs.why)
    return CheckpointFormatError(
        f"{source}: torch cannot load this checkpoint, though its zip structure and CRC-32s check out: {_reason(e)}"
    )


def _crcs_match(source: str, f: BinaryIO) -> bool:
    try:
        z = TorchZip(source, file=f)
        return all(record_crc(z, r, None) == r.crc for r in z.records)
    except CheckpointFormatError:
        return False
