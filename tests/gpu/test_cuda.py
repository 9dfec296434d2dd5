"""The GPU path: devices per rank, CUDA state resumed exactly, saves from CUDA tensors, async
staging through pinned memory, and the trainer on nccl and on a shared GPU.

Every test here is marked ``cuda`` and skipped without a GPU; ``python -m pytest -m cuda`` on a
machine with one runs them all (some start process groups and torchrun, so they are ``dist`` too).
"""

from __future__ import annotations

import io
import os
import signal
from pathlib import Path

import pytest
import torch

import ckptkit
from fixtures.models import TiedLM, TinyNet
from tests.group import ok_values, run_group
from tests.train.test_trainer import assert_same_tree

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _cpu(obj: object) -> object:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def _locations(path: Path) -> set[str]:
    """The device tags of a torch zip's storages, read without loading it."""
    from ckptkit.formats.pickles import reader as torchpickle
    from ckptkit.formats.torchzip.container import TorchZip

    with TorchZip(path) as z:
        tags: set[str] = set()
        torchpickle.loads(z.read(f"{z.prefix}data.pkl"), on_storage=lambda ref: tags.add(ref.location))
    return tags


# -- load_for_rank: each rank on its own GPU ---------------------------------------------------


def _device_of_first_tensor(rank: int, world: int, path: str) -> str:
    obj = ckptkit.load_for_rank(path)
    return str(next(iter(obj.values())).device)


@pytest.mark.dist
def test_cuda0_tensors_land_on_each_ranks_own_device(tmp_path: Path) -> None:
    path = tmp_path / "saved_on_cuda0.pt"
    torch.save({k: v.to("cuda:0") for k, v in TinyNet().state_dict().items()}, path)
    assert _locations(path) == {"cuda:0"}
    devices = ok_values(run_group(_device_of_first_tensor, 2, tmp_path, str(path)))
    count = torch.cuda.device_count()
    assert devices == [f"cuda:{rank % count}" for rank in range(2)]  # with 2+ GPUs, rank 1 is not on cuda:0


def test_a_cuda_save_lands_on_this_device_and_cpu_state_stays_on_the_cpu(tmp_path: Path) -> None:
    path = tmp_path / "mixed.pt"
    torch.save({"w": torch.ones(3, device="cuda"), "rng": torch.get_rng_state()}, path)
    got = ckptkit.load_for_rank(path)
    assert got["w"].device == torch.device(ckptkit.device_for_rank())
    assert got["rng"].device.type == "cpu"  # torch.set_rng_state takes a CPU tensor


# -- CUDA tensors saved: the same content as a CPU save ---------------------------------------


def _trained_on_cuda() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = TinyNet().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 8, device="cuda"), torch.randint(0, 4, (16,), device="cuda")
    for _ in range(2):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def test_save_on_master_from_cuda_tensors_equals_the_cpu_save(tmp_path: Path) -> None:
    model, _ = _trained_on_cuda()
    ckptkit.save_on_master(model.state_dict(), tmp_path / "gpu.pt")
    ckptkit.save_on_master(_cpu(model.state_dict()), tmp_path / "cpu.pt")
    assert _locations(tmp_path / "gpu.pt") == {"cuda:0"} and _locations(tmp_path / "cpu.pt") == {"cpu"}
    assert_same_tree(
        ckptkit.read_checkpoint(tmp_path / "gpu.pt", map_location="cpu"),
        ckptkit.read_checkpoint(tmp_path / "cpu.pt", map_location="cpu"),
    )
    assert ckptkit.verify_checkpoint(tmp_path / "gpu.pt").ok


def test_save_training_state_from_cuda_holds_what_was_on_the_gpu(tmp_path: Path) -> None:
    model, opt = _trained_on_cuda()
    ckptkit.save_training_state(tmp_path / "state.pt", model=model, optimizer=opt, step=2)
    saved = ckptkit.read_checkpoint(tmp_path / "state.pt", map_location="cpu")
    assert_same_tree(saved["model"], _cpu(model.state_dict()))
    assert_same_tree(saved["optimizer"], _cpu(opt.state_dict()))
    assert saved["rng"][0]["cuda"] is not None  # CUDA was in use: its generators were saved


# -- GradScaler and CUDA RNG resume exactly ----------------------------------------------------


