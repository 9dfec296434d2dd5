"""``ckptkit check-adapter``: will this LoRA adapter apply to this base checkpoint, as PEFT loads it?

PEFT saves an adapter's tensors as ``base_model.model.<module>.lora_A.weight`` (and ``lora_B``),
``<module>`` named as in the base model's own state dict, and on load puts each into the module of
that name, with a warning at most for a key that names none: such a "dead" adapter loads and
changes nothing. This check reads the files only (the base's names and shapes, the adapter's
tensors and ``adapter_config.json``) and reports, as PEFT would meet them:

- adapter keys that name no base module, and the one ``convert`` that makes every key match
  (checked against the base before it is advised);
- base modules ``target_modules`` names that got no adapter tensors;
- shapes that do not fit (``lora_A`` ``[r, in]``, ``lora_B`` ``[out, r]``): how an adapter saved
  from one rank's slice shows;
- ``lora_B`` tensors that are all zero: PEFT initialises them so, and an adapter whose every
  ``lora_B`` is still zero changes nothing.

Example:
    >>> check_adapter("lora/", "base/").ok  # doctest: +SKIP
    True
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ArgumentError
from ..formats.pickles.safety import AllowGlobals
from ..formats.producers import LORA
from ..io.fileio import small_json
from ..model.layout import find_model_state
from ..prefix import rewrite_prefixes
from .inspect import inspect_checkpoint
from .read import read_checkpoint

PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's own names
CONFIG = "adapter_config.json"
_MAX_CONFIG = 1_000_000


@dataclass
class AdapterReport:
    """What :func:`check_adapter` found; ``ok`` decides the exit code. ``to_dict()`` is ``--json``."""

    adapter: str
    base: str
    modules: int = 0  # adapted modules whose keys match the base
    unmatched: list[str] = field(default_factory=list)  # adapter keys naming no base module
    fix: str = ""  # the convert that makes every key match, checked against the base
    untargeted: list[str] = field(default_factory=list)  # base modules target_modules names, with no adapter
    shapes: list[str] = field(default_factory=list)  # "key: [r, in] vs base [out, in]"
    zero_b: list[str] = field(default_factory=list)  # all-zero lora_B keys
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.unmatched or self.untargeted or self.shapes or self.zero_b)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def check_adapter(
    adapter: str | os.PathLike[str],
    base: str | os.PathLike[str],
    *,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
) -> AdapterReport:
    """Check a PEFT LoRA adapter (its folder, or ``adapter_model.safetensors`` / ``.bin``) against
    the base model checkpoint it is meant for (any format ckptkit reads), as PEFT will load it.

    Example:
        >>> r = check_adapter("lora/adapter_model.safetensors", "base/model.safetensors")  # doctest: +SKIP
        >>> r.unmatched, r.fix  # doctest: +SKIP
        (['base_model.model._orig_mod.model.layers.0.self_attn.q_proj.lora_A.weight', ...], 'ckptkit convert ...')

    Raises:
        ArgumentError: the adapter holds no LoRA tensors.
    """
    return read_adapter(adapter, base, trust=trust, allow_globals=allow_globals).report


@dataclass
class Adapter:
    """An adapter as :func:`read_adapter` found it: the check's report, its tensors (as saved) and
    its ``adapter_config.json`` ({} where there is none)."""

    report: AdapterReport
    tensors: dict[str, Any]
    config: dict[str, Any]
    base_shapes: dict[str, list[int]]  # the base's weights by the names a single-device model has

    def base_key(self, key: str) -> str | None:
        """The base weight adapter tensor ``key`` adapts; None where it adapts none."""
        return _base_key(key, self.base_shapes)


def read_adapter(
    adapter: str | os.PathLike[str],
    base: str | os.PathLike[str],
    *,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
) -> Adapter:
    """:func:`check_adapter`, keeping what it read for a merge (``convert --merge-adapter``).

    Example:
        >>> read_adapter("lora/", "base/").report.ok  # doctest: +SKIP
        True
    """
    ap, bp = Path(adapter), Path(base)
    report = AdapterReport(str(ap), str(bp))
    obj = read_checkpoint(ap, trust=trust, allow_globals=allow_globals, map_location="cpu")
    _, weights = find_model_state(obj, source=str(ap))
    lora = {k: v for k, v in weights.items() if lora_key(k)}
    if not lora:
        raise ArgumentError(
            f"{ap}: holds no LoRA tensors (<module>.lora_A.weight, <module>.lora_B.weight): not a PEFT LoRA adapter"
        )
    summary = inspect_checkpoint(bp, trust=trust, allow_globals=allow_globals)
    shapes = {t.name: list(t.shape) for t in summary.tensors}
    base_shapes = dict(zip(rewrite_prefixes(shapes, to="single"), shapes.values(), strict=True))
    config = _config(ap)
    report.unmatched = [k for k in lora if _base_key(k, base_shapes) is None]
    if report.unmatched:
        report.fix = _fix(ap, list(lora), base_shapes)
    fan_in_fan_out = config.get("fan_in_fan_out") is True
    ranks: dict[str, int] = {}
    for k, v in lora.items():
        m = lora_key(k)
        assert m is not None
        want = base_shapes.get(_base_key(k, base_shapes) or "")
        got = list(v.shape)
        if m["ab"] == "A" and len(got) == 2:
            ranks[m["module"]] = got[0]
        if want is None or len(want) != 2 or len(got) != 2:
            continue
        # PEFT takes a Linear's weight as [out, in] and a Conv1D's as [in, out], whatever fan_in_fan_out says.
        out_f, in_f = (want[1], want[0]) if fan_in_fan_out else (want[0], want[1])
        fits = (got[1] if m["ab"] == "A" else got[0]) in (want[0], want[1])
        if not fits:
            side = f"in_features {in_f}" if m["ab"] == "A" else f"out_features {out_f}"
            report.shapes.append(f"{k}: {got}, but its base module has {side} (base weight {want})")
        if m["ab"] == "B" and got[1] != ranks.get(m["module"], got[1]):
            report.shapes.append(f"{k}: rank {got[1]}, but its lora_A has rank {ranks[m['module']]}")
    for mod, n in ranks.items():
        r = per_module(config, "rank_pattern", "r", mod.removeprefix(PEFT_PREFIX))
        if isinstance(r, int) and n != r:
            report.shapes.append(f"{mod}.lora_A.weight: rank {n}, but {CONFIG} says r={r}")
    report.zero_b = [k for k, v in lora.items() if k.endswith(".lora_B.weight") and not bool(v.any())]
    if report.zero_b and len(report.zero_b) == sum(1 for k in lora if k.endswith(".lora_B.weight")):
        report.notes.append(
            "every lora_B is zero, as PEFT initialises them: this adapter changes nothing (saved before training, "
            "or its trained values were lost)"
        )
    matched = {lora_key(k)["module"] for k in lora if k not in report.unmatched}  # type: ignore[index]
    report.modules = len(matched)
    report.untargeted, why = _untargeted(config, base_shapes, matched)
    report.notes += why
    return Adapter(report, dict(weights), config, base_shapes)


def lora_key(key: str) -> re.Match[str] | None:
    """The match of a saved adapter's LoRA key (no adapter name in it, as save_pretrained writes it)."""
    m = LORA.match(key)
    return m if m is not None and m["adapter"] is None else None


