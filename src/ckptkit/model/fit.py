"""Fit a state dict to a model of any wrapping, and report every key that does not fit at once."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from ..errors import StateDictMismatchError, summarize
from ..formats.producers import AVERAGED_COUNTS
from ..prefix import WRAPPER_PREFIXES, adapt_state_dict, canonical_key, detect_prefixes, wrapper_names
from .layout import select_prefix
from .unwrap import unwrap_model, without_averaged_count


def _shape(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return tuple(shape) if shape is not None else None


def check_fit(
    state_dict: Mapping[str, Any], target: Mapping[str, Any]
) -> tuple[list[str], list[str], list[tuple[str, tuple[int, ...], tuple[int, ...]]]]:
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


def _memory(value: Any) -> tuple[Any, int, int] | None:
    """``(device, storage address, storage bytes)``: what ``safetensors.torch._find_shared_tensors``
    groups by. None for what shares with nothing: a meta or empty tensor, a subclass (a DTensor's
    storage is its local shard), a non-tensor (``_extra_state``)."""
    import torch

    if type(value) is not torch.Tensor or value.device.type == "meta" or value.numel() == 0:
        return None
    storage = value.untyped_storage()
    return (value.device, storage.data_ptr(), storage.nbytes()) if storage.data_ptr() else None


def _covers(outer: Any, inner: Any) -> bool:
    """Whether loading ``outer`` writes every element of ``inner`` (both in one storage)."""
    if (outer.storage_offset(), outer.shape, outer.stride(), outer.dtype) == (
        inner.storage_offset(),
        inner.shape,
        inner.stride(),
        inner.dtype,
    ):
        return True  # tied weights: one tensor under two names
    if outer.dtype != inner.dtype or not outer.is_contiguous():
        return False
    start = inner.storage_offset() - outer.storage_offset()
    last = start + sum((n - 1) * s for n, s in zip(inner.shape, inner.stride(), strict=True))
    return start >= 0 and last < outer.numel()


def tied_keys(target: Mapping[str, Any]) -> dict[str, list[str]]:
    """Each key of a model's state dict whose memory lies wholly inside other keys' (tied weights,
    a buffer that views a parameter), mapped to those keys in the model's order.

    safetensors' ``save_model``, ``save_pretrained`` and Accelerate store such a group once, so a
    checkpoint lacks all but one of its names; loading the one stored fills the others.

    Example:
        >>> import torch.nn as nn
        >>> lm = nn.Sequential(nn.Embedding(4, 2), nn.Linear(2, 4, bias=False))
        >>> lm[1].weight = lm[0].weight  # an output layer tied to the embedding
        >>> tied_keys(lm.state_dict())
        {'0.weight': ['1.weight'], '1.weight': ['0.weight']}
    """
    groups: dict[tuple[Any, int, int], list[str]] = {}
    for key, value in target.items():
        memory = _memory(value)
        if memory is not None:
            groups.setdefault(memory, []).append(key)
    ties: dict[str, list[str]] = {}
    for keys in groups.values():
        for key in keys:
            fillers = [other for other in keys if other != key and _covers(target[other], target[key])]
            if fillers:
                ties[key] = fillers
    return ties


def _tied_value(stored: Any, inner: Any, outer: Any) -> Any:
    """The part of ``stored`` (checkpoint's value for ``outer``) that model tensor ``inner`` views."""
    if (outer.storage_offset(), outer.shape, outer.stride()) == (inner.storage_offset(), inner.shape, inner.stride()):
        return stored
    flat = stored.contiguous().view(-1)
    return flat.as_strided(
        inner.shape, inner.stride(), flat.storage_offset() + inner.storage_offset() - outer.storage_offset()
    )


def _check_filling_ties(adapted: dict[str, Any], target: Mapping[str, Any]) -> tuple[list[str], list[str], list[Any]]:
    """:func:`check_fit`, after filling each missing key that the model ties to a stored one, as
    ``safetensors.torch.load_model`` does. The filled entry is the stored tensor (or its view), so
    ``load_state_dict`` copies the same values into the one shared storage and the tie holds."""
    missing, unexpected, mismatched = check_fit(adapted, target)
    ties = tied_keys(target) if missing else {}
    still = []
    for key in missing:
        stored = [k for k in ties.get(key, ()) if k in adapted]
        fits = [k for k in stored if _shape(adapted[k]) == _shape(target[k])]
        if fits:
            adapted[key] = _tied_value(adapted[fits[0]], target[key], target[fits[0]])
        elif not stored:  # one stored but mis-shaped is reported as that mismatch, not twice
            still.append(key)
    return still, unexpected, mismatched


def fitting_prefixes(
    state_dict: Mapping[str, Any], target: Mapping[str, Any], *, wrappers: Iterable[str] = WRAPPER_PREFIXES
) -> list[str]:
    """The leading prefixes under which ``state_dict`` holds exactly ``target``'s keys, one to one
    and shape for shape (tied ones may be stored once), wrapper segments aside: ``["net."]`` for a
    LightningModule's ``net._orig_mod.conv1.weight`` against a plain net, two for a teacher and a
    student.

    Example:
        >>> fitting_prefixes({"net._orig_mod.w": 0, "loss.t": 1}, {"w": 0})
        ['net.']
    """
    names = wrapper_names(wrappers)
    want = {canonical_key(k, names): _shape(v) for k, v in target.items()}
    if len(want) != len(target):  # two model keys with one plain name: names cannot decide
        return []
    ties = {
        canonical_key(k, names): {canonical_key(o, names) for o in others} for k, others in tied_keys(target).items()
    }
    under: dict[str, dict[str, str]] = {}  # plain prefix -> {model key: checkpoint key}
    raw: dict[str, set[str]] = {}  # plain prefix -> how the checkpoint's keys spell it
    for key in state_dict:
        parts = key.split(".")
        plain = [i for i, p in enumerate(parts) if p not in names]
        for n in range(1, len(plain)):
            rest = ".".join(parts[i] for i in plain[n:])
            lead = ".".join(parts[i] for i in plain[:n]) + "."
            if rest in want:
                under.setdefault(lead, {})[rest] = key
            raw.setdefault(lead, set()).add(".".join(parts[: plain[n - 1] + 1]) + ".")
    fits = []
    for lead, got in under.items():
        spelled = raw[lead]
        if any(not ties.get(k, set()) & got.keys() for k in want.keys() - got.keys()) or len(spelled) != 1:
            continue  # a key neither stored nor tied to a stored one
        prefix = spelled.pop()
        inside = [k for k in state_dict if k.startswith(prefix)]
        if len(inside) == len(got) and all(_shape(state_dict[v]) == want[k] for k, v in got.items()):
            fits.append(prefix)
    return fits


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
    healed = {k[len(common) :] for k in unexpected} & set(missing) if common else set()
    if healed and len(healed) * 2 >= len(unexpected):  # dropping the prefix would fix most of them
        hint = f"The checkpoint's extra keys all start with {common!r}: pass wrappers=(..., {common!r}) to treat it as a wrapper prefix"
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
    model.load_state_dict(
        fit_to_model(model, state_dict, strict=strict, wrappers=wrappers, source=source), strict=strict
    )


def fit_to_model(
    model: Any,
    state_dict: Mapping[str, Any],
    *,
    strict: bool = True,
    wrappers: Iterable[str] = WRAPPER_PREFIXES,
    source: str = "state dict",
) -> Mapping[str, Any]:
    """``state_dict`` renamed for ``model``'s wrapping, ready for ``model.load_state_dict``;
    ``model`` itself is not touched, so a caller can check everything before changing anything.
    A key the checkpoint lacks but the model ties to a stored one (see :func:`tied_keys`) is
    filled from it; the caller's ``state_dict`` is not changed.

    Raises:
        StateDictMismatchError: with ``strict``, every missing, unexpected or mis-shaped key.
    """
    target = model.state_dict()
    names = wrapper_names(wrappers)
    if all(canonical_key(k, names) not in AVERAGED_COUNTS for k in target):  # into a model that is no averaging wrapper
        state_dict = without_averaged_count(state_dict)
    adapted = adapt_state_dict(state_dict, model, wrappers=wrappers)
    found = _check_filling_ties(adapted, target)
    if found[1]:  # unexpected keys: the model may sit under a prefix, or beside a copy of itself
        fits = fitting_prefixes(state_dict, target, wrappers=wrappers)
        name = type(unwrap_model(model)).__name__
        top = [] if found[0] or found[2] else ["the top level"]  # the top level fits too: an EMA copy beside it
        if len(fits) + len(top) > 1 and (strict or not top):
            pick = f"key={fits[-1]!r} (ckptkit convert: --key {fits[-1]} --model-only writes that part alone)"
            raise StateDictMismatchError(
                f"{source}: {len(fits) + len(top)} parts of the checkpoint fit {name} by name and shape "
                f"({', '.join(top + [repr(f) for f in fits])}); say which with {pick}"
                + (", or strict=False for the top level alone" if top else ""),
                missing=found[0],
                unexpected=found[1],
                mismatched=found[2],
            )
        if fits and not top:
            adapted = adapt_state_dict(select_prefix(state_dict, fits[0]), model, wrappers=wrappers)
            found = _check_filling_ties(adapted, target)
            warnings.warn(
                f"{source}: loaded the weights under {fits[0]!r}, the only part of the checkpoint that fits "
                f"{name} by name and shape; pass key={fits[0]!r} to say so and silence this",
                stacklevel=4,
            )
    missing, unexpected, mismatched = found
    if strict and (missing or unexpected or mismatched):
        raise StateDictMismatchError(
            _mismatch_message(source, model, found), missing=missing, unexpected=unexpected, mismatched=mismatched
        )
    if mismatched:
        # torch raises on shape mismatches even with strict=False; skipping them is what
        # strict=False users ask for.
        warnings.warn(f"{source}: skipped {len(mismatched)} key(s) with mismatched shapes", stacklevel=4)
        meta = getattr(adapted, "_metadata", None)
        for k, _, _ in mismatched:
            del adapted[k]
        if meta is not None:
            adapted._metadata = meta  # type: ignore[attr-defined]
    return adapted
