"""What may be unpickled without trusting a file: torch's allowlist, plus what the caller allows.

``allow_globals`` takes classes or functions (``[argparse.Namespace]``) or their dotted names
(``["argparse.Namespace"]``, what the CLI's ``--allow-global`` passes); names are imported here,
since the caller named them.

Example:
    >>> import argparse
    >>> global_name(argparse.Namespace)
    'argparse.Namespace'
    >>> resolve_globals(["argparse.Namespace"]) == [argparse.Namespace]
    True
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

from .errors import ArgumentError, UnsafeCheckpointError, spell, summarize

AllowGlobals = Sequence[Any]  # classes, functions, (object, "name") pairs or "module.Name" strings


def global_name(obj: Any) -> str:
    """``module.qualname`` of a class or function (or of an ``(obj, name)`` pair's name)."""
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[1], str):
        return obj[1]
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"


def resolve_globals(allow: AllowGlobals) -> list[Any]:
    """The objects ``allow`` names, importing ``"module.Name"`` strings.

    Raises:
        ArgumentError: a name that cannot be imported.
    """
    out: list[Any] = []
    for item in allow:
        if not isinstance(item, str):
            out.append(item)
            continue
        module, _, attr = item.rpartition(".")
        try:
            obj: Any = importlib.import_module(module) if module else None
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError, ValueError) as e:
            option = spell(f"allow_globals=[{item!r}]", f"--allow-global {item}")
            raise ArgumentError(f"{option}: cannot import {item!r} ({type(e).__name__}: {e}); give module.Name of an importable class") from e
        out.append(obj)
    return out


def _torch_allowed() -> tuple[set[str], bool]:
    import torch

    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        allowed, fallback = set(_get_allowed_globals()), False
    except ImportError:  # the private allowlist moved: only for this message, trust torch.*
        allowed, fallback = {"collections.OrderedDict"}, True
    allowed.update(global_name(g) for g in torch.serialization.get_safe_globals())
    return allowed, fallback


def filter_unsafe(names: Sequence[str], allow: AllowGlobals = ()) -> list[str]:
    """The names torch's weights-only unpickler would refuse, less those in ``allow``."""
    allowed, fallback = _torch_allowed()
    allowed.update(global_name(g) for g in resolve_globals(allow))
    return [g for g in names if g not in allowed and not (fallback and g.startswith("torch."))]


def _options(unsafe: Sequence[str], joiner: str = " or ") -> str:
    shown = list(unsafe[:3])
    more = ", ..." if len(unsafe) > 3 else ""
    allow = spell(f"allow_globals=[{', '.join(shown)}{more}]", " ".join(f"--allow-global {g}" for g in shown) + more.replace(",", ""))
    return f"{allow}{joiner}{spell('trust=True', '--trust')}"


def needs_text(unsafe: Sequence[str], *, beyond: str = "torch's weights-only allowlist") -> str:
    """``names X, Y, beyond ...: loading it needs allow_globals=[X, Y] or trust=True`` (caller's spelling)."""
    beyond = "DCP's own metadata classes" if beyond == "DCP" else beyond
    return f"names {summarize(list(unsafe))}, beyond {beyond}: loading it needs {_options(unsafe)}"


MODULE_WALK = "what reading a pickled module's state_dict() needs"


def unsafe_error(
    source: str, unsafe: Sequence[str], *, where: str = "", plain_pickle: bool = False, beyond: str | None = None
) -> UnsafeCheckpointError:
    """The refusal for a file whose pickle needs ``unsafe`` globals, with both ways out.

    ``plain_pickle``: torch would read it with ``pickle.load`` (DCP's ``.metadata``), not its
    weights-only unpickler. ``beyond``: what the globals are outside of, if not that allowlist
    (:data:`MODULE_WALK` for a pickled module).
    """
    trust = spell("trust=True", "--trust")
    if not unsafe:
        return UnsafeCheckpointError(
            f"{source}: refused to load{where}: it needs globals outside torch's weights-only allowlist. "
            f"Unpickling them could run arbitrary code; if you trust this file, pass {trust}"
        )
    if beyond is None:
        beyond = "DCP's own metadata classes (torch reads them with plain pickle)" if plain_pickle else "torch's weights-only allowlist"
    return UnsafeCheckpointError(
        f"{source}: refused to load{where}: it needs {len(unsafe)} global(s) beyond {beyond}: "
        f"{summarize(list(unsafe))}. Unpickling them could run arbitrary code. If you trust this file, "
        f"allow just these types with {_options(unsafe, ', or pass ')}",
        unsafe,
    )
