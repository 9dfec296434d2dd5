"""``convert``, ``inspect``, ``diff``, ``verify`` and ``check-adapter``: each parses, calls the library, renders."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from typing import Any, Literal, NoReturn

import click

import ckptkit  # each command touches only its own function: the package imports it on first use
from ckptkit.train import launched_group, launched_ranks

from .base import BIG, emit_json, handle_errors, main
from .render import human_bytes, progress_bar, render_adapter, render_diff, render_summary, render_verify, weights_where

ALLOW_GLOBAL = click.option(
    "--allow-global",
    multiple=True,
    metavar="MODULE.NAME",
    help="Admit this class when unpickling, e.g. argparse.Namespace (repeatable); safer than --trust.",
)


def _finish(report: Any, *, as_json: bool, render: Callable[[Any], None], ok: bool) -> NoReturn:
    """The report's notes to stderr, the report to stdout (JSON, or rendered), and the exit code."""
    for note in [] if as_json else report.notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        emit_json(report.to_dict())
    else:
        render(report)
    sys.exit(0 if ok else 1)


def _rules(f: Any) -> list[str]:
    """A rules file's REGEX=REPL lines; blank lines and # comments skipped."""
    if f is None:
        return []
    return [line.strip() for line in f.read().splitlines() if line.strip() and not line.lstrip().startswith("#")]


