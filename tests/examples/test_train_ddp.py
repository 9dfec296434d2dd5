"""examples/train_ddp.py, the one file to copy (issue 37): run as written under torchrun and as
one plain process, killed with SIGKILL or stopped by SIGTERM partway and resumed, it ends with
the weights and the last checkpoint of a run that was never interrupted, bit for bit."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT
from tests.train.test_trainer import assert_same_final, finish, kill_tree, worker

pytestmark = [pytest.mark.slow, pytest.mark.dist]

EXAMPLE = ROOT / "examples" / "train_ddp.py"
# 4096 samples, batch 32 on 2 ranks: 64 steps an epoch, 3 epochs = 192 steps, a checkpoint every 10.
ARGS = ["--epochs", "3", "--save-every", "10", "--log-every", "1"]
LAST = 192


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def launch(out: Path, *args: str, nproc: int = 2) -> subprocess.Popen[str]:
    """The example as its docstring runs it, under torchrun; its output goes to OUT/launch-N.log."""
    out.mkdir(parents=True, exist_ok=True)
    runner = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    log = open(out / f"launch-{time.monotonic_ns()}.log", "w")
    cmd = [*runner, str(EXAMPLE), "--out", str(out), *ARGS, *args]
    return subprocess.Popen(cmd, cwd=out, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)


def output(out: Path) -> str:
    return "".join(p.read_text() for p in sorted(out.glob("launch-*.log")))


def latest_step(out: Path) -> int:
    """The step of the checkpoint ``latest`` names (committed: the file is complete), or -1."""
    try:
        return int(re.fullmatch(r"step_(\d+)\.pt", (out / "checkpoints" / "latest").read_text().strip())[1])  # type: ignore[index]
    except (OSError, TypeError):
        return -1


def wait_for_checkpoint(out: Path, step: int, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while latest_step(out) < step:
        assert proc.poll() is None, f"the example exited ({proc.returncode}) before step {step}: {output(out)}"
        assert time.monotonic() < deadline, f"no checkpoint of step {step} in {timeout} s: {output(out)}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted 2-process run: the reference every interrupted run must equal."""
    out = tmp_path_factory.mktemp("straight")
    assert finish(launch(out)) == 0, output(out)
    assert f"done: 3 epochs, {LAST} steps" in output(out)
    return out


def test_sigkill_partway_then_resume_equals_an_uninterrupted_run(straight: Path, tmp_path: Path) -> None:
    proc = launch(tmp_path)
    wait_for_checkpoint(tmp_path, 40, proc)  # at least one checkpoint committed, well before the end
    kill_tree(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_at = latest_step(tmp_path)
    assert 40 <= killed_at < LAST and not (tmp_path / "model.safetensors").exists(), "the run finished before the kill"
    assert finish(launch(tmp_path)) == 0, output(tmp_path)
    resumed = re.findall(r"resumed from step (\d+)", output(tmp_path))
    assert resumed and killed_at <= int(resumed[0]) < LAST, output(tmp_path)
    a, b = load_file(straight / "model.safetensors"), load_file(tmp_path / "model.safetensors")
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert_same_final(straight, tmp_path)  # and the last checkpoint: optimizer, scheduler, sampler, each rank's RNG
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.endswith(".ckptkit-tmp")]


def test_sigterm_on_one_rank_saves_there_and_the_rerun_resumes_exactly(straight: Path, tmp_path: Path) -> None:
    proc = launch(tmp_path)
    wait_for_checkpoint(tmp_path, 20, proc)
    os.kill(worker(proc.pid, 1, b"train_ddp.py"), signal.SIGTERM)
    assert finish(proc) == 0, output(tmp_path)
    stopped = re.findall(r"stopped by a signal at step (\d+); saved (\S+);", output(tmp_path))
    assert stopped and int(stopped[0][0]) < LAST, output(tmp_path)
    assert latest_step(tmp_path) == int(stopped[0][0])  # saved exactly where every rank stopped
    assert finish(launch(tmp_path)) == 0, output(tmp_path)
    assert_same_final(straight, tmp_path)


def test_one_plain_process_runs_resumes_and_starts_from_weights(tmp_path: Path) -> None:
    def run(out: str, *args: str) -> str:
        cmd = [sys.executable, str(EXAMPLE), "--out", out, "--epochs", "1", "--save-every", "40", *args]
        proc = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    said = run("one")
    assert "done: 1 epochs, 128 steps" in said  # 4096 samples, batch 32, one process
    assert float(re.findall(r"val_acc (\S+)", said)[-1]) > 0.5  # it learns (10 classes: chance is ~0.1)
    weights = load_file(tmp_path / "one" / "model.safetensors")
    assert list(weights)[0] == "0.weight"  # plain keys
    assert "resumed from step 128 (epoch 1)" in run("one")  # a finished run: nothing more to do
    # --init-from: a new run starts from those weights (zero epochs: they are saved unchanged).
    assert "initialised from one/model.safetensors" in run(
        "two", "--init-from", "one/model.safetensors", "--epochs", "0"
    )
    again = load_file(tmp_path / "two" / "model.safetensors")
    assert list(again) == list(weights) and all(torch.equal(again[k], weights[k]) for k in weights)
