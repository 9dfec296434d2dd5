"""``ckptkit convert``: rename wrapper prefixes, optionally change format, never lose data.

The fast path (torch zip and safetensors) never imports torch: it rewrites names and copies
tensor bytes as they are. Everything else (legacy files, DCP folders, files that need
``trust``, layouts the fast path does not model) goes through torch, with the same renaming
rules and the same atomic write.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._atomic import atomic_write
from ._errors import ArgumentError, summarize
from ._formats import SAFETENSORS, ZIP, check_exists, detect_format
from ._layout import find_model_state, replace_at
from ._prefix import detect_prefixes, rewrite_prefixes

OUTPUT_FORMATS = {".pt": ZIP, ".pth": ZIP, ".bin": ZIP, ".ckpt": ZIP, ".tar": ZIP, ".safetensors": SAFETENSORS}


@dataclass
class ConvertReport:
    """What :func:`convert_checkpoint` did.

    Attributes:
        source, destination: the paths.
        source_format, destination_format: e.g. ``torch-zip``, ``safetensors``.
        weights_at: where the weights were in the source (``""`` for the top level).
        tensors: number of weight tensors.
        renamed: how many weight keys changed name.
        prefix_before, prefix_after: leading wrapper prefixes of the weights before and after.
        dropped: top-level entries not written (with ``weights_only``).
        fast: True when torch was never imported (names rewritten, tensor bytes copied).
        fallback_reason: why the torch path was used, when it was.
        bytes: size of the written file.
    """

    source: str
    destination: str
    source_format: str
    destination_format: str
    weights_at: str
    tensors: int
    renamed: int
    prefix_before: str
    prefix_after: str
    dropped: list[str] = field(default_factory=list)
    fast: bool = True
    fallback_reason: str = ""
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_paths(src: Path, dst: Path, force: bool) -> str:
    fmt = OUTPUT_FORMATS.get(dst.suffix.lower())
    if fmt is None:
        raise ArgumentError(
            f"{dst}: unknown output suffix {dst.suffix or '(none)'!r}; use one of {', '.join(OUTPUT_FORMATS)}"
        )
    if dst.exists():
        if src.exists() and os.path.samefile(src, dst):
            raise ArgumentError(f"{dst} is the source file; write the result to another path (SRC is never modified)")
        if not force:
            raise ArgumentError(f"{dst} exists; pass --force (force=True) to replace it")
    return fmt


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: str = "single",
    strip: Iterable[str] = (),
    add: Iterable[str] = (),
    weights_only: bool = False,
    key: str | None = None,
    trust: bool = False,
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ConvertReport:
    """Rewrite a checkpoint's weight names for another wrapping, and its format by suffix.

    Only the model weights are renamed; in a training checkpoint every other entry
    (optimizer state keyed by parameter index, scheduler, epoch...) is kept as it was, unless
    ``weights_only`` asks for the weights alone. ``dst`` is written atomically and never
    replaces ``src``.

    Args:
        src: torch zip or legacy file, safetensors file, or DCP folder.
        dst: output path; ``.safetensors`` writes safetensors, ``.pt/.pth/.bin/.ckpt`` torch zip.
        to: ``"single"`` (remove ``module.``/``_orig_mod.``), ``"ddp"`` (then add ``module.``)
            or ``"keep"``; see :func:`rewrite_prefixes`.
        strip: further prefixes to remove (e.g. Lightning's ``"model."``).
        add: prefixes to add.
        weights_only: write only the model state dict.
        key: where the weights are, e.g. ``"ema"``.
        trust: allow arbitrary unpickling of ``src``; only for files you trust.
        force: replace an existing ``dst``.
        progress: called as ``progress(bytes_done_now, bytes_total)`` while copying.

    Returns:
        A :class:`ConvertReport`.

    Example:
        >>> convert_checkpoint("ddp.pt", "single.pt")  # doctest: +SKIP
    """
    source, dest = Path(src), Path(dst)
    check_exists(source)
    out_fmt = _check_paths(source, dest, force)
    in_fmt = detect_format(source)
    strip, add = list(strip), list(add)
    total = source.stat().st_size if source.is_file() else 0
    report_progress = (lambda n: progress(n, total)) if progress else None
    reason = "trusted file: loaded with torch" if trust else ""
    if not trust and in_fmt in (ZIP, SAFETENSORS):
        from . import _fastpath as fp
        from ._lazy_pickle import UnsupportedGlobal

        try:
            src_view = fp.open_source(source, in_fmt)
            try:
                return _rewrite(src_view.obj, source, dest, in_fmt, out_fmt, to, strip, add, weights_only, key,
                                fp.is_leaf, lambda f, obj, sd: _fast_write(fp, f, src_view, obj, sd, in_fmt, out_fmt, report_progress))  # fmt: skip
            finally:
                src_view.close()
        except UnsupportedGlobal as e:
            reason = f"{e.name} is not modelled by the fast path: loaded with torch"
        except fp.NeedsTorch as e:
            reason = f"{e}: loaded with torch"
    elif not reason:
        reason = f"{in_fmt} input: loaded with torch"
    from ._load import read_checkpoint

    obj = read_checkpoint(source, map_location="cpu", trust=trust)
    report = _rewrite(obj, source, dest, in_fmt, out_fmt, to, strip, add, weights_only, key, None, _torch_write(out_fmt))
    report.fast, report.fallback_reason = False, reason
    return report


def _rewrite(obj: Any, source: Path, dest: Path, in_fmt: str, out_fmt: str, to: str, strip: list[str], add: list[str],
             weights_only: bool, key: str | None, is_tensor: Any, write: Callable[[Any, Any, Any], None]) -> ConvertReport:  # fmt: skip
    path, state = find_model_state(obj, key=key, is_tensor=is_tensor, source=str(source))
    new_state = rewrite_prefixes(state, to=to, strip=strip, add=add)
    others = [str(k) for k in obj if k != path[0]] if path and isinstance(obj, Mapping) else []
    if out_fmt == SAFETENSORS and others and not weights_only:
        raise ArgumentError(
            f"{source} holds {summarize(others)} besides the weights, and safetensors stores tensors only; "
            "pass --weights-only (weights_only=True) to write just the model weights"
        )
    out = new_state if weights_only else replace_at(obj, path, new_state)
    with atomic_write(dest) as f:
        write(f, out, new_state)
    return ConvertReport(
        source=str(source),
        destination=str(dest),
        source_format=in_fmt,
        destination_format=out_fmt,
        weights_at="/".join(path),
        tensors=len(new_state),
        renamed=sum(a != b for a, b in zip(state, new_state, strict=True)),
        prefix_before=detect_prefixes(state).prefix,
        prefix_after=detect_prefixes(new_state).prefix,
        dropped=others if weights_only else [],
        bytes=dest.stat().st_size,
    )


def _fast_write(fp: Any, f: Any, src: Any, obj: Any, state: Any, in_fmt: str, out_fmt: str, progress: Any) -> None:
    if out_fmt == SAFETENSORS:
        if in_fmt == SAFETENSORS:
            fp.rename_safetensors(f, src, state, progress)
        else:
            fp.write_safetensors(f, src, state, progress)
    else:
        fp.write_torch_zip(f, src, obj, progress)


def _torch_write(out_fmt: str) -> Callable[[Any, Any, Any], None]:
    def write(f: Any, obj: Any, state: Any) -> None:
        if out_fmt == SAFETENSORS:
            from ._safetensors import save_tensors

            save_tensors(f, state)
        else:
            import torch

            torch.save(obj, f)

    return write
