"""The ``ckptkit`` command line: click parses, the library works, rich renders.

Data goes to stdout, diagnostics to stderr. Exit codes: 0 ok, 1 failure or difference,
2 usage. Expected errors print one or two lines and no traceback (``--debug`` shows it).
torch and rich are imported inside the commands, so ``ckptkit --help`` stays fast.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])
_BIG = 64 << 20  # show a progress bar for files from this size, on a terminal


def _fail(message: str, code: int) -> None:
    click.echo(f"ckptkit: error: {message}", err=True)
    sys.exit(code)


def _handle_errors(fn: F) -> F:
    """Turn expected errors into one line on stderr and an exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from ckptkit import ArgumentError, CkptkitError

        debug = click.get_current_context().find_root().params.get("debug", False)
        try:
            return fn(*args, **kwargs)
        except (CkptkitError, OSError) as e:
            if debug:
                raise
            _fail(str(e) if isinstance(e, CkptkitError) else f"{type(e).__name__}: {e}", 2 if isinstance(e, ArgumentError) else 1)
        except KeyboardInterrupt:
            _fail("interrupted; nothing was written", 130)

    return wrapper  # type: ignore[return-value]


def _emit_json(data: dict[str, Any]) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.version_option(package_name="ckptkit")
def main(debug: bool) -> None:
    """Move PyTorch checkpoints between DP/DDP/compiled and single-device models, safely.

    \b
    Examples:
      ckptkit convert ddp.pt single.pt           # strip module. / _orig_mod.
      ckptkit convert single.pt ddp.pt --to ddp  # add module.
      ckptkit convert ckpt.pt model.safetensors --weights-only
      ckptkit inspect ckpt.pt
      ckptkit diff ddp.pt single.safetensors
      ckptkit verify ckpt.pt
    """


@main.command()
@click.argument("src", type=click.Path(path_type=str))
@click.argument("dst", type=click.Path(path_type=str))
@click.option("--to", "to", type=click.Choice(["single", "ddp", "keep"]), default="single", show_default=True,
              help="single: remove module./_orig_mod.; ddp: then add module.; keep: leave wrappers.")  # fmt: skip
