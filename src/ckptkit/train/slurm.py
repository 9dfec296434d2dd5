"""The trainer under SLURM: ranks from srun's environment, and requeueing a job it stopped.

``srun`` starts one task per process, without torchrun: :func:`torch_env` turns srun's variables
into those torch's ``env://`` rendezvous reads (torchrun's own, where set, win). When the requeue
signal (``--requeue-signal``, what ``#SBATCH --signal=B:USR1@90`` sends before the time limit or
a preemption) stopped the run, rank 0 calls :func:`requeue` once every rank has saved; the job
runs again later, and the same command resumes from that checkpoint.

Example:
    >>> torch_env({"SLURM_STEP_ID": "0", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1",
    ...            "SLURM_JOB_NODELIST": "gpu5", "SLURM_JOB_ID": "12"}, hostnames=expand_nodelist)
    {'RANK': '1', 'WORLD_SIZE': '2', 'LOCAL_RANK': '1', 'MASTER_ADDR': 'gpu5', 'MASTER_PORT': '20012'}
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

from ckptkit.errors import DistributedError

# Below Linux's ephemeral ports (32768 and up), which any outgoing connection may hold; spread
# over job ids so that two jobs sharing a node rarely pick the same port.
PORT_BASE, PORT_SPAN = 20000, 10000
RequeueSignal = Literal["USR1", "TERM", "HUP"]


def expand_nodelist(nodelist: str) -> list[str]:
    """The hosts of a SLURM node list, in order (the fallback where ``scontrol`` is missing).

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']

    Raises:
        ValueError: a range that is not ``N`` or ``N-M``.
    """
    hosts: list[str] = []
    for item in _split_outside_brackets(nodelist):
        m = re.fullmatch(r"([^\[]*)\[([^\]]*)\](.*)", item)
        if m is None:
            hosts.append(item)
            continue
        head, ranges, tail = m.groups()
        tails = expand_nodelist(tail) or [""]  # rack[1-2]-node[1-2]: every combination, in order
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            if not lo.isdigit() or not (hi or lo).isdigit():
                raise ValueError(f"node list {nodelist!r}: [{ranges}] holds {part!r}, expected N or N-M")
            hosts += [f"{head}{n:0{len(lo)}d}{rest}" for n in range(int(lo), int(hi or lo) + 1) for rest in tails]
    return hosts


def _split_outside_brackets(text: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def scontrol_hostnames(nodelist: str) -> list[str]:
    """``scontrol show hostnames NODELIST``, or :func:`expand_nodelist` where scontrol cannot run."""
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return expand_nodelist(nodelist)
    hosts = out.stdout.split()
    return hosts if out.returncode == 0 and hosts else expand_nodelist(nodelist)


def port_for_job(job_id: str) -> int:
    """The rendezvous port of a job: every task of the job derives the same one.

    Example:
        >>> port_for_job("4321987")
        21987
    """
    return PORT_BASE + int(job_id) % PORT_SPAN


def launched_ranks(environ: Mapping[str, str]) -> int:
    """How many ranks the launcher of this process started: torchrun's ``WORLD_SIZE``, an srun
    step's ``SLURM_NTASKS``; 1 outside both (an sbatch script itself is no step).

    Example:
        >>> launched_ranks({"WORLD_SIZE": "4"}), launched_ranks({"SLURM_STEP_ID": "0", "SLURM_NTASKS": "2"})
        (4, 2)
        >>> launched_ranks({"SLURM_NTASKS": "2"}), launched_ranks({})
        (1, 1)
    """
    value = environ.get("WORLD_SIZE") or (environ.get("SLURM_NTASKS") if "SLURM_STEP_ID" in environ else None)
    try:
        return max(1, int(value or 1))
    except ValueError:
        return 1


def torch_env(
    environ: Mapping[str, str], *, hostnames: Callable[[str], list[str]] = scontrol_hostnames
) -> dict[str, str]:
    """What to add to the environment so that an srun task joins the group as torchrun's would.

    Empty under torchrun (``WORLD_SIZE`` or ``RANK`` set), outside an srun step (no
    ``SLURM_STEP_ID``: the batch script itself, where ``SLURM_PROCID`` is 0 whatever
    ``--ntasks`` says) and for a single task. ``MASTER_ADDR`` (the first host of the job) and
    ``MASTER_PORT`` (from the job id) are left alone where already set.

    Raises:
        DistributedError: a SLURM variable this needs is missing or not a number.
    """
    if "WORLD_SIZE" in environ or "RANK" in environ or "SLURM_STEP_ID" not in environ:
        return {}
    try:
        rank, world = int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"])
        local = int(environ.get("SLURM_LOCALID", "0"))
        if world == 1:
            return {}
        env = {"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local)}
        env["MASTER_ADDR"] = environ.get("MASTER_ADDR") or hostnames(environ["SLURM_JOB_NODELIST"])[0]
        env["MASTER_PORT"] = environ.get("MASTER_PORT") or str(port_for_job(environ["SLURM_JOB_ID"]))
    except (KeyError, ValueError, IndexError) as e:
        found = {
            k: environ.get(k)
            for k in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_NODELIST", "SLURM_JOB_ID")
        }
        raise DistributedError(
            f"srun task: cannot tell its rank from {found} ({type(e).__name__}: {e}); run it with srun in a "
            "job, or set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT yourself"
        ) from e
    return env


def requeue_signal(name: str) -> signal.Signals:
    """The signal ``--requeue-signal`` names.

    Example:
        >>> requeue_signal("USR1").name
        'SIGUSR1'
    """
    return signal.Signals[f"SIG{name}"]


def restarts(environ: Mapping[str, str]) -> int:
    """How often this job was requeued: ``SLURM_RESTART_COUNT``, which SLURM sets only from the first
    requeue on (unset: 0).

    Example:
        >>> restarts({}), restarts({"SLURM_RESTART_COUNT": "2"})
        (0, 2)
    """
    return int(environ.get("SLURM_RESTART_COUNT") or 0)


@dataclass(frozen=True)
class Outcome:
    """What happened to the job after the stop: ``line`` says it in words; ``requeues`` counts this
    job's requeues so far, this one included."""

    requeued: bool
    job: str | None
    requeues: int
    line: str


