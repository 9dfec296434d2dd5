"""Load a checkpoint onto this process's device, safely, and into a model of any wrapping."""

from __future__ import annotations

import os
import pickle
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import _dist
from ._errors import (
    PARSE_ERRORS,
    ArgumentError,
    CheckpointFormatError,
    CkptkitError,
    StateDictMismatchError,
    UnsafeCheckpointError,
    summarize,
)
from ._formats import DCP, LEGACY, SAFETENSORS, ZIP, detect_format, unsafe_globals
from ._layout import find_model_state
from ._prefix import WRAPPER_PREFIXES, adapt_state_dict, detect_prefixes

MapLocation = Any  # str | torch.device | dict[str, str] | Callable[[storage, str], storage]


def device_for_rank(*, local_rank: int | None = None, cuda_available: bool | None = None, device_count: int | None = None) -> str:
    """The device this process should load onto: ``cuda:LOCAL_RANK`` or ``cpu``.

    When more processes than GPUs share a node (several ranks on one GPU), ranks wrap around
    the GPUs (``LOCAL_RANK % device_count``) instead of pointing at a GPU that does not exist.

    Example:
        >>> device_for_rank(local_rank=3, cuda_available=True, device_count=8)
        'cuda:3'
        >>> device_for_rank(local_rank=3, cuda_available=False)
        'cpu'
    """
    if cuda_available is None or (cuda_available and device_count is None):
        import torch

        cuda_available = torch.cuda.is_available() if cuda_available is None else cuda_available
        device_count = torch.cuda.device_count() if cuda_available else 0
    if not cuda_available or not device_count:
        return "cpu"
    rank = _dist.local_rank() if local_rank is None else local_rank
    return f"cuda:{rank % device_count}"


def _restore_to(device: str) -> MapLocation:
    if device == "cpu":
        return "cpu"
    from torch.serialization import default_restore_location

    def restore(storage: Any, location: str) -> Any:
        # Accelerator tags (cuda:N, mps, xpu...) go to our device; CPU stays CPU because some
        # state must be on the CPU (torch.set_rng_state takes a CPU ByteTensor).
        return default_restore_location(storage, "cpu" if location == "cpu" else device)

    return restore


def _weights_only_reason(e: BaseException) -> str:
    for line in str(e).splitlines():
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def read_checkpoint(
    path: str | os.PathLike[str],
    *,
    map_location: MapLocation = None,
    trust: bool = False,
    allow_globals: Sequence[Any] = (),
    mmap: bool = True,
) -> Any:
    """Load any supported checkpoint file as Python objects (no model involved).

    Safe by default: pickles are loaded with ``weights_only=True``; ``allow_globals`` admits
    named classes only (``torch.serialization.safe_globals``); ``trust=True`` allows arbitrary
    unpickling and must only be used for files from a trusted source.
    """
    import torch

    source = os.fspath(path)
    fmt = detect_format(source)
    if fmt == SAFETENSORS:
        from ._safetensors import load_tensors

        if map_location is None:
            device = device_for_rank()
        elif isinstance(map_location, (str, torch.device)):
            device = str(map_location)
        else:
            raise ArgumentError(f"{source}: safetensors files take a device as map_location, not {map_location!r}")
        return load_tensors(source, device=device)[0]
    if fmt == DCP:
        from ._dcp import read_dcp

        return read_dcp(source, trust=trust)
    if map_location is None:
        map_location = _restore_to(device_for_rank())
    from ._bounds import check_storage_bounds

    kwargs: dict[str, Any] = {"map_location": map_location, "weights_only": not trust}
    if fmt == ZIP and mmap:
        kwargs["mmap"] = True
    with open(source, "rb") as f:
        # Records inside the file, declared sizes within their bytes: a damaged or hostile file
        # cannot make torch allocate what the file does not hold.
        check_storage_bounds(source, fmt, file=f)
        # torch opens the file again (it needs a path to memory-map). /proc/self/fd names the file
        # opened and checked above even if the path was replaced since (a trainer saving "latest").
        pinned = f"/proc/self/fd/{f.fileno()}"
        target = pinned if os.path.exists(pinned) else source
        try:
            if allow_globals and not trust:
                with torch.serialization.safe_globals(list(allow_globals)):
                    return torch.load(target, **kwargs)
            return torch.load(target, **kwargs)
        except pickle.UnpicklingError as e:
            if not trust:
                try:
                    unsafe = unsafe_globals(target)
                except CkptkitError:
                    unsafe = []
                if unsafe:
                    raise UnsafeCheckpointError(
                        f"{source}: refused to load: it needs {len(unsafe)} global(s) outside torch's weights-only "
                        f"allowlist: {summarize(unsafe)}. Unpickling them could run arbitrary code. If you trust "
                        "this file, allow just these types with allow_globals=[...], or pass trust=True "
                        "(CLI: --trust)",
                        unsafe,
                    ) from e
            raise CheckpointFormatError(f"{source}: damaged checkpoint: {_weights_only_reason(e)}") from e
        except PARSE_ERRORS as e:
            kind = "legacy torch" if fmt == LEGACY else "torch zip"
            raise CheckpointFormatError(f"{source}: damaged or truncated {kind} checkpoint: {_weights_only_reason(e)}") from e


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


