from __future__ import annotations

import pytest
from torch.utils.data.distributed import DistributedSampler

import ckptkit


def ranks(n: int, world: int, **kw) -> list[ckptkit.ResumableDistributedSampler]:
    data = list(range(n))
    return [ckptkit.ResumableDistributedSampler(data, num_replicas=world, rank=r, **kw) for r in range(world)]


@pytest.mark.parametrize("n,world,drop_last", [(40, 2, False), (41, 3, False), (41, 3, True), (5, 8, False)])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_order_as_distributed_sampler(n: int, world: int, drop_last: bool, shuffle: bool) -> None:
    for r in range(world):
        ours = ckptkit.ResumableDistributedSampler(
            range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=3, drop_last=drop_last
        )
        theirs = DistributedSampler(range(n), num_replicas=world, rank=r, shuffle=shuffle, seed=3, drop_last=drop_last)
        for epoch in (0, 1):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


def test_works_without_a_process_group() -> None:
    s = ckptkit.ResumableDistributedSampler(range(10), shuffle=False)
    assert (s.num_replicas, s.rank, list(s)) == (1, 0, list(range(10)))


@pytest.mark.parametrize("n,world,batch,steps", [(40, 2, 4, 3), (41, 3, 2, 5), (37, 4, 3, 2)])
def test_resume_same_world_size_continues_exactly(n: int, world: int, batch: int, steps: int) -> None:
    straight = ranks(n, world, seed=5)
    for s in straight:
        s.set_epoch(2)
    full = [list(s) for s in straight]
    before = ranks(n, world, seed=5)
    for s in before:
        s.set_epoch(2)
        s.advance(batch * steps)
    state = before[0].state_dict()
    after = ranks(n, world, seed=5)
    for s in after:
        s.load_state_dict(state)
        s.set_epoch(2)  # the training loop calls it again; the position must survive
        assert list(s) == full[s.rank][batch * steps :]
        assert len(s) == len(full[s.rank]) - batch * steps


@pytest.mark.parametrize("old,new", [(2, 3), (4, 2), (3, 1)])
def test_resume_with_another_world_size_neither_replays_nor_skips(old: int, new: int) -> None:
    n, batch, steps = 60, 2, 4
    first = ranks(n, old, seed=1)
    consumed = []
    for s in first:
        consumed += list(s)[: batch * steps]
        s.advance(batch * steps)
    rest = []
    for s in ranks(n, new, seed=1):
        s.load_state_dict(first[0].state_dict())
        rest += list(s)
    remaining = set(range(n)) - set(consumed)
    assert len(consumed) == old * batch * steps == len(set(consumed))
    assert all(rest.count(i) == 1 for i in remaining)  # nothing skipped, nothing replayed
    padding = [i for i in rest if i not in remaining]  # DistributedSampler's tail padding
    assert len(padding) == -len(remaining) % new


def test_new_epoch_resets_the_position_and_repeat_iteration_restarts() -> None:
    (s,) = ranks(10, 1, shuffle=False)
    s.advance(4)
    assert list(s) == [4, 5, 6, 7, 8, 9]
    assert list(s) == list(range(10))  # a finished pass of the same epoch starts over
    s.advance(3)
    s.set_epoch(1)
    assert s.position == 0 and list(s) == list(range(10))


def test_saved_at_epoch_end_resumes_to_nothing_left() -> None:
    (s,) = ranks(10, 1)
    list(s)
    s.advance(10)
    (t,) = ranks(10, 1)
    t.load_state_dict(s.state_dict())
    assert list(t) == [] and len(t) == 0


def test_state_dict_warns_when_advance_was_never_called() -> None:
    (s,) = ranks(10, 1)
    it = iter(s)
    next(it)
    with pytest.warns(UserWarning, match="advance\\(\\) was never called"):
        s.state_dict()


def test_dataset_size_change_is_refused() -> None:
    (s,) = ranks(10, 1)
    (t,) = ranks(12, 1)
    with pytest.raises(ckptkit.errors.ResumeError, match="dataset of 10 samples, this one has 12"):
        t.load_state_dict(s.state_dict())


def test_checkpoint_seed_wins_with_a_warning() -> None:
    (s,) = ranks(10, 1, seed=1)
    (t,) = ranks(10, 1, seed=2)
    with pytest.warns(UserWarning, match="seed differ"):
        t.load_state_dict(s.state_dict())
    assert list(t) == list(s)


def test_negative_advance_is_refused() -> None:
    (s,) = ranks(10, 1)
    with pytest.raises(ckptkit.errors.ArgumentError):
        s.advance(-1)
