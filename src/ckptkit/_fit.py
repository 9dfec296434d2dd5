"""Fit a state dict to a model of any wrapping, and report every key that does not fit at once."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from .errors import StateDictMismatchError, summarize
from .prefix import WRAPPER_PREFIXES, adapt_state_dict, detect_prefixes


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
    model.load_state_dict(fit_to_model(model, state_dict, strict=strict, wrappers=wrappers, source=source), strict=strict)


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

    Raises:
        StateDictMismatchError: with ``strict``, every missing, unexpected or mis-shaped key.
    """
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
        warnings.warn(f"{source}: skipped {len(mismatched)} key(s) with mismatched shapes", stacklevel=4)
        meta = getattr(adapted, "_metadata", None)
        for k, _, _ in mismatched:
            del adapted[k]
        if meta is not None:
            adapted._metadata = meta  # type: ignore[attr-defined]
    return adapted