def _fp16_steps(
    model: torch.nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler, n: int
) -> list[float]:
    losses = []
    for _ in range(n):
        x = torch.randn(32, 8, device="cuda")  # drawn from the CUDA generator: its state matters
        y = torch.randint(0, 4, (32,), device="cuda")
        opt.zero_grad()
        with torch.autocast("cuda", dtype=torch.float16):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return losses


def test_grad_scaler_and_cuda_rng_resume_exactly(tmp_path: Path) -> None:
    def fresh() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
        torch.manual_seed(0)
        model = TinyNet().cuda()
        return model, torch.optim.Adam(model.parameters(), lr=1e-2), torch.amp.GradScaler("cuda", init_scale=2.0**10)

    model, opt, scaler = fresh()
    _fp16_steps(model, opt, scaler, 5)
    ckptkit.save_training_state(tmp_path / "s.pt", model=model, optimizer=opt, scaler=scaler, step=5)
    expected = _fp16_steps(model, opt, scaler, 5)
    expected_rng = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    expected_scale = scaler.get_scale()

    model2, opt2, scaler2 = fresh()
    torch.cuda.manual_seed_all(12345)  # anything else: the resume must put the saved streams back
    state = ckptkit.load_training_state(tmp_path / "s.pt", model=model2, optimizer=opt2, scaler=scaler2)
    assert state.step == 5
    assert _fp16_steps(model2, opt2, scaler2, 5) == expected
    assert scaler2.get_scale() == expected_scale
    for i, rng in enumerate(expected_rng):
        assert torch.equal(torch.cuda.get_rng_state(i), rng), f"cuda:{i}"
    assert_same_tree(_cpu(model2.state_dict()), _cpu(model.state_dict()))


# -- AsyncSaver on CUDA ------------------------------------------------------------------------


