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

import contextlib
import importlib
import importlib.util
import os
import pickle
import re
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import ArgumentError, UnsafeCheckpointError, cause, spell, summarize
from ...io.fileio import local_file
from ..detect import sniff
from ..torchzip.bounds import check_storage_bounds
from ..torchzip.detect import LEGACY, TORCH_FILES
from .scan import checkpoint_globals

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
            raise ArgumentError(
                f"{option}: cannot import {item!r} ({type(e).__name__}: {e}); give module.Name of an importable class"
            ) from e
        # torch admits a global under the name the pickle spells; a re-exported name (numpy 1's
        # numpy.core.multiarray._reconstruct, numpy 2's numpy._core...) must keep the caller's spelling.
        out.append(obj if global_name(obj) == item else (obj, item))
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
    if not names:  # no global to judge: torch's allowlist is not needed (nor torch imported for it)
        return []
    allowed, fallback = _torch_allowed()
    allowed.update(global_name(g) for g in resolve_globals(allow))
    return [g for g in names if g not in allowed and not (fallback and g.startswith("torch."))]


def _options(unsafe: Sequence[str], joiner: str = " or ") -> str:
    # Every name, never an elided "...": the advice is meant to be pasted back as it stands.
    allow = spell(f"allow_globals=[{', '.join(unsafe)}]", " ".join(f"--allow-global {g}" for g in unsafe))
    return f"{allow}{joiner}{spell('trust=True', '--trust')}"


def needs_text(unsafe: Sequence[str], *, beyond: str = "torch's weights-only allowlist") -> str:
    """``names X, Y, beyond ...: loading it needs allow_globals=[X, Y] or trust=True`` (caller's spelling)."""
    beyond = "DCP's own metadata classes" if beyond == "DCP" else beyond
    return f"names {summarize(list(unsafe))}, beyond {beyond}: loading it needs {_options(unsafe)}"


MODULE_WALK = "what reading a pickled module's state_dict() needs"


def unsafe_error(
    source: str,
    unsafe: Sequence[str],
    *,
    where: str = "",
    plain_pickle: bool = False,
    beyond: str | None = None,
    loads: bool = True,
    why: str = "",
) -> UnsafeCheckpointError:
    """The refusal for a file whose pickle needs ``unsafe`` globals, with both ways out.

    ``plain_pickle``: torch would read it with ``pickle.load`` (DCP's ``.metadata``), not its
    weights-only unpickler. ``beyond``: what the globals are outside of, if not that allowlist
    (:data:`MODULE_WALK` for a pickled module). ``loads=False``: allowing them is not enough
    (``why``: torch's reason), so only trusting the file is advised.

    Example:
        >>> str(unsafe_error("a.pt", ["argparse.Namespace"])).endswith("or pass trust=True")
        True
    """
    trust = spell("trust=True", "--trust")
    if not unsafe or not loads:
        if unsafe:  # allowing them would not be enough: advise only what works
            what = f"it needs {summarize(list(unsafe))}, beyond torch's weights-only allowlist, and even with them allowed "
            what += f"torch's weights-only unpickler cannot build it ({why or 'see torch.load'})"
        else:
            what = (
                f"torch's weights-only unpickler cannot build it ({why})"
                if why
                else "it needs globals outside torch's weights-only allowlist"
            )
        return UnsafeCheckpointError(
            f"{source}: refused to load{where}: {what}. Unpickling it could run arbitrary code; if you trust this file, pass {trust}",
            unsafe,
        )
    if beyond is None:
        beyond = (
            "DCP's own metadata classes (torch reads them with plain pickle)"
            if plain_pickle
            else "torch's weights-only allowlist"
        )
    return UnsafeCheckpointError(
        f"{source}: refused to load{where}: it needs {len(unsafe)} global(s) beyond {beyond}: "
        f"{summarize(list(unsafe))}. Unpickling them could run arbitrary code. If you trust this file, "
        f"allow just these types with {_options(unsafe, ', or pass ')}",
        unsafe,
    )


# -- what a weights-only load needs, found by trying it -----------------------------------------

# numpy's own builders of arrays, scalars, dtypes and RNG states: the one place where what a pickle
# names is not all a load needs (numpy.dtype("f8") builds a numpy.dtypes.Float64DType, which torch
# must admit too). The probe runs these for real, chosen here and never by the file, so the types
# they build come to light; every other name the file gives is an inert stand-in.
_VALUE_BUILDERS = frozenset(
    {
        "numpy.dtype",
        "numpy.ndarray",
        "numpy.core.multiarray._reconstruct",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray.scalar",
        "numpy._core.multiarray.scalar",
        "numpy.random._pickle.__randomstate_ctor",
        "numpy.random._pickle.__bit_generator_ctor",
        "numpy.random._pickle.__generator_ctor",
        "numpy.random._mt19937.MT19937",
        "numpy.random._pcg64.PCG64",
        "numpy.random._pcg64.PCG64DXSM",
        "numpy.random._philox.Philox",
        "numpy.random._sfc64.SFC64",
    }
)
_BLOCKED = ("sys", "os", "posix", "nt")  # torch refuses their globals even when allowed
_TRIES = 16  # each try admits at least one more name; a file needing more is told to pass trust
_GLOBAL = re.compile(r"GLOBAL (\S+) was not an allowed global")
_BUILT = re.compile(r"(?:Can only build|Can only create new object).*but got <class '([\w.]+)'>")


