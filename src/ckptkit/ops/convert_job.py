"""One convert once its source is open: the weights found, selected and renamed, written by the one
writer of the output's format (atomically; a folder by its own writer), and reported.

Example:
    >>> job = Job(Path("ddp.pt"), Path("single.pt"), "torch-zip", "torch-zip", "single", [], [], False, None)  # doctest: +SKIP
    >>> report = job.run(obj, is_leaf, write)  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ..errors import ArgumentError, spell, summarize
from ..formats import source as fp
from ..formats.cast import Cast
from ..formats.dcp import stream as dcps
from ..formats.deepspeed import stream as dss
from ..formats.detect import DCP, HF, SAFETENSORS, Format
from ..formats.entry import Entry, map_entries
from ..formats.hf.index import shard_note
from ..formats.hf.write import write_shards
from ..formats.integrity import check_written
from ..formats.producers import AVERAGED_COUNTS, averaged_count
from ..formats.safetensors.codec import write_safetensors
from ..formats.torchzip.writer import write_torch_zip
from ..io.atomic import atomic_write
from ..io.remote import exists, is_url, name_of, staged_read, unstaged
from ..io.upload import staged_write
from ..model.layout import find_model_state, replace_at
from ..model.unwrap import without_averaged_count
from ..prefix import rewrite_prefixes
from .reports import ConvertReport, other_wrapped_weights, renamed_prefixes, tied_names
from .write import format_for


@dataclass
class Job:
    source: Path
    dest: Path
    in_fmt: Format
    out_fmt: Format
    to: Literal["single", "ddp", "keep"]
    strip: list[str]
    add: list[str]
    model_only: bool
    key: str | None
    cast: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None  # the weights, cast (--dtype)
    finish: Callable[[Any], Any] | None = None  # what is written, made plain (--sanitize)

    def run(self, obj: Any, is_tensor: Any, write: Callable[[Any, Any, Any], Any]) -> ConvertReport:
        path, state = find_model_state(obj, key=self.key, is_tensor=is_tensor, source=str(self.source))
        # An AveragedModel's count goes with its wrapper: a plain model has no such buffer.
        count = averaged_count(state) if self.to != "keep" else None
        state = without_averaged_count(state) if count else state
        new_state = rewrite_prefixes(state, to=self.to, strip=self.strip, add=self.add)
        if self.cast is not None:  # after renaming: the report names tensors as they are written
            new_state = self.cast(new_state)
        others = [str(k) for k in obj if k != path[0]] if path and isinstance(obj, Mapping) else []
        if path and path[-1].endswith("."):  # key="student.": part of the weights
            if not self.model_only:
                raise ArgumentError(
                    f"{spell(f'key={self.key!r}', f'--key {self.key}')} selects part of {self.source}'s weights; "
                    f"add {spell('model_only=True', '--model-only')} to write that part alone, or rename it in place "
                    f"with {spell(f'strip=[{path[-1]!r}]', f'--strip {path[-1]}')}"
                )
            node = obj
            for part in path[:-1]:
                node = node[part]
            rest = sum(1 for k in node if not str(k).startswith(path[-1]))
            others = (others if len(path) > 1 else []) + [f"{rest} weight(s) outside {path[-1]}"] * bool(rest)
        if self.out_fmt in (SAFETENSORS, HF) and others and not self.model_only:
            raise ArgumentError(
                f"{self.source} holds {summarize(others)} besides the weights, and safetensors stores tensors only; "
                f"pass {spell('model_only=True', '--model-only')} to write just the model weights"
            )
        out = new_state if self.model_only else replace_at(obj, path, new_state)
        if self.finish is not None:  # on what is written only: what --model-only drops needs no change
            out = self.finish(out)
            new_state = out if self.model_only or not path else new_state
        written = None
        if self.out_fmt in (HF, DCP):  # a folder: its writer owns the temp folder and the swap
            written = write(None, out, new_state)
        else:
            with atomic_write(self.dest, check=lambda tmp: check_written(tmp, self.out_fmt, dest=self.dest)) as f:
                write(f, out, new_state)
        hf: Any = written if self.out_fmt == HF else None  # formats.hf.write.Written
        # Names as the source spells them: key="student." selected them with the prefix removed.
        chosen = path[-1] if path and path[-1].endswith(".") else ""
        names = [chosen + k for k in state]
        before, after = renamed_prefixes(names, list(new_state))
        notes = [note] if self.source.is_file() and (note := shard_note(self.source)) else []
        if count:
            keep = spell("to='keep'", "--to keep")
            notes.append(
                f"{count} ({AVERAGED_COUNTS[count]}) not written: a plain model has no such buffer; {keep} keeps it"
            )
        return ConvertReport(
            source=str(self.source),
            destination=str(self.dest),
            source_format=self.in_fmt,
            destination_format=self.out_fmt,
            weights_at="/".join(path),
            tensors=len(new_state),
            renamed=sum(a != b for a, b in zip(names, new_state, strict=True)),
            prefix_before=before,
            prefix_after=after,
            dropped=others if self.model_only else [],
            left=[] if self.model_only else other_wrapped_weights(obj, path, is_tensor),
            tied=tied_names(self.dest)
            if self.out_fmt == SAFETENSORS
            else [f"{a} is {b}" for a, b in hf.tied.items()]
            if hf
            else [],
            bytes=sum(f.stat().st_size for f in self.dest.iterdir())
            if self.dest.is_dir()
            else self.dest.stat().st_size,
            shards=len(hf.files) if hf else 0,
            notes=notes,
        )


def fast_write(
    f: Any, view: fp.Source | dcps.DcpSource | dss.DsSource, obj: Any, state: Any, job: Job, limit: int, progress: Any
) -> Any:
    """The torch-free path: the source's tensors as entries, into the one writer of the output's
    format; a byte that differs from its source's CRC-32 fails the whole output."""
    if isinstance(view, (dcps.DcpSource, dss.DsSource)):  # their leaves are entries already
        name, entry, meta = str(view.folder), (lambda v, _: v), {"format": "pt"}
    else:
        name, entry = str(view.path), (lambda v, k: view.entry(v, k) if fp.is_leaf(v) else v)
        meta = view.metadata or {} if view.fmt == SAFETENSORS else {"format": "pt"}
    written = None
    if job.out_fmt in (HF, SAFETENSORS):
        tensors = {k: entry(v, k) for k, v in state.items()}
        if job.out_fmt == HF:
            written = write_shards(
                job.dest, tensors, max_shard_size=limit, source=name, progress=progress, after=view.damage.raise_if_any
            )
        else:
            write_safetensors(f, tensors, meta, source=name, progress=progress)
    elif (
        isinstance(view, fp.Source) and view.zip is not None and job.cast is None
    ):  # storages copied as they are, views and all
        write_torch_zip(
            f, obj, records=view.records(), prefix=view.zip.prefix, byteorder=view.zip.byteorder, progress=progress
        )
    else:
        write_torch_zip(f, map_entries(obj, entry, lambda v: isinstance(v, Entry) or fp.is_leaf(v)), progress=progress)
    view.damage.raise_if_any()
    return written


