"""The reference trainer under real torchrun: learning, kill/resume, SIGTERM, restarts, nodes."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT

pytestmark = pytest.mark.dist

# 512 samples, batch 32: 8 steps an epoch on 2 ranks, 4 epochs = 32 steps, saves every 5.
COMMON = [
    "--data",
    "tests.train_data:small",
    "--epochs",
    "4",
    "--batch-size",
    "32",
    "--save-every",
    "5",
    "--log-every",
    "1",
    "--warmup-steps",
    "4",
]


def launch(
    out: Path, nproc: int, *args: str, max_restarts: int = 0, launcher: list[str] | None = None
) -> subprocess.Popen:
    rdzv = launcher if launcher is not None else ["--standalone"]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *rdzv,
        f"--nproc-per-node={nproc}",
        f"--max-restarts={max_restarts}",
        "-m",
        "ckptkit.train",
        "--out",
        str(out),
        *COMMON,
        *args,
    ]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"launch-{time.monotonic_ns()}.log", "w")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 180) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid, signal.SIGKILL)
        raise


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int, sig: int) -> None:
    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def worker(root: int, rank: int, program: bytes = b"ckptkit.train") -> int:
    """The pid of rank ``rank``'s worker (running ``program``) under the launcher ``root``."""
    for p in descendants(root):
        try:
            env = open(f"/proc/{p}/environ", "rb").read().split(b"\0")
            cmdline = open(f"/proc/{p}/cmdline", "rb").read()
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and program in cmdline and b"torch.distributed.run" not in cmdline:
            return p
    raise AssertionError(f"no worker with RANK={rank} under {root}")


def records(out: Path) -> list[dict]:
    """The trainer's metrics so far: a last line still being written is left for the next read."""
    path = out / "metrics.jsonl"
    text = path.read_text() if path.exists() else ""
    return [json.loads(line) for line in text[: text.rfind("\n") + 1].splitlines()]


