"""Run a function on N real processes joined in a gloo process group (no mocks).

Each rank is a spawned process that initialises torch.distributed with a file rendezvous,
runs ``fn(rank, world_size, *args)`` and reports its return value, or the exception's class
names and message. A rank that neither reports nor exits by the deadline counts as hung; the
helper kills it, so a deadlock fails the test instead of stalling CI.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class RankResult:
    rank: int
    status: str  # "ok", "error", "died" (exited without reporting) or "hung" (killed at the deadline)
    value: Any = None
    error_types: tuple[str, ...] = ()
    message: str = ""
    seconds: float = 0.0
    exitcode: int | None = None

    def raised(self, name: str) -> bool:
        return self.status == "error" and name in self.error_types


def _entry(
    fn: Callable[..., Any], rank: int, world: int, rdzv: str, out: Any, args: tuple[Any, ...], env: dict[str, str]
) -> None:
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60)
    )
    start = time.monotonic()
    try:
        value = fn(rank, world, *args)
    except BaseException as e:
        out.put(
            (
                rank,
                "error",
                None,
                tuple(c.__name__ for c in type(e).__mro__),
                f"{e}\n{traceback.format_exc()}",
                time.monotonic() - start,
            )
        )
    else:
        out.put((rank, "ok", value, (), "", time.monotonic() - start))
    finally:
        dist.destroy_process_group()


def run_group(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: Path,
    *args: Any,
    timeout: float = 120.0,
    env: dict[str, str] | None = None,
) -> list[RankResult]:
    """Run ``fn`` on ``world_size`` ranks; return one result per rank, in rank order."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    rdzv = str(tmp_path / f"rdzv-{uuid.uuid4().hex}")
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, rdzv, out, args, env or {}), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, RankResult] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world_size and time.monotonic() < deadline:
        try:
            rank, status, value, types, message, seconds = out.get(timeout=0.5)
            results[rank] = RankResult(rank, status, value, types, message, seconds)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and out.empty():
                break
    for r, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) + 5)
        if p.is_alive():
            p.kill()
            p.join()
            results.setdefault(r, RankResult(r, "hung"))
        results.setdefault(r, RankResult(r, "died"))
        results[r].exitcode = p.exitcode
    return [results[r] for r in range(world_size)]


def ok_values(results: list[RankResult]) -> list[Any]:
    """Every rank's return value, failing with the ranks' own messages if any rank did not succeed."""
    bad = [r for r in results if r.status != "ok"]
    assert not bad, "\n".join(f"rank {r.rank}: {r.status} {r.message}" for r in bad)
    return [r.value for r in results]
