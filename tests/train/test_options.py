"""Every trainer option resumes bit-exactly, and training state takes named stateful objects and
changes nothing when it cannot restore (issue 13)."""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckptkit
from fixtures.models import TinyNet
from tests.train.test_trainer import finish, kill_tree, launch, records, wait_for_step

# 512 samples, batch 32 on 2 ranks: 8 micro-batches a rank per epoch, 4 epochs (tests.train.test_trainer's COMMON).
CASES = {
    "amp bf16": (["--amp", "bf16"], 32),
    "amp fp16 with a GradScaler on the CPU": (["--amp", "fp16"], 32),
    "2 DataLoader workers": (["--num-workers", "2"], 32),
    "accum 3": (["--accum", "3"], 12),  # ceil(8 / 3) = 3 optimizer steps an epoch
}


def _same_final(a: Path, b: Path, last: int) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)
    ca = torch.load(a / "checkpoints" / f"step_{last:09d}.pt", weights_only=True)
    cb = torch.load(b / "checkpoints" / f"step_{last:09d}.pt", weights_only=True)
    for i, st in ca["optimizer"]["state"].items():
        assert all(torch.equal(v, cb["optimizer"]["state"][i][k]) for k, v in st.items()), i
    assert ca["scheduler"] == cb["scheduler"] and ca["sampler"] == cb["sampler"] and ca["scaler"] == cb["scaler"]
    assert all(torch.equal(x["torch"], y["torch"]) for x, y in zip(ca["rng"], cb["rng"], strict=True))


@pytest.mark.dist
@pytest.mark.parametrize("case", list(CASES))
def test_an_option_survives_kill_9_and_resume_bit_exactly(tmp_path: Path, case: str) -> None:
    args, last = CASES[case]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert finish(launch(straight, 2, *args)) == 0
    end = [r for r in records(straight) if r.get("event") == "end"][-1]
    assert (end["status"], end["step"]) == ("done", last)
    proc = launch(killed, 2, *args)
    wait_for_step(killed, random.Random(case).randint(last // 3, 2 * last // 3), proc)
    kill_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(r["step"] for r in records(killed) if "loss" in r) < last, "the run finished before the kill landed"
    assert finish(launch(killed, 2, *args)) == 0
    assert [r for r in records(killed) if r.get("event") == "resumed"]
    _same_final(straight, killed, last)
    if "fp16" in case:
        scaler = torch.load(straight / "checkpoints" / f"step_{last:09d}.pt", weights_only=True)["scaler"]
        assert scaler["scale"] > 0 and "_growth_tracker" in scaler  # the GradScaler's state travelled


# -- named stateful objects ---------------------------------------------------------------------


class Counter:
    """Anything with state_dict() / load_state_dict(), like a StatefulDataLoader."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


def _trained() -> tuple[TinyNet, TinyNet, torch.optim.Optimizer, torch.optim.Optimizer, Counter]:
    torch.manual_seed(0)
    model, ema = TinyNet(), TinyNet()
    opt, opt2 = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.SGD(ema.parameters(), lr=0.1, momentum=0.9)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    for o, m in ((opt, model), (opt2, ema)):
        o.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        o.step()
    counter = Counter()
    counter.seen = 42
    return model, ema, opt, opt2, counter


def test_named_stateful_objects_round_trip(tmp_path: Path) -> None:
    model, ema, opt, opt2, counter = _trained()
    stateful = {"ema": torch.nn.DataParallel(ema), "opt2": opt2, "loader": counter}  # a wrapped module too
    ckptkit.save_training_state(tmp_path / "s.pt", model=model, optimizer=opt, stateful=stateful, step=1)
    saved = torch.load(tmp_path / "s.pt", weights_only=True)["stateful"]
    assert sorted(saved) == ["ema", "loader", "opt2"] and "fc1.weight" in saved["ema"]  # plain keys
    torch.manual_seed(1)
    model2, ema2 = TinyNet(), TinyNet()
    opt_b = torch.optim.Adam(model2.parameters(), lr=1e-2)
    opt2_b = torch.optim.SGD(ema2.parameters(), lr=0.1, momentum=0.9)
    counter2 = Counter()
    ckptkit.load_training_state(
        tmp_path / "s.pt", model=model2, optimizer=opt_b, stateful={"ema": ema2, "opt2": opt2_b, "loader": counter2}
    )
    assert all(torch.equal(a, b) for a, b in zip(ema.state_dict().values(), ema2.state_dict().values(), strict=True))
    assert counter2.seen == 42
    mom, mom2 = opt2.state_dict()["state"], opt2_b.state_dict()["state"]
    assert all(torch.equal(mom[i]["momentum_buffer"], mom2[i]["momentum_buffer"]) for i in mom)
    with pytest.raises(ckptkit.errors.ResumeError, match="no saved state for teacher"):
        ckptkit.load_training_state(tmp_path / "s.pt", model=TinyNet(), stateful={"teacher": TinyNet()})


def test_a_model_that_does_not_fit_changes_nothing(tmp_path: Path) -> None:
    model, _, opt, _, _ = _trained()
    dataset = list(range(64))
    sampler = ckptkit.ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    sampler.set_epoch(2)
    sampler.advance(24)
    ckptkit.save_training_state(tmp_path / "s.pt", model=model, optimizer=opt, sampler=sampler, epoch=2, step=3)

    class Wider(torch.nn.Module):  # not the saved architecture
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(8, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc1(x)

    other = Wider()
    other_opt = torch.optim.Adam(other.parameters(), lr=1e-3)
    other(torch.randn(2, 8)).sum().backward()
    other_opt.step()
    fresh = ckptkit.ResumableDistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    before = (
        fresh.state_dict(),
        {k: v.clone() for k, v in other.state_dict().items()},
        [{k: v.clone() for k, v in s.items()} for s in other_opt.state.values()],
        torch.get_rng_state(),
    )
    with pytest.raises(ckptkit.errors.StateDictMismatchError):
        ckptkit.load_training_state(tmp_path / "s.pt", model=other, optimizer=other_opt, sampler=fresh)
    assert fresh.state_dict() == before[0]  # the sampler did not move
    assert all(torch.equal(v, before[1][k]) for k, v in other.state_dict().items())
    after = [dict(s) for s in other_opt.state.values()]
    assert all(torch.equal(v, before[2][i][k]) for i, s in enumerate(after) for k, v in s.items())
    assert other_opt.param_groups[0]["lr"] == 1e-3  # not the saved optimizer's
    assert torch.equal(torch.get_rng_state(), before[3])


@pytest.mark.parametrize("seed", [0, -1, 2**32 + 5, 2**40])
def test_any_seed_torch_takes_seeds_every_generator(seed: int) -> None:
    """numpy takes 0 to 2**32 - 1 alone; --seed and seed + 1000 * rank may be anything torch takes."""
    import random

    import numpy
    import torch

    from ckptkit.train.task import seed_generators

    seed_generators(seed)
    a = (random.random(), numpy.random.rand(), torch.rand(1).item())
    seed_generators(seed)
    assert (random.random(), numpy.random.rand(), torch.rand(1).item()) == a
