"""``ckptkit convert``: rename wrapper prefixes, optionally change format, never lose data.

The fast path (torch zip, safetensors, and DCP folders whose chunks are contiguous pieces of
their tensors, as FSDP2's) never imports torch: it rewrites names and copies tensor bytes as they
are, checking each against the CRC-32 the source records for it. Everything else (legacy files,
DCP chunks split along another dimension, files that need ``trust``, layouts the fast path does not model)
goes through torch, with the same renaming rules and the same write path; a torch zip or
safetensors source has its recorded CRC-32s checked before anything is written (torch checks none).
"""

from __future__ import annotations

import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ._layout import find_model_state, is_state_dict, replace_at
from ._safety import AllowGlobals
from ._write import format_for, write_to
from .errors import ArgumentError, spell, summarize
from .formats import dcpstream as dcps
from .formats import rewrite as fp
from .formats.atomic import atomic_write
from .formats.detect import DCP, SAFETENSORS, ZIP, Format, check_exists, detect_format
from .formats.integrity import check_recorded_crcs
from .formats.safetensors import parse_aliases, read_header
from .formats.torchpickle import UnsupportedGlobal
from .prefix import detect_prefixes, rewrite_prefixes


@dataclass
class ConvertReport:
    """What :func:`convert_checkpoint` did.

    Attributes:
        source, destination: the paths.
        source_format, destination_format: e.g. ``torch-zip``, ``safetensors``.
        weights_at: where the weights were in the source (``""`` for the top level).
        tensors: number of weight tensors.
        renamed: how many weight keys changed name.
        prefix_before, prefix_after: the leading part of the renamed keys before and after
            (``"module."`` and ``""`` for DDP -> single); both the leading wrappers when none
            was renamed.
        dropped: top-level entries not written (with ``model_only``).
        left: other entries that also hold wrapped weights (an EMA copy), left as they were;
            convert them with ``key=``.
        tied: for a safetensors output, ``"alias is target"`` for each tensor stored once and
            re-tied on load (``safetensors.torch.load_model`` or ckptkit's loaders do that).
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
    left: list[str] = field(default_factory=list)
    tied: list[str] = field(default_factory=list)
    fast: bool = True
    fallback_reason: str = ""
    bytes: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _dcp_flag() -> str:
    return spell('format="dcp"', "--format dcp")


def _check_paths(src: Path, dst: Path, force: bool, format: Literal["dcp"] | None) -> Format:
    if format not in (None, DCP):
        raise ArgumentError(f"format must be 'dcp' or None (the format DST's suffix names), not {format!r}")
    if format is None and dst.is_dir():
        raise ArgumentError(
            f"{dst} is a folder; convert writes one file, so give its path, e.g. {dst / (src.stem + '.pt')} "
            f"(or write a DCP folder with {_dcp_flag()})"
        )
    if format == DCP and dst.exists() and not dst.is_dir():
        raise ArgumentError(f"{dst} is a file; {_dcp_flag()} writes a folder, so give a folder path")
    fmt = DCP if format == DCP else format_for(dst, default=None)
    if dst.exists():
        if src.exists() and os.path.samefile(src, dst):
            raise ArgumentError(f"{dst} is the source file; write the result to another path (SRC is never modified)")
        if not force:
            raise ArgumentError(f"{dst} exists; pass {spell('force=True', '--force')} to replace it")
    return fmt


def convert_checkpoint(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    to: Literal["single", "ddp", "keep"] = "single",
    strip: Iterable[str] = (),
    add: Iterable[str] = (),
    model_only: bool = False,
    key: str | None = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    weights_only: bool | None = None,
    format: Literal["dcp"] | None = None,
) -> ConvertReport:
    """Rewrite a checkpoint's weight names for another wrapping, and its format by suffix.

    Only the model weights are renamed; in a training checkpoint every other entry
    (optimizer state keyed by parameter index, scheduler, epoch...) is kept as it was, unless
    ``model_only`` asks for the weights alone. ``dst`` is written atomically and never
    replaces ``src``.

    Every tensor byte is checked against the CRC-32 the source records for it (a torch zip's
    records; ckptkit's per-tensor CRC-32s in safetensors it wrote; each DCP chunk's zip record) as
    it is copied, so a damaged source fails with :class:`~ckptkit.errors.CheckpointFormatError`
    naming each damaged tensor, and ``dst`` is not written. Legacy files and safetensors files from
    other writers record no CRC-32s, so there is nothing to check their bytes against. A DCP
    folder is copied chunk by chunk, in little memory at any size, unless its chunks are split
    along a dimension other than the first (then torch loads it whole; ``fallback_reason`` says why).

    Args:
        src: torch zip or legacy file, safetensors file, or DCP folder.
        dst: output path; ``.safetensors`` writes safetensors, ``.pt .pth .bin .ckpt .tar`` torch
            zip (suffixes in any case).
        to: ``"single"`` (remove ``module.``/``_orig_mod.``), ``"ddp"`` (then add ``module.``)
            or ``"keep"``; see :func:`ckptkit.prefix.rewrite_prefixes`.
        strip: further prefixes to remove (e.g. Lightning's ``"model."``).
        add: prefixes to add.
        model_only: write only the model state dict (not torch's ``weights_only``, which is
            about unpickling; ckptkit always loads safely unless ``trust``).
        key: where the weights are, e.g. ``"ema"``.
        trust: allow arbitrary unpickling of ``src``; only for files you trust.
        allow_globals: classes (or ``"module.Name"`` strings) to admit when unpickling ``src``.
        force: replace an existing ``dst``.
        progress: called as ``progress(bytes_done_now, bytes_total)`` while copying.
        weights_only: the former name of ``model_only`` (deprecated).
        format: ``"dcp"`` writes ``dst`` as a torch.distributed.checkpoint folder (through DCP's
            own writer, after ckptkit's safe read of ``src``), which
            ``torch.distributed.checkpoint.load`` reads into a plain or an FSDP2 model; the
            folder appears complete or not at all. None: the format ``dst``'s suffix names.

    Returns:
        A :class:`ConvertReport`.

    Raises:
        CheckpointFormatError: ``src`` is damaged (its bytes differ from their recorded CRC-32s)
            or is not a checkpoint; ArgumentError, CheckpointNotFoundError, UnsafeCheckpointError,
            CheckpointWriteError as their names say.

    Example:
        >>> convert_checkpoint("ddp.pt", "single.pt")  # doctest: +SKIP
    """
    if weights_only is not None:
        warnings.warn("convert_checkpoint(weights_only=...) is now model_only=...", DeprecationWarning, stacklevel=2)
        model_only = model_only or weights_only
    if to not in ("single", "ddp", "keep"):
        raise ArgumentError(f"to must be 'single', 'ddp' or 'keep', not {to!r}")
    source, dest = Path(src), Path(dst)
    check_exists(source)
    out_fmt = _check_paths(source, dest, force, format)
    in_fmt = detect_format(source)
    job = _Job(source, dest, in_fmt, out_fmt, to, list(strip), list(add), model_only, key)
    total = source.stat().st_size if source.is_file() else sum(p.stat().st_size for p in source.glob("*.distcp"))
    report_progress = (lambda n: progress(n, total)) if progress else None
    reason = "trusted file: loaded with torch" if trust else "DCP output: written by torch.distributed.checkpoint" if out_fmt == DCP else ""
    if not reason and in_fmt in (ZIP, SAFETENSORS, DCP):
        try:
            view = dcps.open_dcp(source) if in_fmt == DCP else fp.open_source(source, in_fmt)
            try:
                return job.run(view.obj, _is_leaf(view), lambda f, obj, sd: _fast_write(f, view, obj, sd, in_fmt, out_fmt, report_progress))
            finally:
                view.close()
        except UnsupportedGlobal as e:
            reason = f"{e.name} is not modelled by the fast path: loaded with torch"
        except fp.NeedsTorch as e:
            reason = f"{e}: loaded with torch"
    elif not reason:
        reason = f"{in_fmt} input: loaded with torch"
    from ._read import read_checkpoint  # deferred: torch is imported only when this path is taken

    obj = read_checkpoint(source, map_location="cpu", trust=trust, allow_globals=allow_globals)
    # torch.load checks no CRC-32: check them before writing (after loading, so an unsafe file is refused at once)
    check_recorded_crcs(source, in_fmt, progress=report_progress)
    report = job.run(obj, None, lambda f, obj, state: write_to(f, state if out_fmt == SAFETENSORS else obj, out_fmt, dest), force)
    report.fast, report.fallback_reason = False, reason
    return report


@dataclass
class _Job:
    source: Path
    dest: Path
    in_fmt: Format
    out_fmt: Format
    to: Literal["single", "ddp", "keep"]
    strip: list[str]
    add: list[str]
    model_only: bool
    key: str | None

    def run(self, obj: Any, is_tensor: Any, write: Callable[[Any, Any, Any], None], force: bool = False) -> ConvertReport:
        path, state = find_model_state(obj, key=self.key, is_tensor=is_tensor, source=str(self.source))
        new_state = rewrite_prefixes(state, to=self.to, strip=self.strip, add=self.add)
        others = [str(k) for k in obj if k != path[0]] if path and isinstance(obj, Mapping) else []
        if self.out_fmt == SAFETENSORS and others and not self.model_only:
            raise ArgumentError(
                f"{self.source} holds {summarize(others)} besides the weights, and safetensors stores tensors only; "
                f"pass {spell('model_only=True', '--model-only')} to write just the model weights"
            )
        out = new_state if self.model_only else replace_at(obj, path, new_state)
        if self.out_fmt == DCP:
            from ._dcpwrite import write_dcp  # deferred: torch is imported only when this path is taken

            size = write_dcp(out, self.dest, replace=force)
        else:
            with atomic_write(self.dest) as f:
                write(f, out, new_state)
            size = self.dest.stat().st_size
        before, after = renamed_prefixes(list(state), list(new_state))
        return ConvertReport(
            source=str(self.source),
            destination=str(self.dest),
            source_format=self.in_fmt,
            destination_format=self.out_fmt,
            weights_at="/".join(path),
            tensors=len(new_state),
            renamed=sum(a != b for a, b in zip(state, new_state, strict=True)),
            prefix_before=before,
            prefix_after=after,
            dropped=others if self.model_only else [],
            left=[] if self.model_only else _other_wrapped_weights(obj, path, is_tensor),
            tied=_tied(self.dest) if self.out_fmt == SAFETENSORS else [],
            bytes=size,
        )


def _other_wrapped_weights(obj: Any, path: tuple[str, ...], is_tensor: Any) -> list[str]:
    """Where else ``obj`` holds a state dict with wrapper prefixes (an EMA copy, a teacher)."""
    found: list[str] = []
    todo: list[tuple[tuple[str, ...], Any]] = [((), obj)]
    while todo:
        where, node = todo.pop(0)
        if not isinstance(node, Mapping) or len(where) > 3:
            continue
        if where and where != path and is_state_dict(node, is_tensor) and detect_prefixes(node).wrapped:
            found.append("/".join(where))
            continue
        todo += [((*where, str(k)), v) for k, v in node.items() if (*where, str(k)) != path]
    return found


def _tied(dest: Path) -> list[str]:
    with open(dest, "rb") as f:
        header, _ = read_header(f, source=str(dest))
    meta = header.pop("__metadata__", None) or {}
    return [f"{alias} is {target}" for _, alias, target in parse_aliases(meta, header, str(dest))]


def renamed_prefixes(before: Sequence[str], after: Sequence[str]) -> tuple[str, str]:
    """The leading part most renamed keys lost and gained: ``("module.", "")`` for DDP -> single.

    Example:
        >>> renamed_prefixes(["fc.w", "fc.b"], ["model.fc.w", "model.fc.b"])
        ('', 'model.')
    """
    changes: Counter[tuple[str, str]] = Counter()
    for a, b in zip(before, after, strict=True):
        if a == b:
            continue
        x, y = a.split("."), b.split(".")
        same = 0
        while same < min(len(x), len(y)) and x[-1 - same] == y[-1 - same]:
            same += 1
        changes[(".".join(x[: len(x) - same]) + "." if len(x) > same else "",
                 ".".join(y[: len(y) - same]) + "." if len(y) > same else "")] += 1  # fmt: skip
    if not changes:
        lead = detect_prefixes(before).prefix
        return lead, lead
    return changes.most_common(1)[0][0]


def _is_leaf(src: Any) -> Callable[[Any], bool]:
    return dcps.is_leaf if isinstance(src, dcps.DcpSource) else fp.is_leaf


def _fast_write(f: Any, src: Any, obj: Any, state: Any, in_fmt: str, out_fmt: str, progress: Any) -> None:
    if in_fmt == DCP and out_fmt == SAFETENSORS:  # tensors as pieces of .distcp files, copied in order
        dcps.write_safetensors(f, src, state, progress)
    elif in_fmt == DCP:
        dcps.write_torch_zip(f, src, obj, progress)
    elif out_fmt == SAFETENSORS:
        if in_fmt == SAFETENSORS:
            fp.rename_safetensors(f, src, state, progress)
        else:
            fp.write_safetensors(f, src, state, progress)
    else:
        fp.write_torch_zip(f, src, obj, progress)
