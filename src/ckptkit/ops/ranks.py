"""A sharded convert run by every rank of a process group (torchrun, srun): each writes its share.

Every rank runs the same convert (the same checks, the same plan of shards) on a filesystem
they share. They meet three times, whatever happens to any of them, so that none waits for a
rank that stopped early:

1. rank 0 sends the temp folder it made beside the output, with each rank's share of the
   shard files (or its failure);
2. each rank says whether its share is written, checked and durable (or why not);
3. rank 0, having written the index and published the folder once every share was there,
   says whether it did (or which rank failed, and why).

A failure on any rank fails every rank with the same error, naming the rank and its cause, and
leaves no folder.

Example:
    >>> convert_checkpoint("ckpt.dcp", "/shared/hf/", max_shard_size="2GB", ranks=True)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..distributed import collectives as cc
from ..errors import CheckpointWriteError, CkptkitError, DistributedError, cause
from .workers import Share

# A rank may write its share for hours (a large model's shards) while the others, done with
# theirs, wait for it: a meeting waits that long before calling a rank lost.
MEETING_TIMEOUT_S = 24 * 3600.0
MEETINGS = 3

_Failure = tuple[type[CkptkitError], str]  # what every rank raises: the type, and its text naming the rank
_Said = tuple[str, Any]  # ("ok", payload) or ("failed", _Failure)


@dataclass
class Ranks:
    """The meetings of one sharded convert across the process group. Rank 0 passes it to the
    writer as ``spread``; the others pass :meth:`receive` as their part's source. ``shares``:
    what the other ranks reported (on rank 0, after meeting 2)."""

    dst: str
    shares: list[Share] = field(default_factory=list)
    met: int = 0

    @property
    def rank(self) -> int:
        return cc.rank()

    @property
    def count(self) -> int:
        return cc.world_size()

    @property
    def joined(self) -> bool:
        """Whether this process is in a process group (else it is rank 0 of 1)."""
        return cc.is_distributed()

    def _meet(self, said: _Said, *, gather: bool) -> list[_Said]:
        self.met += 1
        what = f"convert {self.dst}: meeting {self.met} of {MEETINGS} of the ranks"
        if gather:
            return cc.all_gather_object(said, timeout_s=MEETING_TIMEOUT_S, what=what)
        return [cc.broadcast_object(said, src=0, timeout_s=MEETING_TIMEOUT_S, what=what)]

    def __call__(self, folder: Path, shares: list[list[str]]) -> Callable[[bool], list[Any]]:
        """Rank 0, meeting 1: the folder and the other ranks' shares; returns ``finish(ok)``
        (meeting 2), which raises the first other rank's failure, or returns what each other
        rank's writer reported."""
        self._meet(("ok", (str(folder), shares)), gather=False)

        def finish(ok: bool) -> list[Any]:
            said = self._meet(("ok", None) if ok else ("failed", (CheckpointWriteError, "rank 0 failed")), gather=True)
            if not ok:
                return []  # this rank raises its own failure
            failed = [value for status, value in said[1:] if status != "ok"]
            if failed:
                raise _raised(failed[0])
            self.shares = [value for _, value in said[1:] if value is not None]
            return [share.reported for share in self.shares]

        return finish

    def receive(self) -> tuple[Path, list[str]]:
        """Another rank, meeting 1: the temp folder and this rank's share (none where there are
        fewer shards than ranks)."""
        ((status, value),) = self._meet(("ok", None), gather=False)
        if status != "ok":
            raise _raised(value)
        folder, shares = value
        return Path(folder), shares[self.rank - 1] if self.rank - 1 < len(shares) else []

    def done(self, share: Share | None) -> None:
        """This rank finished its part: the meetings left (2 and 3 on the others, 3 on rank 0,
        whose meeting 2 was in the writer); raises where another rank failed."""
        if self.rank != 0:
            self._meet(("ok", share), gather=True)
        ((status, value),) = self._meet(("ok", None), gather=False)
        if status != "ok":
            raise _raised(value)

    def failed(self, e: BaseException) -> BaseException:
        """This rank failed with ``e``: holds the meetings left, saying so; returns the error to
        raise: rank 0's word on the outcome (on rank 0, ``e`` named for its rank)."""
        if isinstance(e, DistributedError):  # a meeting itself failed: a rank is gone, no more meetings
            return e
        if isinstance(e, CkptkitError) and getattr(e, "ranks_said", False):  # another rank's, already named
            mine: _Failure = (type(e), str(e))
        elif isinstance(e, CkptkitError):
            mine = (type(e), f"rank {self.rank}: {cause(e, typed=False)}")
        else:
            mine = (CheckpointWriteError, f"rank {self.rank}: {cause(e)}")
        verdict = mine
        try:
            while self.met < MEETINGS:
                if self.met == 1:
                    self._meet(("failed", mine), gather=True)
                    continue
                ((status, value),) = self._meet(("failed", mine) if self.rank == 0 else ("ok", None), gather=False)
                if self.met == MEETINGS and status != "ok":
                    verdict = value
        except DistributedError:
            pass  # another rank is gone too: this rank's own failure is what it knows
        return _raised(verdict)


def _raised(failure: _Failure) -> CkptkitError:
    """The error every rank raises for ``failure`` (marked: :meth:`Ranks.failed` passes it on as is)."""
    kind, text = failure
    try:
        error = kind(text)
    except TypeError:  # an error type that takes other arguments
        error = CheckpointWriteError(text)
    error.ranks_said = True  # type: ignore[attr-defined]
    return error
