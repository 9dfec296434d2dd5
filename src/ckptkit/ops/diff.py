"""``ckptkit diff``: do two checkpoints hold the same weights, whatever their format and prefixes?"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..formats.hf.index import shard_note
from ..formats.pickles.safety import AllowGlobals
from ..formats.producers import AVERAGED_COUNTS, averaged_count
from ..model.layout import find_model_state
from ..model.unwrap import without_averaged_count
from ..prefix import rewrite_prefixes


@dataclass
class TensorDiff:
    name: str
    max_abs_diff: float | None  # None when shapes or dtypes differ
    a_shape: list[int]
    b_shape: list[int]
    a_dtype: str
    b_dtype: str
    reason: str  # "values", "shape" or "dtype"


@dataclass
class DiffReport:
    """What :func:`diff_checkpoints` found; ``equal`` decides the exit code."""

    a: str
    b: str
    compared: int = 0
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    differences: list[TensorDiff] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    notes: list[str] = field(default_factory=list)  # e.g. A is one shard of a sharded checkpoint

    @property
    def equal(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differences)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "equal": self.equal}


def _weights(path: str, key: str | None, trust: bool, allow_globals: AllowGlobals, option: str) -> Any:
    from .read import read_checkpoint  # deferred: diff is reached from the CLI, which starts without torch

    obj = read_checkpoint(path, map_location="cpu", trust=trust, allow_globals=allow_globals)
    return find_model_state(obj, key=key, source=path, option=option)[1]


def _unwrapped(path: str, state: Any, other: Any, notes: list[str], strip: list[str]) -> Any:
    """The weights as a plain model names them, each ``strip`` prefix removed where a key has it.
    An averaging wrapper's count is set aside (and said so) where the other side has none, as
    convert unwraps it; two averages compare counts."""
    count = averaged_count(state)
    if count is not None and averaged_count(other) != count:
        notes.append(f"{path}: {count} ({AVERAGED_COUNTS[count]}) set aside: a plain model has no such buffer")
        state = without_averaged_count(state)
    return rewrite_prefixes(state, to="single", strip=strip)


def _compare(name: str, x: Any, y: Any, atol: float, rtol: float) -> TensorDiff | None:
    import torch

    shapes = (list(x.shape), list(y.shape))
    dtypes = (str(x.dtype).removeprefix("torch."), str(y.dtype).removeprefix("torch."))
    if shapes[0] != shapes[1]:
        return TensorDiff(name, None, *shapes, *dtypes, "shape")
    if dtypes[0] != dtypes[1]:
        return TensorDiff(name, None, *shapes, *dtypes, "dtype")
    if torch.equal(x, y):
        return None
    if x.is_floating_point() or x.is_complex():
        # float64 (or complex128) so float8/bfloat16 work and the difference itself is exact.
        wide = torch.complex128 if x.is_complex() else torch.float64
        a, b = x.to(wide), y.to(wide)
        close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
        if bool(close.all()):
            return None
        worst = float((a - b).abs()[~close].max())
        return TensorDiff(name, worst if worst == worst else float("inf"), *shapes, *dtypes, "values")
    worst = float((x.long() - y.long()).abs().max()) if x.dtype != torch.bool else 1.0
    if worst <= atol:
        return None
    return TensorDiff(name, worst, *shapes, *dtypes, "values")


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    *,
    atol: float = 0.0,
    rtol: float = 0.0,
    key_a: str | None = None,
    key_b: str | None = None,
    strip: Iterable[str] = (),
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    progress: Callable[[int, int], None] | None = None,
) -> DiffReport:
    """Compare the model weights of two checkpoints across formats and wrapper prefixes.

    Keys are compared after removing wrapper prefixes on both sides, so a DDP ``.pt`` and
    its single-device ``.safetensors`` compare equal; each ``strip`` prefix (e.g. PEFT's
    ``base_model.model.``, Lightning's ``model.``) is removed too, on either side where a key has
    it, as ``convert --strip`` removes it. A tensor differs when its shape or dtype
    differ, or some element exceeds ``atol + rtol * |b|`` (exact equality by default).
    ``progress(bytes_compared_now, bytes_total)`` is called after each tensor pair.

    Example:
        >>> diff_checkpoints("ddp.pt", "single.safetensors").equal  # doctest: +SKIP
        True
    """
    pa, pb = os.fspath(a), os.fspath(b)
    report = DiffReport(pa, pb, atol=atol, rtol=rtol)
    report.notes = [note for p in (pa, pb) if os.path.isfile(p) and (note := shard_note(Path(p)))]
    sa, sb = _weights(pa, key_a, trust, allow_globals, "key_a"), _weights(pb, key_b, trust, allow_globals, "key_b")
    strip = list(strip)
    wa, wb = _unwrapped(pa, sa, sb, report.notes, strip), _unwrapped(pb, sb, sa, report.notes, strip)
    report.only_in_a = [k for k in wa if k not in wb]
    report.only_in_b = [k for k in wb if k not in wa]
    pairs = [(name, x, wb[name]) for name, x in wa.items() if name in wb]
    total = sum(_nbytes(x) + _nbytes(y) for _, x, y in pairs)
    for name, x, y in pairs:  # memory-mapped: comparing is what reads the bytes
        report.compared += 1
        d = _compare(name, x, y, atol, rtol)
        if d is not None:
            report.differences.append(d)
        if progress is not None:
            progress(_nbytes(x) + _nbytes(y), total)
    return report


def _nbytes(t: Any) -> int:
    return int(t.numel()) * int(t.element_size())
