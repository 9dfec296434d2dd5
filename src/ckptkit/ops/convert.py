"""``ckptkit convert``: rename wrapper prefixes, optionally change format, never lose data.

The fast path (torch zip and safetensors) never imports torch: it rewrites names and copies
tensor bytes as they are, checking each against the CRC-32 the source records for it. Everything
else (legacy files, DCP folders, files that need ``trust``, layouts the fast path does not model)
goes through torch, with the same renaming rules and the same write path; a torch zip or
safetensors source has its recorded CRC-32s checked before anything is written (torch checks none).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from ..errors import ArgumentError, CkptkitError, spell
from ..formats import registry
from ..formats.cast import Cast, target_dtype
from ..formats.dcp.megatron import unstack_flag
from ..formats.deepspeed.files import check_zero_source
from ..formats.detect import check_exists
from ..formats.hf.detect import HF
from ..formats.hf.index import DEFAULT_MAX_SHARD_SIZE, parse_size
from ..formats.hf.write import check_destination
from ..formats.integrity import check_recorded_crcs
from ..formats.pickles.reader import UnsupportedGlobal
from ..formats.pickles.safety import MODULE_WALK, AllowGlobals, unsafe_error
from ..formats.source import NeedsTorch
from ..formats.spec import CheckpointFormat, Part, View, WritePlan
from ..formats.torchzip import modulepickle as mp
from ..io import ranged
from ..io.atomicdir import check_folder_destination
from ..io.store import locate
from ..model.hf_llama import CONFIG, LlamaConfig
from ..prefix import parse_rules
from .convert_job import Job, TorchView, fast_cast, staged_convert
from .reports import ConvertReport
from .verify import refuse_failing
from .workers import Workers

if TYPE_CHECKING:  # its module imports torch.distributed: only a convert by ranks loads it
    from .ranks import Ranks
from .write import format_for


def _dcp_flag() -> str:
    return spell('format="dcp"', "--format dcp")


def _source_files(src: Path) -> list[Path]:
    """Every file a source is read from: itself, or a folder's files, or an index and its shards."""
    if src.is_dir():
        return [p for p in src.iterdir() if p.is_file()]
    if src.name.endswith(".index.json"):
        return [src, *(p for p in src.parent.iterdir() if p.is_file())]
    return [src] if src.exists() else []


def _check_folder_name(dest: Path, option: str) -> None:
    """Refuse a new folder named like a file (``out.safetensors``), unless the name ends with ``/``
    (Lightning names its sharded checkpoint folders ``epoch=0-step=10.ckpt``)."""
    if dest.suffix.lower() in registry.SUFFIXES:
        raise ArgumentError(
            f"{dest} names a {dest.suffix} file, but {option} writes a folder; name the folder without "
            f"the suffix ({dest.with_suffix('')}/) or end the name with / to keep it ({dest}/), "
            f"or leave out {option} to write one file"
        )


