"""A DistributedSampler that resumes mid-epoch, also with a different number of ranks.

DistributedSampler deals the epoch's global order out round-robin: rank r takes
``order[r::world_size]``. After every rank has consumed k samples, together they have consumed
exactly the first ``k * world_size`` samples of that order, so a single global count is the
whole position. Resuming deals out ``order[position:]`` to however many ranks there are now.
With the same world size the continuation is sample-for-sample what the uninterrupted run
would have seen (the tail padding included: it repeats the head of the epoch's order, as
DistributedSampler's does).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data.distributed import DistributedSampler

from ..distributed import collectives as _dist
from ..errors import ArgumentError, ResumeError


class ResumableDistributedSampler(DistributedSampler):  # type: ignore[type-arg]
    """Drop-in replacement for ``torch.utils.data.DistributedSampler`` with exact resume.

    Same constructor and the same order as DistributedSampler (and it works without a
    process group: one replica, rank 0). Call :meth:`advance` with the number of samples this
    rank consumed after each step: the sampler cannot tell by itself, because DataLoader
    workers and prefetching draw indices ahead of training. Its :meth:`state_dict` records the
    epoch and the global position; :meth:`load_state_dict` continues from there.

    ``set_epoch(e)`` starts epoch ``e`` at position 0, except when ``e`` is already the current
    epoch, so the usual ``for epoch in range(start, n): sampler.set_epoch(epoch)`` loop keeps a
    restored mid-epoch position.

    Resuming with a different world size continues from the same global sample: no sample of
    the epoch is replayed or skipped (beyond DistributedSampler's own tail padding). It is not
    bit-exact then: batches group samples differently and gradients are averaged over a
    different number of ranks.

    Example:
        >>> sampler = ResumableDistributedSampler(dataset, shuffle=True, seed=0)  # doctest: +SKIP
        >>> loader = DataLoader(dataset, batch_size=32, sampler=sampler)  # doctest: +SKIP
        >>> for batch in loader:  # doctest: +SKIP
        ...     step(batch); sampler.advance(len(batch[0]))
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=_dist.world_size() if num_replicas is None else num_replicas,
            rank=_dist.rank() if rank is None else rank,
            shuffle=shuffle,
            seed=seed,
            drop_last=drop_last,
        )
        self.position = 0
        self._pass_done = False
        self._yielded = 0
        self._advanced = False

    def _order(self) -> list[int]:
        n = len(self.dataset)  # type: ignore[arg-type]
        if not self.shuffle:
            return list(range(n))
        g = torch.Generator()
        g.manual_seed(self.seed + self.epoch)
        return torch.randperm(n, generator=g).tolist()

    def _remaining(self) -> list[int]:
        order = self._order()
        rest = order[self.position :]
        w = self.num_replicas
        if self.drop_last:
            return rest[: len(rest) // w * w]
        pad = -len(rest) % w
        if pad and order:
            rest += (order * math.ceil(pad / len(order)))[:pad]
        return rest

    def __iter__(self) -> Iterator[int]:
        if self._pass_done:  # iterating the same epoch again, as DistributedSampler allows
            self.position = 0
            self._pass_done = False
        self._yielded = 0
        for index in self._remaining()[self.rank :: self.num_replicas]:
            self._yielded += 1
            yield index
        self._pass_done = True

    def __len__(self) -> int:
        left = max(len(self.dataset) - self.position, 0)  # type: ignore[arg-type]
        w = self.num_replicas
        return left // w if self.drop_last else math.ceil(left / w)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning, unless it is the current epoch already."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.position = 0
            self._pass_done = False

    def advance(self, num_samples: int) -> None:
        """Record that this rank consumed ``num_samples`` more samples of the current epoch.

        Every rank consumes the same number per step (DistributedSampler pads to make it so),
        so the global position moves by ``num_samples * num_replicas``.
        """
        if num_samples < 0:
            raise ArgumentError(f"advance() takes a sample count >= 0, got {num_samples}")
        self._advanced = True
        self.position = min(self.position + num_samples * self.num_replicas, len(self.dataset))  # type: ignore[arg-type]

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the global position within it, and what defines the order."""
        if self._yielded and not self._advanced and not self._pass_done:
            warnings.warn(
                "ResumableDistributedSampler.state_dict() mid-epoch, but advance() was never called: "
                "a resume will restart this epoch. Call sampler.advance(batch_size) after each step.",
                stacklevel=2,
            )
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "dataset_len": len(self.dataset),  # type: ignore[arg-type]
            "num_replicas": self.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`, whatever the number of replicas now.

        Raises:
            ResumeError: the dataset size changed, so the saved position means nothing.
        """
        n = len(self.dataset)  # type: ignore[arg-type]
        if state["dataset_len"] != n:
            raise ResumeError(
                f"the sampler state is for a dataset of {state['dataset_len']} samples, this one has {n}; "
                "resuming would replay or skip samples. Resume with the same dataset, or start the epoch over"
            )
        changed = [k for k in ("seed", "shuffle", "drop_last") if state[k] != getattr(self, k)]
        if changed:
            warnings.warn(
                f"sampler {', '.join(changed)} differ from the checkpoint's; using the checkpoint's so the "
                "epoch continues in the same order",
                stacklevel=2,
            )
        self.seed, self.shuffle, self.drop_last = state["seed"], state["shuffle"], state["drop_last"]
        self.epoch = state["epoch"]
        self.position = min(int(state["position"]), n)
        self._pass_done = False
        self._yielded = 0
        self._advanced = False