def test_async_save_stages_through_pinned_memory_and_keeps_tied_weights(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = TiedLM().cuda()
    before = _cpu(model.state_dict())
    saver = ckptkit.AsyncSaver()
    saver.save(model.state_dict(), tmp_path / "async.pt")
    with torch.no_grad():  # training goes on at once: the staged copy must not see this
        for p in model.parameters():
            p.add_(1.0)
    assert saver._pinned and all(buf.is_pinned() for buf in saver._pinned)
    saver.close()
    after_save = ckptkit.read_checkpoint(tmp_path / "async.pt", map_location="cpu")
    assert_same_tree(after_save, before)
    embed, head = after_save["embed.weight"], after_save["head.weight"]
    assert embed.untyped_storage().data_ptr() == head.untyped_storage().data_ptr()  # still tied
    with torch.no_grad():  # back to the saved values, exactly (adding 1.0 rounded them)
        for name, p in model.named_parameters():
            p.copy_(before[name])
    ckptkit.save_on_master(model.state_dict(), tmp_path / "sync.pt")
    assert _locations(tmp_path / "async.pt") == _locations(tmp_path / "sync.pt") == {"cuda:0"}
    _assert_same_records(tmp_path / "async.pt", tmp_path / "sync.pt")


def _assert_same_records(a: Path, b: Path) -> None:
    """Byte-identical zips; where a record differs, say which (data.pkl: its pickle, disassembled)."""
    import difflib
    import pickletools
    import zipfile

    za, zb = zipfile.ZipFile(a), zipfile.ZipFile(b)
    assert za.namelist() == zb.namelist()
    for name in za.namelist():
        x, y = za.read(name), zb.read(name)
        if x != y and name.endswith("data.pkl"):
            text = [io.StringIO(), io.StringIO()]
            pickletools.dis(x, text[0])
            pickletools.dis(y, text[1])
            diff = difflib.unified_diff(text[0].getvalue().splitlines(), text[1].getvalue().splitlines(), lineterm="")
            raise AssertionError(f"{name} differs:\n" + "\n".join(list(diff)[:60]))
        assert x == y, name
    assert a.read_bytes() == b.read_bytes()


def test_a_zero_size_cpu_tensor_saved_during_an_async_save_stays_on_the_cpu(tmp_path: Path) -> None:
    import threading

    # Every zero-size storage has data_ptr 0: tags keyed by it made this CPU file say cuda:0.
    writing, saved_meanwhile = threading.Event(), threading.Event()

    def hold() -> None:  # runs in the background save, before its tags are dropped
        writing.set()
        assert saved_meanwhile.wait(60)

    saver = ckptkit.AsyncSaver()
    saver.save(
        {"empty": torch.empty(0, device="cuda"), "w": torch.ones(3, device="cuda")}, tmp_path / "gpu.pt", on_done=hold
    )
    assert writing.wait(60)
    torch.save({"empty": torch.empty(0), "w": torch.ones(2)}, tmp_path / "cpu.pt")
    saved_meanwhile.set()
    saver.close()
    assert _locations(tmp_path / "cpu.pt") == {"cpu"}
    assert _locations(tmp_path / "gpu.pt") == {"cuda:0"}


# -- the reference trainer on GPUs -------------------------------------------------------------


@pytest.fixture(autouse=True)
def _deterministic_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # so runs of the same config can be compared bit for bit


def _gpu_run(out: Path, nproc: int, *args: str) -> int:
    from tests.train.test_trainer import finish, launch

    return finish(launch(out, nproc, "--device", "cuda", *args), timeout=600)


def _start(out: Path) -> dict:
    from tests.train.test_trainer import records

    return [r for r in records(out) if r.get("event") == "start"][0]


def _stopped_then_resumed(out: Path, *args: str, stop_at: int = 13, sig: int = signal.SIGTERM) -> None:
    """One GPU: stop the run at ``stop_at`` with ``sig`` (SIGTERM saves first; SIGKILL does not), then resume it."""
    from tests.train.test_trainer import finish, kill_tree, launch, records, wait_for_step, worker

    proc = launch(out, 1, "--device", "cuda", *args)
    wait_for_step(out, stop_at, proc, timeout=300)
    if sig == signal.SIGKILL:
        kill_tree(proc.pid, sig)
        proc.wait()
    else:
        os.kill(worker(proc.pid, 0), sig)
        assert finish(proc, timeout=300) == 0
    assert max(r["step"] for r in records(out) if "loss" in r) < 32, "the run finished before the signal landed"
    assert finish(launch(out, 1, "--device", "cuda", *args), timeout=600) == 0
    assert [r for r in records(out) if r.get("event") == "resumed"]


@pytest.mark.dist
def test_trainer_on_nccl_with_one_gpu(tmp_path: Path) -> None:
    assert _gpu_run(tmp_path, 1) == 0
    start = _start(tmp_path)
    assert (start["backend"], start["device"], start["world_size"]) == ("nccl", "cuda:0", 1)
    assert (tmp_path / "model.safetensors").exists()


@pytest.mark.dist
def test_trainer_two_processes_share_one_gpu_over_gloo(tmp_path: Path) -> None:
    assert _gpu_run(tmp_path, 2, "--backend", "gloo", "--max-steps", "10") == 0
    start = _start(tmp_path)
    assert (start["backend"], start["world_size"]) == ("gloo", 2) and start["device"].startswith("cuda")


@pytest.mark.dist
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_trainer_amp_modes_resume_bit_exact(tmp_path: Path, amp: str) -> None:
    from tests.train.test_trainer import assert_same_final, last_checkpoint

    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert _gpu_run(straight, 1, "--amp", amp) == 0
    _stopped_then_resumed(stopped, "--amp", amp)
    assert_same_final(straight, stopped)
    scaler = torch.load(last_checkpoint(straight), weights_only=True)["scaler"]
    if amp == "fp16":
        assert scaler["scale"] > 0 and "_growth_tracker" in scaler  # GradScaler state saved and restored


@pytest.mark.dist
def test_trainer_sync_bn(tmp_path: Path) -> None:
    nproc = min(2, torch.cuda.device_count())
    assert _gpu_run(tmp_path, nproc, "--sync-bn", "--max-steps", "10") == 0
    saved = torch.load(tmp_path / "checkpoints" / "step_000000010.pt", weights_only=True)
    assert any(k.endswith("running_var") for k in saved["model"])  # SyncBatchNorm keeps BatchNorm's keys


@pytest.mark.dist
def test_trainer_kill_9_and_resume_on_gpu_is_bit_exact(tmp_path: Path) -> None:
    from tests.train.test_trainer import assert_same_final

    straight = tmp_path / "straight"
    assert _gpu_run(straight, 1) == 0
    _stopped_then_resumed(tmp_path / "killed", stop_at=17, sig=signal.SIGKILL)
    assert_same_final(straight, tmp_path / "killed")