@click.option("--strip", multiple=True, metavar="PREFIX", help="Also remove PREFIX (repeatable), e.g. Lightning's model.")
@click.option("--add", multiple=True, metavar="PREFIX", help="Add PREFIX to every key (repeatable).")
@click.option("--weights-only", is_flag=True, help="Write only the model state dict, dropping optimizer etc.")
@click.option("--key", metavar="PATH", help="Where the weights are in SRC, e.g. ema or ema/model.")
@click.option("--trust", is_flag=True, help="Allow arbitrary unpickling of SRC. Only for files you trust.")
@click.option("--force", is_flag=True, help="Replace DST if it exists.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_handle_errors
def convert(src: str, dst: str, to: str, strip: tuple[str, ...], add: tuple[str, ...], weights_only: bool,
            key: str | None, trust: bool, force: bool, as_json: bool) -> None:  # fmt: skip
    """Rewrite SRC's weight names for another wrapping into DST (format by DST suffix).

    Only the model weights are renamed; optimizer, scheduler, epoch and the rest are kept as
    they were unless --weights-only. DST appears only when complete; SRC is never modified.
    """
    from ckptkit import convert_checkpoint

    from ._render import human_bytes, progress_bar

    with progress_bar(src, threshold=_BIG, enabled=not as_json) as progress:
        report = convert_checkpoint(src, dst, to=to, strip=strip, add=add, weights_only=weights_only, key=key,
                                    trust=trust, force=force, progress=progress)  # fmt: skip
    if as_json:
        _emit_json(report.to_dict())
        return
    if report.fallback_reason:
        click.echo(f"note: {report.fallback_reason}", err=True)
    if report.dropped:
        click.echo(f"note: not written (--weights-only): {', '.join(report.dropped)}", err=True)
    where = f" (weights at '{report.weights_at}')" if report.weights_at else ""
    click.echo(
        f"{report.destination}: {report.tensors} tensors{where}, {report.renamed} renamed "
        f"({report.prefix_before or 'no prefix'} -> {report.prefix_after or 'no prefix'}), "
        f"{human_bytes(report.bytes)}, {report.destination_format}"
    )


@main.command()
@click.argument("file", type=click.Path(path_type=str))
@click.option("--key", metavar="PATH", help="Where the weights are, if not found automatically.")
@click.option("--all", "show_all", is_flag=True, help="List every key group, not the first 40.")
@click.option("--trust", is_flag=True, help="Allow arbitrary unpickling. Only for files you trust.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (every tensor listed).")
@_handle_errors
def inspect(file: str, key: str | None, show_all: bool, trust: bool, as_json: bool) -> None:
    """Summarise FILE: layout, where the weights are, wrapper prefixes, tensors, metadata."""
    from ckptkit import inspect_checkpoint

    summary = inspect_checkpoint(file, key=key, trust=trust)
    if as_json:
        _emit_json(summary.to_dict())
    else:
        from ._render import render_summary

        render_summary(summary, show_all=show_all)
    if summary.needs_trust:
        sys.exit(1)


@main.command()
@click.argument("a", type=click.Path(path_type=str))
@click.argument("b", type=click.Path(path_type=str))
@click.option("--atol", type=float, default=0.0, show_default=True, help="Absolute tolerance.")
@click.option("--rtol", type=float, default=0.0, show_default=True, help="Relative tolerance.")
@click.option("--key-a", metavar="PATH", help="Where the weights are in A.")
@click.option("--key-b", metavar="PATH", help="Where the weights are in B.")
@click.option("--trust", is_flag=True, help="Allow arbitrary unpickling. Only for files you trust.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@_handle_errors
def diff(a: str, b: str, atol: float, rtol: float, key_a: str | None, key_b: str | None, trust: bool, as_json: bool) -> None:
    """Compare the model weights of A and B across formats and prefixes. Exit 1 if they differ."""
    from ckptkit import diff_checkpoints

    report = diff_checkpoints(a, b, atol=atol, rtol=rtol, key_a=key_a, key_b=key_b, trust=trust)
    if as_json:
        _emit_json(report.to_dict())
    else:
        from ._render import render_diff

        render_diff(report)
    sys.exit(0 if report.equal else 1)


@main.command()
@click.argument("file", type=click.Path(path_type=str))
@click.option("--json", "as_json", is_flag=True, help="Print the checks as JSON.")
@_handle_errors
def verify(file: str, as_json: bool) -> None:
    """Check FILE's integrity (CRCs, bounds, shards) and that it loads without --trust. Exit 1 if not."""
    from ckptkit import verify_checkpoint

    report = verify_checkpoint(file)
    if as_json:
        _emit_json(report.to_dict())
    else:
        from ._render import render_verify

        render_verify(report)
    sys.exit(0 if report.ok else 1)


class _TrainCommand(click.Command):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from ckptkit.train import build_parser  # imported for --help only: it does not import torch

        text = build_parser().format_help()
        formatter.write_paragraph()
        formatter.write_text("Every other option goes to the trainer (python -m ckptkit.train):")
        for line in text[text.index("options:") :].splitlines()[1:]:
            if "-h, --help" not in line:
                formatter.write(line + "\n")


@main.command(cls=_TrainCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option("--nproc", type=int, default=1, show_default=True, help="Processes on this node (GPUs, or CPU workers).")
@click.option("--nnodes", default="1", show_default=True, help="Nodes, or MIN:MAX for elastic runs.")
@click.option("--node-rank", type=int, default=None, help="This node's rank (static multi-node rendezvous).")
@click.option("--master-addr", default=None, help="Rank 0 node's address (static rendezvous).")
@click.option("--master-port", type=int, default=None, help="Rank 0 node's port (static rendezvous).")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT for c10d rendezvous (elastic multi-node).")
@click.option("--rdzv-id", default=None, help="Job id shared by the nodes of one run.")
@click.option("--max-restarts", type=int, default=0, show_default=True, help="Restart the group this often after a failure.")
@click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED)
def train(nproc: int, nnodes: str, node_rank: int | None, master_addr: str | None, master_port: int | None,
          rdzv_endpoint: str | None, rdzv_id: str | None, max_restarts: int, trainer_args: tuple[str, ...]) -> None:  # fmt: skip
    """Run the reference DDP trainer through torch's own launcher (torchrun).

    \b
    ckptkit train --nproc 2 --out runs/demo            # built-in task, resumes automatically
    ckptkit train --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --out /shared/run
    ckptkit train --nproc 4 --max-restarts 3 --model pkg.nets:make --data pkg.data:make --out runs/x
    """
    import os

    launcher = ["--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", str(max_restarts)]
    if node_rank is not None:
        launcher += ["--node-rank", str(node_rank)]
    if master_addr:
        launcher += ["--master-addr", master_addr]
    if master_port:
        launcher += ["--master-port", str(master_port)]
    if rdzv_endpoint:
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint] + (["--rdzv-id", rdzv_id] if rdzv_id else [])
    if nnodes == "1" and not (master_addr or rdzv_endpoint):
        launcher.append("--standalone")  # one node: a free port, no address to configure
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "ckptkit.train", *trainer_args]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, cmd)  # torchrun takes over this process: signals reach it directly


if __name__ == "__main__":
    main()