def fast_cast(
    view: fp.Source | dcps.DcpSource | dss.DsSource, cast: Cast
) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The weights with each floating tensor ``cast`` wants wrapped to be cast as it is copied
    (:class:`~ckptkit.formats.cast.CastEntry`: torch-free, each source byte still checked); a
    torch zip is then written tensor by tensor, not storage by storage."""

    def run(state: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, v in state.items():
            e = view.entry(v, name) if isinstance(view, fp.Source) and fp.is_leaf(v) else v
            out[name] = cast.wrap(e, name) if isinstance(e, Entry) and cast.wants(e.dtype) else v
        return out

    return run


def convert_remote(
    src: str | os.PathLike[str], dst: str | os.PathLike[str], convert: Callable[..., ConvertReport], **options: Any
) -> ConvertReport:
    """``convert`` with either end a URL: the source staged in a local file; the output written and
    checked locally, then uploaded (whole or not at all: a failed upload leaves the previous
    object) and read back. Folder outputs (Hugging Face shards, DCP) to a URL are refused."""
    if is_url(dst):
        url = str(dst)
        if url.endswith("/") or options.get("max_shard_size") is not None or options.get("format") is not None:
            raise ArgumentError(
                f"{url}: ckptkit writes single objects to URLs, not folders (Hugging Face shards, DCP); write the folder "
                f"to a local path and copy it (e.g. `aws s3 cp --recursive`), or name one object, e.g. {url.rstrip('/')}/model.safetensors"
            )
        format_for(name_of(url), default=None)  # an unknown suffix fails before anything is read
        if os.fspath(src) == url:
            raise ArgumentError(f"{url} is the source; write the result to another path (SRC is never modified)")
        if not options.get("force") and exists(url):
            raise ArgumentError(f"{url} exists; pass {spell('force=True', '--force')} to replace it")
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(staged_read(src)) if is_url(src) else src
        dest = stack.enter_context(staged_write(dst)) if is_url(dst) else dst
        report = convert(source, dest, **options)  # the upload runs as the block ends, before the report returns
    for local, url in ((source, src), (dest, dst)):
        if is_url(url):
            report.notes = [unstaged(n, Path(local), str(url)) for n in report.notes]
    report.source, report.destination = os.fspath(src), os.fspath(dst)
    return report
