"""One convert once its source is open: the weights found, selected and renamed, written by the one
writer of the output's format (atomically; a folder by its own writer), and reported.

Example:
    >>> zip_ = registry.get("torch-zip")  # doctest: +SKIP
    >>> job = Job(Path("ddp.pt"), Path("single.pt"), zip_, zip_, "single", [], [], False, None)  # doctest: +SKIP
    >>> report = job.run(zip_.open(Path("ddp.pt")))  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ..errors import ArgumentError, spell, summarize
from ..formats import registry
from ..formats.cast import Cast
from ..formats.entry import Entry
from ..formats.hf.index import shard_note
from ..formats.hf.write import Written
from ..formats.integrity import Damage, check_written, kept_for_check
from ..formats.producers import AVERAGED_COUNTS, Producer, averaged_count
from ..formats.source import checkpoint_bytes
from ..formats.spec import CheckpointFormat, Info, View, WritePlan
from ..io.atomic import atomic_write
from ..io.store import Location
from ..model.hf_llama import LlamaConfig, PermutedRows, permute_tensor, to_hf_llama
from ..model.layout import TOP, find_model_state, prefix_of, replace_at
from ..model.unwrap import without_averaged_count
from ..prefix import Rule, rename_keys, rewrite_prefixes
from .reports import ConvertReport, other_wrapped_weights, renamed_prefixes
from .workers import Share, Workers
from .write import format_for, write_file

if TYPE_CHECKING:  # merging imports torch, only where an adapter is merged; ranks, torch.distributed
    from .merge import Merge
    from .ranks import Ranks


class TorchView:
    """The torch path as one more source: a checkpoint torch loaded (legacy files, DCP folders
    split along other dimensions, files that need ``trust``), written by the output format's torch
    half instead of its torch-free writer."""

    def __init__(self, obj: Any, path: Path, fmt: CheckpointFormat, *, reason: str, pickled_module: str = "") -> None:
        import torch

        self.obj, self.path, self.fmt, self._tensor = obj, path, fmt, torch.Tensor
        self.reason, self._module = reason, pickled_module  # why torch read it; a whole module's class
        self.damage = Damage(str(path), str)  # torch read every byte itself: nothing is copied here

    @property
    def name(self) -> str:
        return str(self.path)

    def unread(self) -> list[str]:
        return []  # torch read every byte

    @property
    def nbytes(self) -> int:
        return checkpoint_bytes(self.path, self.fmt.name)

    @property
    def notes(self) -> list[str]:
        return []

    @property
    def pickled_module(self) -> str:
        return self._module

    def output_metadata(self) -> dict[str, str]:
        return {"format": "pt"}

    def is_leaf(self, value: Any) -> bool:
        return isinstance(value, self._tensor)

    def entry(self, leaf: Any, name: str) -> Entry:
        raise NotImplementedError("a torch view is written by the output format's torch half")

    def records(self) -> None:
        return None

    def describe(self) -> tuple[Info, dict[str, Any], Producer | None]:
        raise NotImplementedError("inspect describes torch-loaded tensors itself")

    def close(self) -> None:
        pass


@dataclass
class Job:
    source: Path
    dest: Path
    in_fmt: CheckpointFormat
    out_fmt: CheckpointFormat
    to: Literal["single", "ddp", "keep"]
    strip: list[str]
    add: list[str]
    model_only: bool
    key: str | None
    rename: list[Rule] = field(default_factory=list)  # --rename, after the prefixes
    hf_llama: LlamaConfig | None = None  # --hf-llama: torchtitan's Llama as transformers', after the renames
    plan: WritePlan = field(default_factory=WritePlan)
    casting: Cast | None = None  # --dtype: what it cast, once written
    cast: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None  # the weights, cast (--dtype)
    merging: Merge | None = None  # --merge-adapter: what it merged, once written
    merge: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None  # the weights, the adapter merged in
    sanitize: bool = False
    finish: Callable[[Any], Any] | None = None  # what is written, made plain (--sanitize)
    sanitized: list[str] = field(default_factory=list)  # what finish changed
    workers: Workers | Ranks | None = None  # --workers, or the ranks: the others writing shards, what they report

    def run(self, view: View) -> ConvertReport:
        """Select and rename ``view``'s weights, write them with the output format's writer (its
        torch-free writer of entries, or its torch half for a :class:`TorchView`), and report."""
        obj = view.obj
        is_tensor = None if isinstance(view, TorchView) else view.is_leaf
        path, state = find_model_state(obj, key=self.key, is_tensor=is_tensor, source=str(self.source))
        # An AveragedModel's count goes with its wrapper: a plain model has no such buffer.
        count = averaged_count(state) if self.to != "keep" else None
        state = without_averaged_count(state) if count else state
        # Merged under the source's names (as single-device ones, which the adapter's keys name), before any rename.
        merged = self.merge(state) if self.merge is not None else state
        new_state: Mapping[str, Any] = rewrite_prefixes(merged, to=self.to, strip=self.strip, add=self.add)
        new_state, unmatched_rules = rename_keys(new_state, self.rename) if self.rename else (new_state, [])
        kept, tied_head = list(state), list[str]()  # the source's names of what is written
        if self.hf_llama is not None:
            renamed = list(new_state)
            new_state, tied_head = _to_hf_llama(view, new_state, self.hf_llama, str(self.source))
            kept = [k for k, name in zip(kept, renamed, strict=True) if name not in tied_head]
        if self.cast is not None:  # after renaming: the report names tensors as they are written
            new_state = self.cast(new_state)
        if path == (TOP,):  # torchtitan: the weights among the top level's entries
            others = [str(k) for k in obj if k not in state]
        else:
            others = [str(k) for k in obj if k != path[0]] if path and isinstance(obj, Mapping) else []
        if prefix_of(path):  # key="student.": part of the weights
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
        if self.out_fmt.tensors_only and others and not self.model_only:
            raise ArgumentError(
                f"{self.source} holds {summarize(others)} besides the weights, and {self.out_fmt.name} stores "
                f"tensors only; pass {spell('model_only=True', '--model-only')} to write just the model weights"
            )
        out = new_state if self.model_only else replace_at(obj, path, new_state, selected=state)
        if self.finish is not None:  # on what is written only: what --model-only drops needs no change
            out = self.finish(out)
            new_state = out if self.model_only or not path else new_state
        written = self._write(view, out, new_state)
        unread = view.unread()
        if self.plan.part is not None:  # a worker: what the parent's report needs of it
            cast = dict(self.casting.names) if self.casting else {}
            merges = list(self.merging.merged) if self.merging else []
            self.plan.part.share = Share(cast, merges, unread, reported=self.plan.part.reported)
        if self.workers is not None and self.workers.shares:  # told in the order one process would have
            shares = self.workers.shares
            read_by = [set(s.unread) for s in shares]
            unread = [u for u in unread if all(u in other for other in read_by)]  # read by none
            if self.casting is not None:
                cast = dict(self.casting.names) | {k: v for s in shares for k, v in s.cast.items()}
                self.casting.names = OrderedDict((k, cast[k]) for k in new_state if k in cast)
            if self.merging is not None:
                done = {*self.merging.merged, *(k for s in shares for k in s.merged)}
                self.merging.merged[:] = [k for k in state if k in done]
        # Names as the source spells them: key="student." selected them with the prefix removed.
        chosen = prefix_of(path)
        names = [chosen + k for k in kept]
        before, after = renamed_prefixes(names, list(new_state))
        notes = [note] if self.source.is_file() and (note := shard_note(self.source)) else []
        notes += [f"rename rule '{r}' matched no weight's name" for r in unmatched_rules]
        if self.hf_llama is not None and not self.plan.extra:
            notes.append(
                f"config.json is not written into a {self.out_fmt.name} output: transformers reads a Hugging Face "
                f"folder (config.json and its weights); end DST with / (without a format) to write one, or copy "
                "config.json beside the weights"
            )
        notes += [
            f"{name} not written: config.json ties lm_head to the embedding (tie_word_embeddings), so transformers "
            "takes it from model.embed_tokens, as torchtitan's to_hf leaves it out"
            for name in tied_head
        ]
        described = sorted(k for k in view.output_metadata() if k != "format" and not k.startswith("ckptkit."))
        if described and self.out_fmt.keeps_metadata and any(a != b for a, b in zip(names, new_state, strict=True)):
            notes.append(
                f"the source's safetensors metadata ({summarize(described, 2)}) is written as it was: any entry "
                "naming a tensor still names it as the source did"
            )
        if count:
            keep = spell("to='keep'", "--to keep")
            notes.append(
                f"{count} ({AVERAGED_COUNTS[count]}) not written: a plain model has no such buffer; {keep} keeps it"
            )
        torch_read = isinstance(view, TorchView)
        notes += view.notes + (self.merging.notes() if self.merging else [])
        notes += self.casting.notes() if self.casting else []
        if unread:
            every = spell(f"verify_checkpoint({str(self.source)!r})", f"ckptkit verify {self.source}")
            notes.append(
                f"{len(unread)} source record(s) not written were not read, so not checked ({summarize(unread, 3)}); "
                f"{every} checks every record"
            )
        if self.sanitize and not torch_read:
            notes.append("sanitize: nothing to change (the weights were read without unpickling anything)")
        elif self.sanitize:
            notes.append(
                f"sanitized for torch.load(weights_only=True): {'; '.join(self.sanitized)}"
                if self.sanitized
                else "sanitize: nothing to change (torch.load(weights_only=True) reads it as it was)"
            )
        shards = written if isinstance(written, Written) else None
        ties = self.out_fmt.ties
        tied = [f"{a} is {b}" for a, b in shards.tied.items()] if shards else ties(self.dest) if ties else []
        return ConvertReport(
            source=str(self.source),
            destination=str(self.dest),
            source_format=self.in_fmt.name,
            destination_format=self.out_fmt.name,
            weights_at="/".join(path),
            tensors=len(new_state),
            renamed=sum(a != b for a, b in zip(names, new_state, strict=True)),
            prefix_before=before,
            prefix_after=after,
            dropped=others if self.model_only else [],
            left=[] if self.model_only else other_wrapped_weights(obj, path, is_tensor),
            tied=tied,
            bytes=0  # a worker's share is in its parent's folder, not yet published
            if self.plan.part is not None
            else sum(f.stat().st_size for f in self.dest.iterdir())
            if self.dest.is_dir()
            else self.dest.stat().st_size,
            shards=len(shards.files) if shards else 0,
            notes=notes,
            fast=not torch_read,
            fallback_reason=view.reason if isinstance(view, TorchView) else "",
            pickled_module=view.pickled_module,
            cast=list(self.casting.names) if self.casting else [],
            merged=list(self.merging.merged) if self.merging else [],
            sanitized=self.sanitized,
            unread=unread,
        )

    def _write(self, view: View, obj: Any, state: Any) -> Any:
        """The one writer of the output's format: atomically for a file (checked before it is
        published), a folder by its own writer; a byte that differs from its source's CRC-32 fails
        the whole output."""
        if isinstance(view, TorchView) or self.out_fmt.write_entries is None:
            return write_file(obj, state, self.out_fmt, self.dest, self.plan)
        write = self.out_fmt.write_entries
        if self.out_fmt.folder:  # its writer owns the temp folder and the swap
            return write(self.dest, view, obj, state, self.plan)
        check = lambda tmp: check_written(tmp, self.out_fmt.name, dest=self.dest)
        with atomic_write(self.dest, check=check, kept=kept_for_check(self.out_fmt.name)) as f:
            written = write(f, view, obj, state, self.plan)
            view.damage.raise_if_any()
        return written


def _to_hf_llama(
    view: View, state: Mapping[str, Any], config: LlamaConfig, source: str
) -> tuple[dict[str, Any], list[str]]:
    """``state`` as transformers' Llama (:func:`~ckptkit.model.hf_llama.to_hf_llama`): torch
    tensors permuted in memory on the torch path, else each attention weight's rows reordered
    as it is copied."""
    if isinstance(view, TorchView):
        return to_hf_llama(state, config, permute=permute_tensor, source=source)
    entries = {name: view.entry(v, name) if view.is_leaf(v) else v for name, v in state.items()}
    return to_hf_llama(entries, config, permute=lambda e, heads: PermutedRows(e, heads), source=source)


def fast_cast(view: View, cast: Cast) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
    """The weights with each floating tensor ``cast`` wants wrapped to be cast as it is copied
    (:class:`~ckptkit.formats.cast.CastEntry`: torch-free, each source byte still checked); a
    torch zip is then written tensor by tensor, not storage by storage."""

    def run(state: Mapping[str, Any]) -> dict[str, Any]:
        entries = {name: view.entry(v, name) if view.is_leaf(v) else v for name, v in state.items()}
        cast.refuse_scaled({k: e.dtype for k, e in entries.items() if isinstance(e, Entry)})
        out: dict[str, Any] = {}
        for name, v in state.items():
            e = entries[name]
            out[name] = cast.wrap(e, name) if isinstance(e, Entry) and cast.wants(e.dtype, name) else v
        return out

    return run


def staged_convert(
    src: Location, dst: Location, convert: Callable[..., ConvertReport], **options: Any
) -> ConvertReport:
    """``convert`` on local paths: a URL's object (or a prefix's folder of objects) stood for by a
    local path its readers read through ranges (:func:`~..io.ranged.ranged_read`); a file output
    to S3 streamed to the store as it is written (:mod:`ckptkit.io.streamed`), any other output to a URL written and checked locally, then uploaded; each committed whole or not
    at all (a failure leaves the previous object) and checked, a folder's files each so, its index
    (or ``.metadata``) last."""
    folder = dst.given.endswith("/") or options.get("max_shard_size") is not None or options.get("format") is not None
    if dst.remote:
        url = dst.spelled
        if not folder:
            format_for(dst.name, default=None)  # an unknown suffix fails before anything is read
        if src.spelled == url:
            raise ArgumentError(f"{url} is the source; write the result to another path (SRC is never modified)")
        there = dst.names() if folder else dst.is_file()
        if not options.get("force") and there:
            what = f"{url}/ holds objects" if folder else f"{url} exists"
            raise ArgumentError(f"{what}; pass {spell('force=True', '--force')} to replace it")
    with contextlib.ExitStack() as stack:
        source = stack.enter_context(src.reading())  # --workers: each reads it through ranges too
        if folder:  # any folder format's index (or .metadata): an earlier one goes first, the new one last
            published = lambda name: any(f.published_by(name) for f in registry.FORMATS.values())  # noqa: E731
            dest = stack.enter_context(dst.writing_folder(published_by=published))
        else:
            dest = stack.enter_context(dst.writing())
        report = convert(source, dest, **options)  # an upload runs as the block ends, before the report returns
    report.notes = [dst.spell(src.spell(n, source), dest) for n in report.notes]
    report.source, report.destination = src.spell(report.source, source), dst.spell(report.destination, dest)
    for how in dict.fromkeys(dst.checked):  # one line per check, a folder's files counted
        n = dst.checked.count(how)
        what = (
            f"{dst.spelled}/: {n} file(s) uploaded and committed, its index (or .metadata) last"
            if folder
            else f"{dst.spelled}: uploaded and committed"
        )
        report.notes.append(f"{what}, checked by {how}")
    return report