def requeue(
    stopped_by: tuple[int, ...],
    *,
    signal_name: RequeueSignal,
    max_requeues: int,
    environ: Mapping[str, str] = os.environ,
) -> Outcome | None:
    """Requeue this SLURM job if the requeue signal stopped it; call on rank 0 once every rank saved.

    SLURM ends the job's processes right after ``scontrol requeue``: call it last. None outside
    SLURM when another signal stopped the run (nothing to say).

    Args:
        stopped_by: the signals any rank received (:attr:`ckptkit.StopSignal.stopped_by`).
        signal_name: the signal that asks for a requeue (``--requeue-signal``).
        max_requeues: requeue at most this many times in all; -1: no limit.
        environ: the job's environment (``SLURM_JOB_ID``, ``SLURM_RESTART_COUNT``).

    Example:
        >>> requeue((signal.SIGTERM,), signal_name="USR1", max_requeues=-1, environ={}) is None
        True
    """
    sig = requeue_signal(signal_name)
    job, done = environ.get("SLURM_JOB_ID"), restarts(environ)
    if sig not in stopped_by:
        got = ", ".join(signal.Signals(s).name for s in stopped_by)
        return (
            None
            if job is None
            else Outcome(
                False,
                job,
                done,
                f"not requeued: {got} stopped job {job}, not {sig.name} "
                "(--requeue-signal): it ends here (scancel, or the time limit without #SBATCH --signal)",
            )
        )
    if job is None:
        return Outcome(
            False,
            None,
            0,
            f"not requeued: {sig.name} stopped the run, but this is no SLURM job (SLURM_JOB_ID is unset)",
        )
    again = "submit it again to train on from here"
    if 0 <= max_requeues <= done:
        return Outcome(
            False,
            job,
            done,
            f"not requeued: job {job} was requeued {done} time(s) already (--max-requeues {max_requeues}); {again}",
        )
    shown = _scontrol("show", "job", job)
    if shown.returncode == 0 and re.search(r"\bRequeue=0\b", shown.stdout):
        return Outcome(
            False,
            job,
            done,
            f"not requeued: job {job} was submitted without --requeue (scontrol show job {job}: Requeue=0); "
            f"submit it with sbatch --requeue, or {again}",
        )
    asked = _scontrol("requeue", job)
    if asked.returncode != 0:
        why = (asked.stderr or asked.stdout).strip().splitlines()[-1:] or [f"exit status {asked.returncode}"]
        return Outcome(False, job, done, f"not requeued: scontrol requeue {job} failed: {why[0]}; {again}")
    limit = f" of {max_requeues}" if max_requeues >= 0 else ""
    return Outcome(True, job, done + 1, f"requeued job {job} (requeue {done + 1}{limit})")


def _scontrol(*args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return subprocess.CompletedProcess(
            ["scontrol", *args], 127, "", f"cannot run scontrol ({type(e).__name__}: {e})"
        )


@contextlib.contextmanager
def term_ignored() -> Iterator[None]:
    """SIGTERM ignored within: SLURM sends it to every process of a job it requeues, and the
    process that asked should still say so before it ends."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set handlers
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