def wait_for_step(out: Path, step: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(r.get("step", -1) >= step and "loss" in r for r in records(out)):
            return
        assert proc.poll() is None, f"trainer exited ({proc.returncode}) before step {step}"
        time.sleep(0.01)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def assert_same_tree(a: object, b: object, where: str = "") -> None:
    """Equal containers, keys in order, tensors of one dtype and equal bits, equal other values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def assert_same_final(a: Path, b: Path) -> None:
    """The same final weights, and the same last checkpoint in every entry: weights, optimizer,
    scheduler, scaler, sampler and every rank's RNG streams."""
    assert_same_tree(load_file(a / "model.safetensors"), load_file(b / "model.safetensors"))
    ca, cb = torch.load(last_checkpoint(a), weights_only=True), torch.load(last_checkpoint(b), weights_only=True)
    assert last_checkpoint(a).name == last_checkpoint(b).name
    assert_same_tree(ca, cb)


def last_checkpoint(out: Path) -> Path:
    """The checkpoint the run's ``latest`` pointer names."""
    folder = out / "checkpoints"
    return folder / (folder / "latest").read_text().strip()


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 2-process run: the reference every interrupted run must equal."""
    out = tmp_path_factory.mktemp("straight")
    assert finish(launch(out, 2)) == 0
    return out


def test_default_task_learns(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit.train", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    evals = [r for r in records(tmp_path) if "val_acc" in r]
    losses = [r["loss"] for r in records(tmp_path) if "loss" in r]
    assert evals[0]["step"] == 0 and evals[0]["val_acc"] < 0.3  # untrained: near chance
    assert evals[-1]["val_acc"] > 0.7  # trained
    assert sum(losses[-5:]) / 5 < 0.5 * sum(losses[:5]) / 5
    from ckptkit.train import default_model

    model = default_model()
    model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)  # plain keys
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["latest", "step_000000300.pt", "step_000000350.pt", "step_000000384.pt"]  # --keep 3
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000000384.pt"


def test_straight_run_is_deterministic_and_learns(straight: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert finish(launch(again, 2)) == 0
    assert_same_final(straight, again)
    end = [r for r in records(straight) if r.get("event") == "end"][0]
    assert (end["status"], end["step"], end["epoch"]) == ("done", 32, 4)


@pytest.mark.parametrize("seed", [1, 2])
def test_sigkill_at_a_random_step_then_resume_is_bit_exact(straight: Path, tmp_path: Path, seed: int) -> None:
    kill_at = random.Random(seed).randint(6, 28)
    proc = launch(tmp_path, 2)
    wait_for_step(tmp_path, kill_at, proc)
    kill_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = max(r["step"] for r in records(tmp_path) if "loss" in r)
    assert killed_at < 32, "the run finished before the kill landed"
    assert finish(launch(tmp_path, 2)) == 0
    resumed = [r for r in records(tmp_path) if r.get("event") == "resumed"]
    assert resumed and resumed[0]["step"] <= killed_at
    assert_same_final(straight, tmp_path)
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".ckptkit-tmp")]


def test_sigterm_on_one_rank_stops_all_saves_and_exits_0(straight: Path, tmp_path: Path) -> None:
    proc = launch(tmp_path, 2)
    wait_for_step(tmp_path, 9, proc)
    os.kill(worker(proc.pid, 1), signal.SIGTERM)
    assert finish(proc) == 0
    end = [r for r in records(tmp_path) if r.get("event") == "end"][-1]
    assert end["status"] == "preempted" and end["step"] < 32
    latest = (tmp_path / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{end['step']:09d}.pt"  # saved exactly where it stopped
    assert finish(launch(tmp_path, 2)) == 0
    assert_same_final(straight, tmp_path)


def test_torchrun_max_restarts_recovers_a_killed_worker(straight: Path, tmp_path: Path) -> None:
    proc = launch(tmp_path, 2, max_restarts=2)
    wait_for_step(tmp_path, 12, proc)
    os.kill(worker(proc.pid, 1), signal.SIGKILL)
    assert finish(proc) == 0
    assert [r for r in records(tmp_path) if r.get("event") == "resumed"]
    assert_same_final(straight, tmp_path)


@pytest.mark.parametrize("new_world", [1, 3])
def test_resume_with_another_world_size_continues_from_the_same_sample(tmp_path: Path, new_world: int) -> None:
    proc = launch(tmp_path, 2, "--keep", "100")  # keep every checkpoint: the test reads them afterwards
    wait_for_step(tmp_path, 11, proc)
    os.kill(worker(proc.pid, 0), signal.SIGTERM)
    assert finish(proc) == 0
    stop = [r for r in records(tmp_path) if r.get("event") == "end"][-1]
    saved = torch.load(tmp_path / "checkpoints" / f"step_{stop['step']:09d}.pt", weights_only=True)
    assert finish(launch(tmp_path, new_world, "--keep", "100")) == 0
    resumed = [r for r in records(tmp_path) if r.get("event") == "resumed"][-1]
    assert (resumed["saved_world_size"], resumed["world_size"]) == (2, new_world)
    assert (resumed["epoch"], resumed["sample"]) == (saved["sampler"]["epoch"], saved["sampler"]["position"])
    after = [r for r in records(tmp_path) if r.get("event") == "save" and r["step"] > stop["step"]][0]
    nxt = torch.load(tmp_path / "checkpoints" / f"step_{after['step']:09d}.pt", weights_only=True)["sampler"]
    if nxt["epoch"] == saved["sampler"]["epoch"]:  # same epoch: moved on by exactly what the new ranks consumed
        moved = (after["step"] - stop["step"]) * 32 * new_world
        assert nxt["position"] == min(saved["sampler"]["position"] + moved, 512)  # capped at the epoch's end
    end = [r for r in records(tmp_path) if r.get("event") == "end"][-1]
    assert (end["status"], end["epoch"]) == ("done", 4)  # every epoch finished at the new world size


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_complete_one_run(straight: Path, tmp_path: Path) -> None:
    port = _free_port()
    nodes = [
        launch(
            tmp_path, 1, launcher=["--nnodes=2", f"--node-rank={n}", "--master-addr=127.0.0.1", f"--master-port={port}"]
        )
        for n in (0, 1)
    ]
    assert [finish(p) for p in nodes] == [0, 0]
    start = [r for r in records(tmp_path) if r.get("event") == "start"][0]
    assert start["world_size"] == 2
    assert_same_final(straight, tmp_path)  # two nodes x 1 == one node x 2, bit for bit


def test_async_save_gives_identical_checkpoints(straight: Path, tmp_path: Path) -> None:
    assert finish(launch(tmp_path, 2, "--async-save")) == 0
    assert_same_final(straight, tmp_path)
    for step in (30, 32):
        a = torch.load(straight / "checkpoints" / f"step_{step:09d}.pt", weights_only=True)
        b = torch.load(tmp_path / "checkpoints" / f"step_{step:09d}.pt", weights_only=True)
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert all(torch.equal(x["torch"], y["torch"]) for x, y in zip(a["rng"], b["rng"], strict=True))
    saves = [r for r in records(tmp_path) if r.get("event") == "save"]
    assert saves and all(r["async_save"] for r in saves)


def test_ckptkit_train_command_launches_torchrun(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptkit.cli",
            "train",
            "--nproc",
            "2",
            "--out",
            str(tmp_path),
            *COMMON,
            "--max-steps",
            "6",
            "--accum",
            "2",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    start = [r for r in records(tmp_path) if r.get("event") == "start"][0]
    assert start["world_size"] == 2 and start["backend"] == "gloo"
    assert (tmp_path / "model.safetensors").exists()
    # --accum 2 under DDP (no_sync on the first micro-batch): a step takes 2 x 32 samples on each
    # of 2 ranks, so 4 steps fill the 512-sample epoch and step 6 is 2 steps into epoch 1.
    last = torch.load(tmp_path / "checkpoints" / "step_000000006.pt", weights_only=True)
    assert (last["sampler"]["epoch"], last["sampler"]["position"]) == (1, 2 * 2 * 32 * 2)


def test_runs_without_numpy(tmp_path: Path) -> None:
    """numpy is not a torch dependency; torch's own object collectives need it, ckptkit's must not."""
    blocker = tmp_path / "blocker" / "numpy"
    blocker.mkdir(parents=True)
    # What a missing package raises (torch itself only catches ModuleNotFoundError).
    (blocker / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'numpy'\", name='numpy')\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{blocker.parent}:{ROOT}"}
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ckptkit.train",
        "--out",
        str(out),
        *COMMON,
        "--max-steps",
        "6",
        "--async-save",
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Failed to initialize NumPy" in proc.stdout + proc.stderr  # torch saw no numpy: the test is real
    assert [r for r in records(out) if r.get("event") == "end"][0]["status"] == "done"