def per_module(config: Mapping[str, Any], pattern: str, name: str, module: str) -> Any:
    """``config[name]`` for base module ``module`` as PEFT reads it: the value of the first key of
    ``config[pattern]`` (``rank_pattern``, ``alpha_pattern``) that matches the module's name or its
    last parts (PEFT's ``get_pattern_key``), else ``config[name]``.

    Example:
        >>> per_module({"r": 8, "rank_pattern": {"v_proj": 2}}, "rank_pattern", "r", "layers.0.attn.v_proj")
        2
    """
    table = config.get(pattern)
    if isinstance(table, Mapping):
        for key, value in table.items():
            if re.match(rf"(.*\.)?({key})$", module):  # each key compiles: _config checked it
                return value
    return config.get(name)


def _base_key(key: str, base: Mapping[str, Any]) -> str | None:
    """The base weight an adapter key adapts, as PEFT finds its module; None where it names none."""
    m = lora_key(key)
    if m is None or not key.startswith(PEFT_PREFIX):
        return None
    weight = f"{m['module'][len(PEFT_PREFIX) :]}.weight"
    return weight if weight in base else None


def _fix(adapter: Path, keys: list[str], base: Mapping[str, Any]) -> str:
    """The commands that rename every key to one PEFT matches (wrapper prefixes removed, PEFT's
    prefix added) into a new adapter folder, if a rename does; else ""."""
    folder = adapter if adapter.is_dir() else adapter.parent
    for add in ((), (PEFT_PREFIX,)):
        renamed = list(rewrite_prefixes(dict.fromkeys(keys), to="single", add=add))
        if all(_base_key(k, base) is not None for k in renamed):
            out = Path(f"{folder}-fixed")
            copy = f" && cp {folder / CONFIG} {out}/" if (folder / CONFIG).is_file() else ""
            flags = "".join(f" --add {p}" for p in add)
            return f"mkdir -p {out}{copy} && ckptkit convert {adapter} {out / 'adapter_model.safetensors'}{flags}"
    return ""


def _config(adapter: Path) -> dict[str, Any]:
    """The adapter's ``adapter_config.json`` ({} where there is none); its patterns must be regexes.

    Raises:
        ArgumentError: a ``rank_pattern`` / ``alpha_pattern`` key that is no regular expression.
    """
    path = (adapter if adapter.is_dir() else adapter.parent) / CONFIG
    found = small_json(path, limit=_MAX_CONFIG)
    config = found if isinstance(found, dict) else {}
    for pattern in ("rank_pattern", "alpha_pattern"):
        table = config.get(pattern)
        for key in table if isinstance(table, Mapping) else ():
            try:
                re.compile(rf"(.*\.)?({key})$")
            except re.error as e:
                raise ArgumentError(
                    f"{path}: {pattern} key {key!r} is not a regular expression PEFT can match ({e}); fix that key"
                ) from None
    return config


def _untargeted(config: Mapping[str, Any], base: Mapping[str, Any], adapted: set[str]) -> tuple[list[str], list[str]]:
    """Base modules ``target_modules`` names (as PEFT matches: a name, or its last parts; a string
    is a regex the whole name must match) that hold no adapter; and notes where it cannot tell."""
    targets = config.get("target_modules")
    if targets is None:
        return [], [f"no {CONFIG} with target_modules beside the adapter: which modules it should adapt is not checked"]
    limits = [k for k in ("layers_to_transform", "exclude_modules", "layers_pattern") if config.get(k)]
    if limits:
        return [], [f"{CONFIG} sets {', '.join(limits)}: which modules it should adapt is not checked"]
    modules = [k.removesuffix(".weight") for k, s in base.items() if k.endswith(".weight") and len(s) == 2]

    def named(module: str) -> bool:
        if isinstance(targets, str):
            return re.fullmatch(targets, module) is not None
        names: Iterable[Any] = targets if isinstance(targets, list) else []
        return any(isinstance(t, str) and (module == t or module.endswith("." + t)) for t in names)

    missing = [m for m in modules if named(m) and PEFT_PREFIX + m not in adapted]
    return missing, []