def check_fit(state_dict: Mapping[str, Any], target: Mapping[str, Any]) -> tuple[list[str], list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
    """Compare a state dict with a target state dict: ``(missing, unexpected, mismatched)``."""
    missing = [k for k in target if k not in state_dict]
    unexpected = [k for k in state_dict if k not in target]
    mismatched = []
    for k, v in state_dict.items():
        if k in target:
            a, b = _shape(v), _shape(target[k])
            if a is not None and b is not None and a != b:
                mismatched.append((k, a, b))
    return missing, unexpected, mismatched


def _mismatch_message(source: str, model: Any, found: tuple[list[str], list[str], list[Any]]) -> str:
    missing, unexpected, mismatched = found
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s) ({summarize(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s) ({summarize(unexpected)})")
    if mismatched:
        shown = [f"{k}: checkpoint {list(a)} vs model {list(b)}" for k, a, b in mismatched]
        parts.append(f"{len(mismatched)} shape mismatch(es) ({summarize(shown, 4)})")
    hint = "Fix the model definition, or pass strict=False to load only the keys that fit"
    common = detect_prefixes(unexpected).common if len(unexpected) > 1 else ""
    healed = {k[len(common):] for k in unexpected} & set(missing) if common else set()
    if len(healed) * 2 >= len(unexpected):  # dropping the prefix would fix most of them
        hint = (
            f"The checkpoint's extra keys all start with {common!r}: pass wrappers=(..., {common!r}) "
            f"(CLI: --strip {common}) to treat it as a wrapper prefix"
        )
    return f"{source} does not fit {type(model).__name__}: {'; '.join(parts)}. {hint}"


def load_into_model(
    model: Any,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    wrappers: Iterable[str] = WRAPPER_PREFIXES,
    source: str = "state dict",
) -> None:
    """Adapt wrapper prefixes to ``model`` and load; report every mismatch at once."""
    adapted = adapt_state_dict(state_dict, model, wrappers=wrappers)
    found = check_fit(adapted, model.state_dict())
    missing, unexpected, mismatched = found
    if strict and (missing or unexpected or mismatched):
        raise StateDictMismatchError(
            _mismatch_message(source, model, found), missing=missing, unexpected=unexpected, mismatched=mismatched
        )
    if mismatched:
        # torch raises on shape mismatches even with strict=False; skipping them is what
        # strict=False users ask for.
        warnings.warn(f"{source}: skipped {len(mismatched)} key(s) with mismatched shapes", stacklevel=3)
        meta = getattr(adapted, "_metadata", None)
        for k, _, _ in mismatched:
            del adapted[k]
        if meta is not None:
            adapted._metadata = meta  # type: ignore[attr-defined]
    model.load_state_dict(adapted, strict=strict)


def load_for_rank(
    path: str | os.PathLike[str],
    *,
    model: Any = None,
    map_location: MapLocation = None,
    key: str | None = None,
    strict: bool = True,
    trust: bool = False,
    allow_globals: Sequence[Any] = (),
    wrappers: Iterable[str] = WRAPPER_PREFIXES,
    mmap: bool = True,
    verify: bool = False,
) -> Any:
    """Load a checkpoint onto this process's device, and optionally into ``model``.

    Tensors saved on any accelerator (``cuda:N``) land on ``cuda:LOCAL_RANK`` of this process,
    or on the CPU when CUDA is unavailable, so a GPU-saved checkpoint opens on a CPU-only
    machine and no two ranks pile onto ``cuda:0``. Tensors saved on the CPU stay there. Not a
    collective: each rank reads the file itself.

    Args:
        path: a torch checkpoint (zip or legacy format) or a ``.safetensors`` file.
        model: when given, the weights are found in the checkpoint (top level, or under
            ``state_dict``/``model``/``model_state_dict``/``module``...), their wrapper prefixes
            (``module.``, ``_orig_mod.``, nested) adapted to ``model``'s, and loaded.
        map_location: overrides the per-rank device mapping (as ``torch.load``'s).
        key: where the weights are, e.g. ``"ema"`` or ``"ema/model"``.
        strict: when True (default), any missing, unexpected or mis-shaped key raises
            :class:`StateDictMismatchError` listing all of them; when False those are skipped.
        trust: allow arbitrary unpickling. Only for files you trust: a pickle can run code.
        allow_globals: classes or functions to admit without trusting everything, e.g.
            ``[argparse.Namespace]``.
        wrappers: wrapper prefixes to adapt; add ``"model."`` for Lightning checkpoints.
        mmap: memory-map zip checkpoints instead of reading them into memory.
        verify: check integrity first (every zip CRC-32, ckptkit's safetensors CRCs, bounds):
            reads the whole file once; torch.load itself checks no CRC.

    Returns:
        The whole checkpoint object (so a training checkpoint's other entries are at hand).

    Raises:
        CheckpointNotFoundError, CheckpointFormatError, UnsafeCheckpointError, LayoutError,
        StateDictMismatchError.

    Example:
        >>> ckpt = load_for_rank("ckpt.pt", model=model)  # doctest: +SKIP
        >>> optimizer.load_state_dict(ckpt["optimizer"])  # doctest: +SKIP
    """
    source = os.fspath(path)
    if verify:
        from ._verify import verify_checkpoint

        report = verify_checkpoint(source)
        failed = [f"{c['check']}: {c['detail']}" for c in report.checks if not c["ok"]]
        # "safe to load" is the loader's own decision (trust / allow_globals), not damage.
        damage = [f for f in failed if not f.startswith("safe to load")]
        if damage:
            raise CheckpointFormatError(f"{source}: failed verification: {'; '.join(damage)}")
    obj = read_checkpoint(source, map_location=map_location, trust=trust, allow_globals=allow_globals, mmap=mmap)
    if model is not None:
        _, state_dict = find_model_state(obj, key=key, source=source)
        load_into_model(model, state_dict, strict=strict, wrappers=wrappers, source=source)
    return obj

