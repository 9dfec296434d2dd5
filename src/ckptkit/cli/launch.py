"""``ckptkit train``: check the options, then run the reference trainer under torchrun's agent.

torchrun's agent runs in this process, so this command sees what torchrun would otherwise
print as a traceback. A signal (Ctrl-C, a scheduler's SIGTERM, a closed terminal) stops the
agent here, and the agent, shutting down, sends the workers SIGTERM (each worker is in its own
session, so it gets nothing else): they stop together at the next step and save, while a worker
still starting up just ends (SIGTERM, unlike SIGINT, leaves no traceback from an import). The
command then says, in one line, where the run stopped and exits 0, or 130 when nothing could be
saved. Options are checked before a worker starts: a typo costs one line and creates nothing.
A worker that fails records its error (:mod:`ckptkit.train.failure`) and prints nothing; the
command tells the first one, with its rank, in one line (``ckptkit --debug train`` lets the
workers print their tracebacks too).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import NoReturn

import click

from ckptkit.errors import ArgumentError
from ckptkit.train import TrainConfig, build_parser, check_environment, log_folder, parse_args, run_path
from ckptkit.train import failure as worker_failure

from .base import Stopped, handle_errors, main, signals_deferred


class _TrainCommand(click.Command):
    def format_epilog(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        text = build_parser().format_help()
        formatter.write_paragraph()
        formatter.write_text("Every other option goes to the trainer (python -m ckptkit.train):")
        for line in text[text.index("options:") :].splitlines()[1:]:
            if "-h, --help" not in line:
                formatter.write(line + "\n")


@main.command(cls=_TrainCommand, context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.option(
    "--nproc",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Processes on this node (GPUs, or CPU workers).",
)
@click.option("--nnodes", default="1", show_default=True, help="Nodes, or MIN:MAX for elastic runs.")
@click.option("--node-rank", type=int, default=None, help="This node's rank (static multi-node rendezvous).")
@click.option("--master-addr", default=None, help="Rank 0 node's address (static rendezvous).")
@click.option("--master-port", type=int, default=None, help="Rank 0 node's port (static rendezvous).")
@click.option("--rdzv-endpoint", default=None, help="HOST:PORT for c10d rendezvous (elastic multi-node).")
@click.option("--rdzv-id", default=None, help="Job id shared by the nodes of one run.")
@click.option(
    "--max-restarts", type=int, default=0, show_default=True, help="Restart the group this often after a failure."
)
@click.option(
    "--shutdown-timeout",
    type=click.IntRange(min=1),
    default=300,
    show_default=True,
    help="Seconds the workers get to save after Ctrl-C or SIGTERM, before SIGKILL.",
)
@click.argument("trainer_args", nargs=-1, type=click.UNPROCESSED)
@handle_errors(stopped=("nothing was saved", 130), logs=True)
def train(
    nproc: int,
    nnodes: str,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    rdzv_endpoint: str | None,
    rdzv_id: str | None,
    max_restarts: int,
    shutdown_timeout: int,
    trainer_args: tuple[str, ...],
) -> None:
    """Run the reference DDP trainer through torch's own launcher (torchrun).

    \b
    ckptkit train --nproc 2 --out runs/demo            # built-in task, resumes automatically
    ckptkit train --nproc 8 --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 --out /shared/run
    ckptkit train --nproc 4 --max-restarts 3 --model pkg.nets:make --data pkg.data:make --out runs/x

    Ctrl-C or SIGTERM: every rank stops at the next step and saves; exit 0 (130 if nothing
    could be saved yet). Running the same command again resumes.
    """
    cfg = parse_args(list(trainer_args))  # usage errors: one line, exit 2, before torch loads
    with signals_deferred():  # Ctrl-C while torch's C++ starts up: raised once it has (only that:
        import torch.distributed.run  # noqa: F401  # a user's --model below stays interruptible)
    check_environment(cfg)  # a missing --resume file, an --model that does not import: exit 1
    source = click.get_current_context().get_parameter_source("shutdown_timeout")
    if source != click.core.ParameterSource.DEFAULT and "--shutdown-timeout" not in _torchrun_options():
        import torch

        raise ArgumentError(
            f"--shutdown-timeout: the torchrun of this torch ({torch.__version__}) cannot set the workers' "
            "grace period (a newer torch's torchrun can); leave it out to use torchrun's own"
        )
    launcher = ["--nproc-per-node", str(nproc), "--nnodes", nnodes, "--max-restarts", str(max_restarts)]
    if node_rank is not None:
        launcher += ["--node-rank", str(node_rank)]
    if master_addr:
        launcher += ["--master-addr", master_addr]
    if master_port:
        launcher += ["--master-port", str(master_port)]
    if rdzv_endpoint:
        launcher += ["--rdzv-backend", "c10d", "--rdzv-endpoint", rdzv_endpoint] + (
            ["--rdzv-id", rdzv_id] if rdzv_id else []
        )
    if nnodes == "1" and not (master_addr or rdzv_endpoint):
        launcher.append("--standalone")  # one node: a free port, no address to configure
    debug = bool(click.get_current_context().find_root().params.get("debug"))
    _run_torchrun(launcher, list(trainer_args), cfg, shutdown_timeout, debug=debug)


def _run_torchrun(
    launcher: list[str], trainer_args: list[str], cfg: TrainConfig, shutdown_timeout: int, *, debug: bool
) -> NoReturn:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    parser = get_args_parser()
    known = _torchrun_options()
    if "--shutdown-timeout" in known:  # else (torch 2.6) the agent's own grace period; asked for, refused above
        launcher = [*launcher, "--shutdown-timeout", str(shutdown_timeout)]
    if "--signals-to-handle" in known:
        # The agent would pass SIGINT on to the workers, and a worker still importing Python
        # modules dies of it with a traceback. Left to this process, they raise here instead,
        # and the agent's shutdown sends SIGTERM.
        launcher = [*launcher, "--signals-to-handle", "SIGQUIT"]
    # The trainer logs what matters; the agent's warnings ("Received SIGINT death signal...",
    # the OMP_NUM_THREADS banner) would only repeat it, and so would its error line about a
    # failed worker, which this command tells itself. torch sets each logger's level itself.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith(("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")):
            logging.getLogger(name).setLevel(logging.ERROR if debug else logging.CRITICAL)
    if not debug:
        os.environ[worker_failure.QUIET] = "1"  # the workers inherit it from the agent, which runs here
    started = time.time()
    sys.stdout.flush()
    try:
        try:
            run(parser.parse_args([*launcher, "--module", "ckptkit.train", *trainer_args]))
            code, message = 0, None
        except SignalException as e:
            code, message = _stopped(signal.Signals(e.sigval).name, cfg, started)
        except KeyboardInterrupt:
            code, message = _stopped("SIGINT", cfg, started)
        except Stopped as e:
            code, message = _stopped(signal.Signals(e.signum).name, cfg, started)
        except ChildFailedError as e:
            code, message = _failed(e, debug=debug)
    finally:
        _end_workers(shutdown_timeout)
    # An agent interrupted while it started the workers can leave this interpreter unable to
    # finish its own exit (seen: the main thread stuck in finalization after the last line).
    # Its work is done and the workers are gone: leave at once.
    if message is not None:
        click.echo(message, err=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _torchrun_options() -> set[str]:
    """The options this torch's torchrun takes (torch 2.6's lacks ``--shutdown-timeout`` and
    ``--signals-to-handle``): ckptkit passes torchrun only what it has."""
    from torch.distributed.run import get_args_parser

    return {option for action in get_args_parser()._actions for option in action.option_strings}


def _stopped(name: str, cfg: TrainConfig, started: float) -> tuple[int, str]:
    end = _last_end(log_folder(cfg), started)
    if end is not None and end.get("status") == "preempted":
        checkpoint = run_path(cfg, f"checkpoints/step_{end['step']:09d}.pt")
        return (
            0,
            f"ckptkit: stopped by {name} at step {end['step']}; saved {checkpoint}; run the same command to resume",
        )
    return 130, f"ckptkit: error: stopped by {name}; nothing was saved (the run had not reached its first save)"


def _failed(e: Exception, *, debug: bool = False) -> tuple[int, str]:
    """The first cause of a failed run, in one line, and the exit code.

    Once one worker fails, the agent sends the others SIGTERM, and they fail in turn (killed,
    or a collective losing its peer): so the cause is the error recorded first, not the last
    failure seen. Without a record (a worker killed by the kernel, or ended by ``os._exit``), a
    signal other than the agent's SIGTERM, or an exit code, names the rank it ended.
    """
    failures = getattr(e, "failures", {}) or {}
    told = [(f.time, rank, f) for rank, p in failures.items() if (f := worker_failure.read(p.error_file)) is not None]
    if told:
        _, rank, first = min(told, key=lambda t: (t[0], t[1]))
        # A ckptkit error says its fix; for any other, the traceback is where the fix starts.
        hint = "" if first.expected or debug else "; ckptkit --debug train ... shows its traceback"
        return first.exit_code, f"ckptkit: error: rank {rank}: {first.line}{hint}"
    ended = {rank: p.exitcode for rank, p in failures.items()}
    own = {rank: code for rank, code in ended.items() if code != -signal.SIGTERM} or ended
    if not own:
        return 1, "ckptkit: error: training failed"
    rank, code = min(own.items())
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
    return 1, f"ckptkit: error: training failed: rank {rank} {how}"


def _end_workers(timeout: float) -> None:
    """SIGTERM, then after ``timeout`` SIGKILL, any worker the agent left running.

    The agent stops its workers when it shuts down, but not those it was still starting when a
    signal interrupted it: they would wait for their peers forever.
    """
    left = _children()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _children()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _children() -> list[int]:
    """This process's live children (zombies reaped), from /proc; none where /proc is missing."""
    found = []
    me = os.getpid()
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) != me:
            continue
        if fields[0] == "Z":
            with contextlib.suppress(ChildProcessError):
                os.waitpid(int(entry), os.WNOHANG)
            continue
        found.append(int(entry))
    return found


def _last_end(out: Path, since: float) -> dict | None:
    """The trainer's last ``end`` record written after ``since``, if any."""
    try:
        lines = (out / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("event") == "end" and record.get("time", 0) >= since:
            return record
    return None