def _check_paths(src: Path, dst: Path, force: bool, format: Literal["dcp"] | None) -> CheckpointFormat:
    if format is not None:  # a folder its format's writer fills; anything else in it would go with it
        out = registry.get(format)
        assert out.owns is not None  # a format chosen by name writes a folder of its own
        owned, what = out.owns
        check_folder_destination(src, dst, force=force, owned=owned, what=what)
        return out
    fmt = format_for(dst, default=None)
    if dst.exists():
        if any(os.path.samefile(f, dst) for f in _source_files(src)):
            same = src.is_file() and os.path.samefile(src, dst)
            raise ArgumentError(
                f"{dst} is {'the source file' if same else f'a file of the source {src}'}; "
                "write the result to another path (SRC is never modified)"
            )
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
    rename: Iterable[str] = (),
    model_only: bool = False,
    key: str | None = None,
    trust: bool = False,
    allow_globals: AllowGlobals = (),
    force: bool = False,
    progress: Callable[[int, int], None] | None = None,
    max_shard_size: int | str | None = None,
    format: Literal["dcp"] | None = None,
    zero_weights: Literal["fp32", "module"] = "fp32",
    dtype: Literal["bf16", "fp16", "fp32"] | None = None,
    sanitize: bool = False,
    merge_adapter: str | os.PathLike[str] | None = None,
    unstack_layers: bool = False,
    hf_llama: str | os.PathLike[str] | None = None,
    workers: int = 1,
    ranks: bool = False,
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
    folder is copied chunk by chunk, in little memory at any size, however its chunks split each
    tensor (along any dims: FSDP2, tensor parallelism, 2-D and 3-D meshes).
    A DeepSpeed ZeRO folder gives the fp32 state dict ``zero_to_fp32`` rebuilds (its names, order,
    dtypes, bits and ties), copied from the ranks' partitions, each byte checked against its CRC-32.

    Args:
        src: an object's URL (``s3://bucket/key.pt``, staged through a local file; a prefix holding
            a folder's files, staged as that folder), or a torch zip or legacy file, safetensors file, DCP folder, Hugging Face shards (their
            folder or ``*.index.json``), or a DeepSpeed ZeRO folder (holding ``latest``, or ``global_stepN/``).
        dst: output path (or an object's URL, ``s3://bucket/key.pt``: written locally, uploaded in
            parts and checked; a folder output to a URL, ``s3://bucket/hf/``, has each file so
            uploaded under that prefix, its index or ``.metadata`` last); ``.safetensors`` writes safetensors, ``.pt .pth .bin .ckpt .tar`` torch
            zip (suffixes in any case). A path ending in ``/``, an existing folder, or any
            ``max_shard_size`` writes a folder of Hugging Face safetensors shards instead, as
            ``huggingface_hub.save_torch_state_dict`` does; it appears complete or not at all.
        to: ``"single"`` (remove ``module.``/``_orig_mod.``), ``"ddp"`` (then add ``module.``)
            or ``"keep"``; see :func:`ckptkit.prefix.rewrite_prefixes`.
        strip: further prefixes to remove (e.g. Lightning's ``"model."``).
        add: prefixes to add.
        rename: ``REGEX=REPL`` rules applied in order to every weight's name after the prefixes
            (:func:`re.sub`; the last ``=`` splits them), e.g. ``"^tok_embeddings[.]=model.embed_tokens."``;
            two names renamed to one is an error, and ``notes`` name a rule that matched nothing.
        model_only: write only the model state dict (not torch's ``weights_only``, which is
            about unpickling; ckptkit always loads safely unless ``trust``).
        key: where the weights are, e.g. ``"ema"``.
        trust: allow arbitrary unpickling of ``src``; only for files you trust.
        allow_globals: classes (or ``"module.Name"`` strings) to admit when unpickling ``src``.
        force: replace an existing ``dst``.
        progress: called as ``progress(bytes_done_now, bytes_total)`` while copying.
        max_shard_size: for a folder output, the shard size limit: bytes, or ``"5GB"``/``"500MB"``
            (decimal units, as huggingface_hub's; default ``"5GB"``).
        format: ``"dcp"`` writes ``dst`` as a torch.distributed.checkpoint folder, as DCP's own
            writer lays one out (one ``.distcp`` file and ``.metadata``), each tensor copied as
            it is read (torch-free, any DCP source sharding; DCP's own writer where the source
            needed torch), which
            ``torch.distributed.checkpoint.load`` reads into a plain or an FSDP2 model; the
            folder appears complete or not at all. None: the format ``dst``'s suffix names.
        zero_weights: for a DeepSpeed ZeRO source: ``"fp32"`` (the master weights, as ``zero_to_fp32``)
            or ``"module"`` (the 16-bit ``module`` state dict as saved; ZeRO stage 1/2 only).
        dtype: cast the model weights' floating tensors (float16, bfloat16, float32, float64,
            float8 e4m3fn and e5m2) to ``"bf16"``, ``"fp16"`` or ``"fp32"``, with the values torch's
            ``.to()`` gives (round to nearest even; NaN and inf kept); integer, bool and complex
            tensors, a quantized weight's scales and codebooks (``weight_scale_inv``, bitsandbytes'
            ``absmax``, ...) and everything besides the weights (optimizer state) are left as they
            are. Torch-free where the copy is, each source byte still checked. ``notes`` say what
            was cast and what was left. None: no cast.
        sanitize: with ``trust``, make what is written loadable by ``torch.load(weights_only=True)``:
            ``argparse.Namespace`` and dataclass instances become dicts, numpy arrays tensors, numpy
            scalars Python values, numpy RNG state plain lists and ints; anything else a weights-only
            load refuses is an error naming its key path. Tensors are written byte for byte;
            ``notes`` and ``sanitized`` list every change.
        merge_adapter: a PEFT LoRA adapter (its folder, or ``adapter_model.safetensors`` / ``.bin``
            with ``adapter_config.json`` beside it) to merge into the weights as PEFT's
            ``merge_and_unload()`` does (``W + scaling · B @ A``, PEFT's values on the CPU), one
            weight in memory at a time. It is checked against ``src`` first, as
            :func:`~ckptkit.check_adapter` checks it: an adapter that would not apply is refused
            (StateDictMismatchError) and nothing is written. ``merged`` lists the weights it changed.
        unstack_layers: for a folder megatron-core's ``torch_dist`` wrote, whose blocks save each
            weight of all their layers as one tensor, the layer index first
            (``decoder.layers.mlp.linear_fc1.weight``, ``[num_layers, ...]``): write each layer's
            slice under its own key (``decoder.layers.0.mlp.linear_fc1.weight``), and each layer's
            ``_extra_state`` likewise. Streamed, each byte checked, as any DCP copy is.
        hf_llama: the Hugging Face ``config.json`` of a Llama that torchtitan trained: write its
            weights as transformers' ``LlamaForCausalLM`` loads them, as torchtitan's
            ``convert_to_hf`` does: transformers' names, each ``wq``/``wk`` head's rows permuted for
            transformers' rotary layout (torch-free, one head's rows in memory at a time), the
            output head left out where the config ties it; the weights alone (``model_only``), and
            ``config.json`` copied into a folder ``dst``. A weight that is not a Llama's is refused.
        workers: for a folder of Hugging Face shards, write the shards with this many processes
            at once (this one and ``workers - 1`` spawned ones, each checking what it copies); for
            a DCP folder (``format="dcp"``), split its tensors among that many ``.distcp`` files,
            one per process. The index (``.metadata``) is written once all are done, and a failure
            in any leaves no folder. Where ``src`` must be read with torch, one process writes
            every file (``notes`` say so).
        ranks: called on every rank of the initialised process group (torchrun, srun), with the
            same arguments: each rank writes its share of a folder of Hugging Face shards (or its
            ``.distcp`` file of a DCP folder) on a filesystem they share, rank 0 the index (or
            ``.metadata``) once every rank's share is written and checked; a failure on any rank
            fails every rank, naming it, and leaves no folder. Every rank returns the report (rank
            0's lists what all wrote).

    Returns:
        A :class:`ConvertReport`.

    Raises:
        CheckpointFormatError: ``src`` is damaged (its bytes differ from their recorded CRC-32s)
            or is not a checkpoint, or is one ZeRO-3 rank's file (PartialCheckpointError, naming its
            folder); ArgumentError, CheckpointNotFoundError, UnsafeCheckpointError, CheckpointWriteError as their names say.

    Example:
        >>> convert_checkpoint("ddp.pt", "single.pt")  # doctest: +SKIP
        >>> convert_checkpoint("old.pt", "clean.pt", trust=True, sanitize=True, dtype="bf16")  # doctest: +SKIP
        >>> convert_checkpoint("s3://bucket/ddp.pt", "single.pt")  # doctest: +SKIP
        >>> convert_checkpoint("base/", "merged/", merge_adapter="lora/")  # doctest: +SKIP
        >>> convert_checkpoint("ckpt.dcp", "hf/", max_shard_size="2GB", workers=2)  # doctest: +SKIP
    """
    options = {k: v for k, v in locals().items() if k not in ("src", "dst", "ranks")}  # every option as given
    if not ranks:
        return staged_convert(locate(src).pointed(), locate(dst), _convert, **options)
    from .ranks import Ranks  # deferred: torch.distributed, for a convert by ranks only

    meetings = Ranks(os.fspath(dst))
    part = Part(Path(), [], receive=meetings.receive) if meetings.rank != 0 else None
    try:  # whatever fails, on whichever rank, every rank still holds the meetings
        if not meetings.joined:
            raise ArgumentError(
                f"{spell('ranks=True', '--ranks')} needs torch.distributed's process group, initialised on every rank; "
                "call torch.distributed.init_process_group() first, or leave ranks out to convert in this process"
            )
        source, dest = locate(src).pointed(), locate(dst)  # a checkpoints folder or latest: the file it names
        if source.remote or dest.remote:
            raise ArgumentError(
                f"ranks convert between paths on a filesystem they share, not {src if source.remote else dst}; "
                "convert in one process, or to a shared path and upload it"
            )
        report = _convert(source.spelled, dest.spelled, **options, part=part, meetings=meetings)
    except BaseException as e:
        raise meetings.failed(e) from e
    meetings.done(part.share if part is not None else None)
    return report


def _convert(
    src: str,
    dst: str,
    *,
    to: Literal["single", "ddp", "keep"],
    strip: Iterable[str],
    add: Iterable[str],
    rename: Iterable[str],
    model_only: bool,
    key: str | None,
    trust: bool,
    allow_globals: AllowGlobals,
    force: bool,
    progress: Callable[[int, int], None] | None,
    max_shard_size: int | str | None,
    format: Literal["dcp"] | None,
    zero_weights: Literal["fp32", "module"],
    dtype: Literal["bf16", "fp16", "fp32"] | None,
    sanitize: bool,
    merge_adapter: str | os.PathLike[str] | None,
    unstack_layers: bool,
    hf_llama: str | os.PathLike[str] | None,
    workers: int,
    part: Part | None = None,
    meetings: Ranks | None = None,
) -> ConvertReport:
    """:func:`convert_checkpoint` between local paths; ``part``: as one of its workers (or a
    rank other than 0); ``meetings``: as one of the ranks of a process group."""
    strip, add, rename = list(strip), list(add), list(rename)  # read here, and again by any worker
    given = {k: v for k, v in locals().items() if k not in ("src", "dst", "progress", "part", "meetings")}
    if to not in ("single", "ddp", "keep"):
        raise ArgumentError(f"to must be 'single', 'ddp' or 'keep', not {to!r}")
    if dtype is not None:
        target_dtype(dtype)  # a bad choice fails before any file is touched
    rules = parse_rules(rename)  # so does a bad rule
    llama = LlamaConfig.read(hf_llama) if hf_llama is not None else None  # and a config that is not one
    model_only = model_only or llama is not None  # transformers loads the weights alone
    if sanitize and not trust:
        raise ArgumentError(
            f"{spell('sanitize=True', '--sanitize')} rebuilds {src}'s pickled objects (argparse.Namespace, numpy "
            f"arrays and RNG state) to turn them into plain values, and only an unrestricted unpickle builds them; "
            f"add {spell('trust=True', '--trust')} if you trust {src} (unpickling can run code it names)"
        )
    source, dest = Path(src), Path(dst)
    check_exists(source)
    by_name = [f.name for f in registry.FORMATS.values() if f.owns is not None]  # folders written by name
    if format is not None and format not in by_name:
        names = " or ".join(repr(n) for n in by_name)
        raise ArgumentError(f"format must be {names} or None (the format DST's suffix names), not {format!r}")
    if format is not None and max_shard_size is not None:
        shard = spell("max_shard_size", "--max-shard-size")
        raise ArgumentError(
            f"{shard} is for Hugging Face shards; {_dcp_flag()} writes one DCP folder, so leave {shard} out"
        )
    said_folder = os.fspath(dst).endswith(("/", os.sep)) or dest.is_dir()
    folder = format is None and (max_shard_size is not None or said_folder)
    limit = parse_size(DEFAULT_MAX_SHARD_SIZE if max_shard_size is None else max_shard_size) if folder else 0
    if (folder or format is not None) and not said_folder:
        _check_folder_name(dest, spell("max_shard_size", "--max-shard-size") if folder else _dcp_flag())
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ArgumentError(
            f"{spell('workers', '--workers')} must be a whole number of processes, 1 or more, not {workers!r}"
        )
    shared = folder or format is not None  # a folder's files can be split among processes; one file cannot
    if meetings is not None and (workers > 1 or not shared):
        by_ranks = spell("ranks=True", "a convert under torchrun or srun")
        raise ArgumentError(
            f"{by_ranks} writes a folder (Hugging Face shards, or {_dcp_flag()}), each rank its share, "
            + (
                f"so leave {spell('workers', '--workers')} out"
                if workers > 1
                else f"and {dst} is one file; end DST with / (or give {spell('max_shard_size', '--max-shard-size')}) "
                "to write shards, or convert it in one process"
            )
        )
    if workers > 1 and not shared:
        raise ArgumentError(
            f"{spell('workers', '--workers')} splits a folder's files among processes (Hugging Face shards, or "
            f"{_dcp_flag()}), and {dst} is one file; end DST with / (or give "
            f"{spell('max_shard_size', '--max-shard-size')}) to write shards, or leave {spell('workers', '--workers')} out"
        )
    if folder and part is None:
        check_destination(source, dest, force=force, extra=[CONFIG] if llama is not None else [])
    out_fmt = registry.get(HF) if folder else _check_paths(source, dest, force, format)
    in_fmt = registry.detect(source)
    check_zero_source(source, in_fmt.name, zero_weights)  # a ZeRO-3 rank's file alone is an intact zip of placeholders
    if unstack_layers and not in_fmt.unstacks_layers:
        raise ArgumentError(
            f"{unstack_flag()} splits the stacked layers of a DCP folder "
            f"megatron-core's torch_dist wrote; {src} is {in_fmt.name}: leave it out"
        )
    reason = _why_torch(in_fmt, out_fmt, trust)
    opened = None if reason else _opened(source, in_fmt, zero_weights=zero_weights, unstack_layers=unstack_layers)
    try:
        refuse_failing(source, in_fmt, opened=opened)  # verify's own judgement, before anything is read or written
        job = Job(
            source, dest, in_fmt, out_fmt, to, list(strip), list(add), model_only, key, rename=rules, hf_llama=llama
        )
        if merge_adapter is not None:  # checked against the source before anything is written
            from .merge import Merge  # deferred: a merge needs torch, a plain convert does not

            job.merging = Merge.read(merge_adapter, source, trust=trust, allow_globals=allow_globals)
        job.plan = WritePlan(max_shard_size=limit, source=str(source), workers=workers, part=part)
        if llama is not None and folder:
            job.plan.extra = {CONFIG: llama.text}
        if workers > 1 and part is None:  # the same convert in each, with its share of the files
            job.workers = Workers(
                _convert,
                src,
                dst,
                given,  # workers too: each plans the files alike
                progress=lambda n: _tell(job.plan, n),
                elsewhere=ranged.stand_ins(src),  # a URL's objects: each worker reads through ranges too
            )
            job.plan.spread = job.workers
        elif meetings is not None:
            job.plan.workers = meetings.count  # each rank plans the files alike
            if meetings.rank == 0:  # the other ranks receive their share from it
                job.workers, job.plan.spread = meetings, meetings
        if not reason:
            assert in_fmt.open is not None  # _why_torch says so otherwise
            try:
                view = (
                    opened
                    if opened is not None
                    else in_fmt.open(source, lazy=True, zero_weights=zero_weights, unstack_layers=unstack_layers)
                )
                try:
                    return _copy(view, job, progress=progress, dtype=dtype, sanitize=sanitize)
                finally:
                    view.close()
            except mp.UnsafeModulePickle as e:
                if not allow_globals:
                    raise unsafe_error(
                        str(source), e.names, where=f" (a pickled {e.description} module)", beyond=MODULE_WALK
                    ) from None
                reason = "pickled module with allowed globals: loaded with torch"
            except UnsupportedGlobal as e:
                reason = f"{e.name} is not modelled by the fast path: loaded with torch"
            except NeedsTorch as e:
                reason = f"{e}: loaded with torch"
        job.workers = job.plan.spread = None  # the torch path writes alone: no worker's share of a fast try counts
        if meetings is not None:  # the torch path loads the whole source into one process
            raise ArgumentError(
                f"{source} is read with torch here ({reason}), which loads it whole in one process: convert it "
                "without torchrun or srun"
            )
        if part is not None:  # a worker: its parent converts through torch, alone
            raise NeedsTorch(reason.removesuffix(": loaded with torch"))
        from .read import read_source  # deferred: torch is imported only when this path is taken

        obj = read_source(
            str(source),
            map_location="cpu",
            trust=trust,
            allow_globals=allow_globals,
            zero_weights=zero_weights,
            checked=True,  # refuse_failing ran above, before anything was read
        )
        if unstack_layers:  # split here: the stream splits them in the folder's metadata
            from ..formats.dcp.torch import unstack_tensors  # deferred with torch, as above

            obj = unstack_tensors(obj, str(source))
        module = in_fmt.module_name(source) if trust and in_fmt.module_name is not None else ""
        if module:  # read by the same inert walk as untrusted: nothing of the pickle was run
            reason = "trusted file: its tensors were read through torch"
        view = TorchView(obj, source, in_fmt, reason=reason, pickled_module=module)
        # torch.load checks no CRC-32: check them before writing (after loading, so an unsafe file is refused at once)
        check_recorded_crcs(source, in_fmt.name, progress=_progress(progress, view.nbytes))
        job.sanitize = sanitize
        if (merging := job.merging) is not None:
            from .merge import merge_tensors  # deferred with torch, as above

            merging.merged.clear()  # a fast try's merges were not written
            job.merge = lambda state: merge_tensors(state, merging)
        if dtype is not None:
            from .torchcast import cast_tensors  # deferred with torch, as above

            job.casting = cast = Cast(dtype)
            job.cast = lambda state: cast_tensors(state, cast)
        if sanitize:
            from .sanitize import sanitize as make_plain  # deferred with torch, as above

            def finish(out: object) -> object:
                plain, found = make_plain(out, source=str(source))
                job.sanitized.extend(found)
                return plain

            job.finish = finish
        report = job.run(view)
        if workers > 1:
            report.notes.append(
                f"{spell('workers', '--workers')}: {source} was read with torch, so one process wrote every file"
            )
        return report

    finally:
        if opened is not None:
            opened.close()


def _opened(source: Path, fmt: CheckpointFormat, *, zero_weights: str, unstack_layers: bool) -> View | None:
    """For a torch-free copy: ``source`` opened whole where its format's check reads what its open
    reads (DCP: every chunk's header), so the check before the copy and the copy share one
    reading; None where it cannot be opened so (the check, then torch, say why)."""
    if fmt.check_opened is None or fmt.open is None:
        return None
    try:
        return fmt.open(source, zero_weights=zero_weights, unstack_layers=unstack_layers)
    except (CkptkitError, NeedsTorch, OSError):
        return None


def _why_torch(in_fmt: CheckpointFormat, out_fmt: CheckpointFormat, trust: bool) -> str:
    """Why this convert goes through torch from the start ("": the torch-free copy is tried first)."""
    if out_fmt.write_entries is None:
        return f"{out_fmt.name} output: written by torch"
    if trust and in_fmt.trust_matters:
        return "trusted file: loaded with torch"
    if in_fmt.open is None:
        return f"{in_fmt.name} input: loaded with torch"
    return ""


def _tell(plan: WritePlan, n: int) -> None:
    """Workers' bytes to the progress this process reports."""
    if plan.progress is not None:
        plan.progress(n)


def _progress(progress: Callable[[int, int], None] | None, total: int) -> Callable[[int], None] | None:
    return (lambda n: progress(n, total)) if progress else None


def _copy(
    view: View,
    job: Job,
    *,
    progress: Callable[[int, int], None] | None,
    dtype: Literal["bf16", "fp16", "fp32"] | None,
    sanitize: bool,
) -> ConvertReport:
    """The torch-free convert: ``view``'s entries renamed (and cast while copied) into the output
    format's writer, every byte checked against its source's CRC-32."""
    job.plan.progress = _progress(progress, view.nbytes)
    job.casting = Cast(dtype) if dtype else None  # anew for each try: a fallback's casts are the torch path's
    job.cast = fast_cast(view, job.casting) if job.casting else None
    if job.merging is not None:
        from .merge import fast_merge  # deferred: only a merge imports torch

        job.merging.merged.clear()
        job.merge = fast_merge(view, job.merging)
    # storages as they are where nothing changes them
    job.plan.copy_storages = job.casting is None and job.merging is None and job.hf_llama is None
    job.sanitize = sanitize
    return job.run(view)
