"""Which wrapper prefixes a state dict's keys carry: the names, their checks, their detection.

Wrappers put a path segment in front of every key (``module.`` for DataParallel and
DistributedDataParallel, ``_orig_mod.`` for torch.compile), in any nesting and also below the
root. This module only reads keys; :mod:`ckptkit.prefix`, the public home of every name here,
renames them. Nothing here imports torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ArgumentError

WRAPPER_PREFIXES: tuple[str, ...] = ("module.", "_orig_mod.")


def check_prefix(prefix: str) -> str:
    """``prefix`` itself, once it is a dotted module path ending in ``.``.

    Raises:
        ArgumentError: not a string, no trailing ``.``, empty, or an empty segment (``a..b.``).
    """
    if not isinstance(prefix, str) or not prefix.endswith(".") or prefix.strip(".") == "" or ".." in prefix:
        raise ArgumentError(f"prefix must be a dotted module path ending in '.', like 'module.'; got {prefix!r}")
    return prefix


def wrapper_names(wrappers: Iterable[str]) -> frozenset[str]:
    """The path segments of wrapper prefixes: ``{"module", "_orig_mod"}`` for the defaults."""
    return frozenset(check_prefix(w)[:-1] for w in wrappers)


def canonical_key(key: str, names: frozenset[str]) -> str:
    """``key`` without its wrapper segments (``names``): ``module.enc._orig_mod.w`` -> ``enc.w``."""
    return ".".join(p for p in key.split(".") if p not in names)


@dataclass(frozen=True)
class PrefixInfo:
    """What :func:`detect_prefixes` found.

    Attributes:
        leading: wrapper prefixes every key starts with, outermost first,
            e.g. ``("module.", "_orig_mod.")``.
        nested: wrapper paths found deeper inside keys, e.g. ``("encoder._orig_mod.",)``.
        common: a non-wrapper prefix every key shares after the wrappers (Lightning's
            ``model.``), or ``""``.
    """

    leading: tuple[str, ...] = ()
    nested: tuple[str, ...] = ()
    common: str = ""

    @property
    def prefix(self) -> str:
        """The leading wrappers as one string, e.g. ``"module._orig_mod."``."""
        return "".join(self.leading)

    @property
    def wrapped(self) -> bool:
        """True when any wrapper prefix was found."""
        return bool(self.leading or self.nested)


def detect_prefixes(
    state_dict: Mapping[str, Any] | Iterable[str], *, wrappers: Iterable[str] = WRAPPER_PREFIXES
) -> PrefixInfo:
    """Report which wrapper prefixes the keys of a state dict carry.

    Example:
        >>> detect_prefixes({"_orig_mod.module.fc.weight": 0}).leading
        ('_orig_mod.', 'module.')
    """
    names = wrapper_names(wrappers)
    split = [k.split(".") for k in state_dict]
    if not split:
        return PrefixInfo()
    leading: list[str] = []
    depth = 0
    while True:
        heads = {parts[depth] if len(parts) > depth + 1 else None for parts in split}
        if len(heads) != 1:
            break
        head = heads.pop()
        if head not in names:
            break
        leading.append(head + ".")
        depth += 1
    nested: dict[str, None] = {}
    for parts in split:
        for i in range(depth, len(parts) - 1):
            if parts[i] in names:
                nested[".".join(parts[: i + 1]) + "."] = None
    common: list[str] = []
    if len(split) > 1:
        i = depth
        while all(len(p) > i + 1 for p in split) and len({p[i] for p in split}) == 1:
            if split[0][i] in names:
                break
            common.append(split[0][i])
            i += 1
    return PrefixInfo(tuple(leading), tuple(nested), ".".join(common) + "." if common else "")
