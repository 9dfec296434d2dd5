"""``ckptkit train``, the trainer's launcher: option errors in one line, the right exit code on a
signal, nothing left behind, a finished run that says how to go on (issue 11)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli.test_exits import cli, lines, run  # one home for the CLI runners
from tests.conftest import ROOT

# -- the trainer's launcher: one line, the right exit code, nothing left ---------------


@pytest.mark.parametrize(
    ("args", "code", "says"),
    [
        (["--epochs", "abc"], 2, "argument --epochs: invalid int value: 'abc'"),
        (["--keep", "0"], 2, "argument --keep: must be at least 1, got 0"),
        (["--amp", "fp8"], 2, "argument --amp: invalid choice: 'fp8'"),
        (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
        (["--resume", "missing.pt"], 1, "--resume missing.pt: no such checkpoint"),
        (["--model", "nosuchpkg.nets:make"], 1, "--model nosuchpkg.nets:make: cannot import it"),
    ],
)
def test_trainer_option_errors_are_one_line_and_create_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], code: int, says: str
) -> None:
    monkeypatch.chdir(tmp_path)  # the options are checked before torchrun starts: no process needed
    got, _, err = run("train", "--nproc", "2", "--out", "run", *args)
    assert got == code, err
    assert len(lines(err)) == 1 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def test_an_option_this_torchrun_lacks_is_refused_naming_the_torch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 26: torch 2.6's torchrun has no --shutdown-timeout. Asked for, it is one line that
    names the torch (before, torchrun's usage text under the name "ckptkit"); left at its default,
    it is simply not passed."""
    import torch

    import ckptkit.cli.launch as launch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(
        launch, "_torchrun_options", lambda: {"--nproc-per-node", "--standalone"}
    )  # torch 2.6's, in part
    got, out, err = run("train", "--nproc", "2", "--out", "run", "--shutdown-timeout", "5")
    assert (
        got == 2
        and lines(err)
        == [
            f"ckptkit: error: --shutdown-timeout: the torchrun of this torch ({torch.__version__}) "
            "cannot set the workers' grace period (a newer torch's torchrun can); leave it out "
            "to use torchrun's own"
        ]
        and not out
    ), err
    assert not (tmp_path / "run").exists()


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.dist
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_ckptkit_train_saves_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    args = [
        "train",
        "--nproc",
        "2",
        "--out",
        "run",
        "--data",
        "tests.train_data:small",
        "--batch-size",
        "16",
        "--log-every",
        "1",
    ]
    proc = cli(
        tmp_path, *args, "--epochs", "50", start_new_session=True
    )  # Ctrl-C reaches the launcher alone: its workers have their own sessions
    deadline = time.monotonic() + 120
    while not any(r.get("step", 0) >= 12 and "loss" in r for r in _records(tmp_path / "run")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    end = [r for r in _records(tmp_path / "run") if r.get("event") == "end"][-1]
    assert proc.returncode == 0, err
    assert end["status"] == "preempted" and "val_acc" not in end  # no stale accuracy on a stopped run
    checkpoint = Path("run") / "checkpoints" / f"step_{end['step']:09d}.pt"
    assert lines(err) == [
        f"ckptkit: stopped by {sig.name} at step {end['step']}; saved {checkpoint}; run the same command to resume"
    ]
    assert (tmp_path / checkpoint).exists() and "Traceback" not in out
    again = cli(tmp_path, *args, "--epochs", "50", "--max-steps", str(end["step"] + 3))  # the same command resumes
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    resumed = [r for r in _records(tmp_path / "run") if r.get("event") == "resumed"]
    assert resumed and resumed[-1]["step"] == end["step"]


@pytest.mark.slow  # two trainer processes
def test_rerunning_a_finished_run_says_how_to_train_on(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ckptkit.train", "--out", "run", "--data", "tests.train_data:small", "--epochs", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert "note: this run already finished (1 epoch" in proc.stdout and "pass --epochs N with N > 1" in proc.stdout


def _workers_started(pid: int) -> bool:
    from tests.train.test_trainer import descendants

    for child in descendants(pid):
        try:
            if b"ckptkit.train" in open(f"/proc/{child}/cmdline", "rb").read():
                return True
        except OSError:
            continue
    return False


@pytest.mark.dist
@pytest.mark.parametrize("when", ["while the launcher starts", "as the workers start", "while the workers set up"])
def test_a_signal_before_the_first_save_exits_130_in_one_line(tmp_path: Path, when: str) -> None:
    proc = cli(
        tmp_path,
        "train",
        "--nproc",
        "2",
        "--out",
        "run",
        "--save-every",
        "0",
        "--batch-size",
        "8",
        start_new_session=True,
    )
    if when == "while the launcher starts":
        time.sleep(0.5)  # importing torch
    else:
        deadline = time.monotonic() + 60
        while not _workers_started(proc.pid):  # the moment a worker is still importing its modules
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        time.sleep(0 if when == "as the workers start" else 1.0)
    from tests.train.test_trainer import descendants

    workers = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert len(lines(err)) == 1 and "stopped by SIGINT; nothing was saved" in err, err
    assert not list(tmp_path.glob("run/checkpoints/step_*"))
    alive = [
        p
        for p in workers
        if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    ]
    assert not alive, f"workers left running: {alive}"


def _listening(port: int) -> bool:
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in open(table).read().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                return True
    return False


@pytest.mark.slow  # a trainer process
def test_a_worker_blocked_in_the_rendezvous_ends_on_sigterm(tmp_path: Path) -> None:
    """CI hang: a worker blocked in C++ (the store waiting for a peer that already died) never
    ran its Python signal handler, so the launcher waited out its shutdown timeout. Rank 0 of a
    world of 2, alone, blocks there the same way."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(ROOT / "src"),
        "WORLD_SIZE": "2",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckptkit.train", "--out", "run", "--device", "cpu"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not _listening(port):  # rank 0 hosts the store, then waits in C++ for rank 1
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.01)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGTERM and not err and not out
    assert not list(tmp_path.glob("run/checkpoints/*"))


# -- small things ------------------------------------------------------------------------


def test_train_help_shows_each_default_once() -> None:
    code, out, _ = run("train", "--help")
    text = " ".join(out.split())
    assert code == 0 and "(default: '')" not in text
    assert "(default: the built-in MLP)" in text and "--device DEVICE auto, cuda, cpu;" in text


def test_large_rates_are_printed_in_plain_digits() -> None:
    from ckptkit.train.log import _number

    assert (_number(18240.4), _number(0.0003), _number(12)) == ("18,240", "0.0003", "12")