@dataclass(frozen=True)
class Needs:
    """What a weights-only ``torch.load`` of a file needs beyond torch's allowlist and the caller's.

    Attributes:
        names: the globals to allow, ``module.Name``, the static scan's first and any the load found.
        loads: the load went through with them allowed, so advising them works.
        why: torch's reason, when allowing them is not enough.
    """

    names: tuple[str, ...]
    loads: bool = True
    why: str = ""


class _Inert:
    """Stands in for a global the caller has not allowed: accepts any arguments and state, runs nothing."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(cls)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass


def _admitted(name: str, real: set[str], trusted: set[str]) -> Any:
    """What the probe gives torch for ``name``: a real object only for numpy's value builders and
    types they built (found in modules already imported), else a stand-in of that name."""
    module, _, attr = name.rpartition(".")
    obj: Any = None
    if name in _VALUE_BUILDERS or re.fullmatch(r"numpy\.dtypes\.\w+DType", name):
        with contextlib.suppress(ArgumentError):
            obj = resolve_globals([name])[0]
    elif name in real and module.split(".")[0] in trusted:
        obj = sys.modules.get(module)  # no import: an instance of it exists, so its module is loaded
        for part in attr.split(".") if obj is not None else ():
            obj = getattr(obj, part, None)
    if obj is None:
        obj = type(attr.split(".")[-1], (_Inert,), {"__module__": module, "__qualname__": attr})
    return obj if isinstance(obj, tuple) else (obj, name)


def _builtin_name(name: str) -> str:
    return name if "." in name else f"builtins.{name}"  # torch's message drops "builtins."


def torch_reason(e: BaseException) -> str:
    """Torch's reason for a failed load, without its boilerplate; never empty (at least the exception's type).

    Example:
        >>> torch_reason(ValueError("Weights only load failed. WeightsUnpickler error: \\n\\nbad opcode"))
        'bad opcode'
    """
    return cause(e, typed=False)


def needed_globals(
    path: str | os.PathLike[str], allow: AllowGlobals = (), *, first_guess: Sequence[str] | None = None
) -> Needs:
    """The globals a weights-only load of torch file ``path`` needs beyond torch's allowlist and ``allow``.

    The static scan is the first guess; then torch's own weights-only unpickler loads the file
    (storages on the meta device: nothing is read or allocated for them) with those names
    admitted, and each "Unsupported global" or unbuildable type it meets joins the set, until it
    loads or ``_TRIES`` run out. Only numpy's value builders and what ``allow`` names run for real.

    Raises:
        CheckpointFormatError: the file is damaged where the scan or the bounds check reads.

    Example:
        >>> needed_globals("mmengine.pth").names  # doctest: +SKIP
        ('numpy._core.multiarray.scalar', 'numpy.dtype', 'numpy.dtypes.Float64DType', ...)
    """
    names = filter_unsafe(checkpoint_globals(path) if first_guess is None else first_guess, allow)
    torch_file = sniff(path, TORCH_FILES)
    if torch_file is None or importlib.util.find_spec("torch") is None:
        return Needs(tuple(names))
    fmt = torch_file.name
    import torch

    path = local_file(path)  # torch opens the path itself
    with open(path, "rb") as f:
        check_storage_bounds(path, fmt, file=f)
    user = resolve_globals(allow)
    trusted = {"numpy", *(global_name(g).split(".")[0] for g in user)}
    real: set[str] = set()
    for _ in range(_TRIES):
        blocked = [n for n in names if n.split(".")[0] in _BLOCKED]
        if blocked:
            return Needs(tuple(names), False, f"torch refuses {summarize(blocked)} even when allowed")
        try:
            _try_load(torch, path, fmt, user + [_admitted(n, real, trusted) for n in names])
            return Needs(tuple(names))
        except pickle.UnpicklingError as e:
            found = _GLOBAL.search(str(e)) or _BUILT.search(str(e))
            if found is None:
                return Needs(tuple(names), False, torch_reason(e))
            name = _builtin_name(found.group(1))
            if found.re is _BUILT:  # a type a real builder made: admit the real type next time
                if name in real or name.split(".")[0] not in trusted:  # admitted and still refused, or not ours to run
                    return Needs(
                        tuple(dict.fromkeys([*names, name])), name not in real, torch_reason(e) if name in real else ""
                    )
                real.add(name)
            elif name in names:
                return Needs(tuple(names), False, torch_reason(e))
            names = list(dict.fromkeys([*names, name]))
        except Exception as e:  # what the stand-ins cannot model: the allowed load may still work
            return Needs(tuple(names), True, torch_reason(e))
    return Needs(tuple(names), False, f"it still needs more globals after {_TRIES} tries")


def _try_load(torch: Any, path: str | os.PathLike[str], fmt: str, admitted: list[Any]) -> None:
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.serialization.safe_globals(admitted))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")
        if fmt == LEGACY:  # torch's legacy loader allocates storages unless tensors are fake
            from torch._subclasses.fake_tensor import FakeTensorMode

            stack.enter_context(FakeTensorMode())
        torch.load(path, map_location="meta", weights_only=True)