@main.command()
@click.argument("src", type=click.Path(path_type=str, readable=False))
@click.argument("dst", type=click.Path(path_type=str, readable=False))
@click.option(
    "--to",
    "to",
    type=click.Choice(["single", "ddp", "keep"]),
    default="single",
    show_default=True,
    help="single: remove module./_orig_mod.; ddp: then add module.; keep: leave wrappers.",
)
@click.option(
    "--strip", multiple=True, metavar="PREFIX", help="Also remove PREFIX (repeatable), e.g. Lightning's model."
)
@click.option("--add", multiple=True, metavar="PREFIX", help="Add PREFIX to every key (repeatable).")
@click.option(
    "--rename",
    multiple=True,
    metavar="REGEX=REPL",
    help="Rename keys by regex after the prefixes (repeatable, in order; re.sub, \\1 for a group).",
)
@click.option(
    "--rename-file",
    type=click.File("r"),
    help="Rename rules from a file: one REGEX=REPL per line, after any --rename; # starts a comment.",
)
@click.option(
    "--model-only", "model_only", is_flag=True, help="Write only the model state dict, dropping optimizer etc."
)
@click.option(
    "--key",
    metavar="PATH",
    help="Where the weights are in SRC, e.g. ema or ema/model; student. (ending in .) "
    "picks the keys under that prefix, with --model-only; . picks the tensors among the top level's entries.",
)
@click.option("--trust", is_flag=True, help="Allow arbitrary unpickling of SRC. Only for files you trust.")
@ALLOW_GLOBAL
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option(
    "--max-shard-size",
    metavar="SIZE",
    help="Write DST as a folder of Hugging Face safetensors shards of at most SIZE (bytes, or 5GB, 500MB).",
)
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    metavar="N",
    help="Write a folder's files with N processes at once: its Hugging Face shards, or with --format dcp "
    "one .distcp file each (the index or .metadata once all are done).",
)
@click.option(
    "--ranks",
    "as_rank",
    is_flag=True,
    help="Under torchrun or srun: each rank writes its share of the shards, rank 0 the index (every rank runs it).",
)
@click.option(
    "--format",
    "out_format",
    type=click.Choice(["dcp"]),
    default=None,
    help="dcp: write DST as a torch.distributed.checkpoint folder (default: the format DST's suffix names).",
)
@click.option(
    "--zero-weights",
    type=click.Choice(["fp32", "module"]),
    default="fp32",
    show_default=True,
    help="For a DeepSpeed ZeRO folder: fp32 (the master weights, as zero_to_fp32) or module (the 16-bit "
    "module weights as saved; stage 1/2 only).",
)
@click.option(
    "--dtype",
    type=click.Choice(["bf16", "fp16", "fp32"]),
    default=None,
    help="Cast the floating weights, float8 too, to this dtype (values as torch's .to(); ints, bools, "
    "quantization scales and codebooks, optimizer state kept).",
)
@click.option(
    "--merge-adapter",
    metavar="ADAPTER",
    help="Merge this PEFT LoRA adapter (folder with adapter_config.json) into the weights, as PEFT's "
    "merge_and_unload() (one weight in memory at a time); refused if check-adapter flags it.",
)
@click.option(
    "--hf-llama",
    metavar="CONFIG",
    help="A torchtitan Llama as transformers loads it: HF names, wq/wk rows permuted for HF's rotary layout "
    "(heads from CONFIG, the model's HF config.json, copied into a folder DST); the weights only.",
)
@click.option(
    "--unstack-layers",
    is_flag=True,
    help="For a megatron-core torch_dist folder: each layer of its stacked tensors under its own key "
    "(decoder.layers.X -> decoder.layers.0.X, ...).",
)
@click.option(
    "--sanitize",
    is_flag=True,
    help="With --trust: write what torch.load(weights_only=True) reads (Namespace, "
    "dataclasses -> dicts; numpy arrays -> tensors; numpy RNG state -> lists); notes list each change.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors
def convert(
    src: str,
    dst: str,
    to: Literal["single", "ddp", "keep"],
    strip: tuple[str, ...],
    add: tuple[str, ...],
    rename: tuple[str, ...],
    rename_file: Any,
    model_only: bool,
    key: str | None,
    trust: bool,
    allow_global: tuple[str, ...],
    force: bool,
    max_shard_size: str | None,
    workers: int,
    as_rank: bool,
    out_format: Literal["dcp"] | None,
    zero_weights: Literal["fp32", "module"],
    dtype: Literal["bf16", "fp16", "fp32"] | None,
    merge_adapter: str | None,
    hf_llama: str | None,
    unstack_layers: bool,
    sanitize: bool,
    as_json: bool,
) -> None:
    """Rewrite SRC's weight names for another wrapping into DST (format by DST suffix).

    Only the model weights are renamed; optimizer, scheduler, epoch and the rest are kept as
    they were unless --model-only. DST appears only when complete; SRC is never modified.
    SRC may be Hugging Face shards (their folder or index), a DCP folder (copied chunk by chunk)
    or a whole pickled model (torch.save(model): its state_dict(), read without running it), or a
    DeepSpeed ZeRO folder (the one holding latest, or global_stepN/): the fp32 weights zero_to_fp32 rebuilds.
    A DST ending in / (or an existing folder, or --max-shard-size) is written as Hugging Face
    safetensors shards (default 5GB each); --format dcp writes a DCP folder.
    """
    # Asked for, never guessed: a process that merely inherits a launcher's variables (a training
    # script's rank shelling out to convert) would wait for partners that never come.
    by_ranks = as_rank and launched_ranks(os.environ) > 1
    with (
        launched_group() if by_ranks else contextlib.nullcontext(0) as rank,
        progress_bar(src, threshold=BIG, enabled=not as_json and not by_ranks) as progress,
    ):
        report = ckptkit.convert_checkpoint(
            src,
            dst,
            to=to,
            strip=strip,
            add=add,
            rename=[*rename, *_rules(rename_file)],
            model_only=model_only,
            key=key,
            trust=trust,
            allow_globals=allow_global,
            force=force,
            progress=progress,
            max_shard_size=max_shard_size,
            format=out_format,
            zero_weights=zero_weights,
            dtype=dtype,
            sanitize=sanitize,
            merge_adapter=merge_adapter,
            unstack_layers=unstack_layers,
            hf_llama=hf_llama,
            workers=workers,
            ranks=by_ranks,
        )
    if rank != 0:  # rank 0 tells what every rank wrote
        return
    if as_json:
        emit_json(report.to_dict())
        return
    if report.pickled_module:
        click.echo(
            f"note: {src} holds a pickled {report.pickled_module} module; its state_dict() was read without running the pickle",
            err=True,
        )
    for note in report.notes:
        click.echo(f"note: {note}", err=True)
    if report.fallback_reason:
        click.echo(f"note: {report.fallback_reason}", err=True)
    if report.dropped:
        click.echo(f"note: not written (--model-only): {', '.join(report.dropped)}", err=True)
    for where in report.left:
        click.echo(
            f"note: '{where}' also holds wrapped weights, left as they were; convert them with --key {where}", err=True
        )
    if report.tied and report.shards:
        click.echo(
            f"note: stored once, as huggingface_hub does (the other name is in the index metadata): {', '.join(report.tied)}. "
            "ckptkit.load_for_rank re-ties them; transformers' models tie them themselves",
            err=True,
        )
    elif report.tied:
        click.echo(
            f"note: stored once and re-tied on load: {', '.join(report.tied)}. Load with ckptkit.load_for_rank "
            "or safetensors.torch.load_model; load_file + a strict load_state_dict would miss them",
            err=True,
        )
    where = f" (weights at {weights_where(report.weights_at)})" if report.weights_at else ""
    stored = f" ({report.tensors - len(report.tied)} stored)" if report.tied else ""
    stored += f" in {report.shards} shards" if report.shards > 1 else ""
    click.echo(
        f"{report.destination}: {report.tensors} tensors{stored}{where}, {report.renamed} renamed "
        f"({report.prefix_before or 'no prefix'} -> {report.prefix_after or 'no prefix'}), "
        f"{human_bytes(report.bytes)}, {report.destination_format}"
    )


@main.command()
@click.argument("file", type=click.Path(path_type=str, readable=False))
@click.option("--key", metavar="PATH", help="Where the weights are, if not found automatically.")
@click.option("--all", "show_all", is_flag=True, help="List every key group, not the first 40.")
@click.option("--trust", is_flag=True, help="Allow arbitrary unpickling. Only for files you trust.")
@ALLOW_GLOBAL
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (every tensor listed).")
@handle_errors
def inspect(
    file: str, key: str | None, show_all: bool, trust: bool, allow_global: tuple[str, ...], as_json: bool
) -> None:
    """Summarise FILE: layout, where the weights are, wrapper prefixes, tensors, metadata."""
    summary = ckptkit.inspect_checkpoint(file, key=key, trust=trust, allow_globals=allow_global)
    for note in [] if as_json else summary.notes:
        click.echo(f"note: {note}", err=True)
    if as_json:
        emit_json(summary.to_dict())
    else:
        render_summary(summary, show_all=show_all)
    if summary.needs_trust:
        sys.exit(1)


@main.command()
@click.argument("a", type=click.Path(path_type=str, readable=False))
@click.argument("b", type=click.Path(path_type=str, readable=False))
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance.")
@click.option("--key-a", metavar="PATH", help="Where the weights are in A.")
@click.option("--key-b", metavar="PATH", help="Where the weights are in B.")
@click.option(
    "--strip",
    multiple=True,
    metavar="PREFIX",
    help="Also remove PREFIX where a key has it, on both sides (repeatable).",
)
@click.option("--trust", is_flag=True, help="Allow arbitrary unpickling. Only for files you trust.")
@ALLOW_GLOBAL
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors(trouble=2)
def diff(
    a: str,
    b: str,
    atol: float,
    rtol: float,
    key_a: str | None,
    key_b: str | None,
    strip: tuple[str, ...],
    trust: bool,
    allow_global: tuple[str, ...],
    as_json: bool,
) -> None:
    """Compare the model weights of A and B across formats and prefixes.

    Exit 0 when they are the same, 1 when they differ, 2 on trouble (a missing or unreadable
    file), as GNU diff does.
    """
    with progress_bar(a, b, threshold=BIG, enabled=not as_json) as progress:
        report = ckptkit.diff_checkpoints(
            a,
            b,
            atol=atol,
            rtol=rtol,
            key_a=key_a,
            key_b=key_b,
            strip=strip,
            trust=trust,
            allow_globals=allow_global,
            progress=progress,
        )
    _finish(report, as_json=as_json, render=render_diff, ok=report.equal)


@main.command("check-adapter")
@click.argument("adapter", type=click.Path(path_type=str, readable=False))
@click.argument("base", type=click.Path(path_type=str, readable=False))
@click.option("--trust", is_flag=True, help="Allow arbitrary unpickling. Only for files you trust.")
@ALLOW_GLOBAL
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@handle_errors(trouble=2)
def check_adapter(adapter: str, base: str, trust: bool, allow_global: tuple[str, ...], as_json: bool) -> None:
    """Will the PEFT LoRA ADAPTER (its folder or file) apply to the BASE checkpoint, as PEFT loads it?

    Reports adapter keys that name no base module (with the convert that fixes them), targeted
    modules without an adapter, shapes that do not fit, and all-zero lora_B tensors. Exit 0 when
    it applies, 1 on any finding, 2 on trouble.
    """
    report = ckptkit.check_adapter(adapter, base, trust=trust, allow_globals=allow_global)
    _finish(report, as_json=as_json, render=render_adapter, ok=report.ok)


@main.command()
@click.argument("file", type=click.Path(path_type=str, readable=False))
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@handle_errors
def verify(file: str, as_json: bool) -> None:
    """Check FILE's integrity (CRCs, bounds, shards) and that it loads without --trust. Exit 1 if not."""
    with progress_bar(file, threshold=BIG, enabled=not as_json) as progress:
        report = ckptkit.verify_checkpoint(file, progress=progress)
    _finish(report, as_json=as_json, render=render_verify, ok=report.ok)
