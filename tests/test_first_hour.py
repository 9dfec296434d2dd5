"""The first hour of a new user (issue 11): signals, exit codes, one-line errors, honest
summaries, and the README's Python examples run as written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from tests.conftest import ROOT

TMP_SUFFIX = ".ckptkit-tmp"


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def cli(cwd: Path, *args: object, timeout: float = 120, **kw: object) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "ckptkit.cli", *(str(a) for a in args)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)  # type: ignore[call-overload]  # fmt: skip


def lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# -- 5. signals during convert leave nothing -------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_during_convert_leaves_nothing(tmp_path: Path, sig: signal.Signals) -> None:
    torch.save({"w": torch.zeros(64 << 20, dtype=torch.float32)}, tmp_path / "big.pt")  # 256 MiB
    proc = cli(tmp_path, "convert", "big.pt", "out.pt")
    deadline = time.monotonic() + 60
    while not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]:  # the copy has begun
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.001)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert lines(err) == [f"ckptkit: error: stopped by {sig.name}; nothing was written"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.pt"]


# -- 6. diff: 0 same, 1 different, 2 trouble --------------------------------------------------


def test_diff_exit_codes_follow_gnu_diff(fixtures_dir: Path, tmp_path: Path) -> None:
    assert run("diff", fixtures_dir / "ddp.pt", fixtures_dir / "plain.pt")[0] == 0
    other = {k: v + 1 if v.is_floating_point() else v for k, v in torch.load(fixtures_dir / "plain.pt").items()}
    ckptkit.save_on_master(other, tmp_path / "other.pt")
    assert run("diff", fixtures_dir / "plain.pt", tmp_path / "other.pt")[0] == 1
    for b in (tmp_path / "missing.pt", fixtures_dir / "needs_trust.pt"):
        code, _, err = run("diff", fixtures_dir / "plain.pt", b)
        assert code == 2 and len(lines(err)) == 1 and err.startswith("ckptkit: error:"), err


# -- 9. --json errors are JSON ----------------------------------------------------------------


@pytest.mark.parametrize(("args", "code", "kind"), [
    (["convert", "missing.pt", "o.pt"], 1, "CheckpointNotFoundError"),
    (["convert", "{fx}/needs_trust.pt", "o.pt"], 1, "UnsafeCheckpointError"),
    (["convert", "{fx}/plain.pt", "o.zzz"], 2, "ArgumentError"),
    (["inspect", "missing.pt"], 1, "CheckpointNotFoundError"),
    (["diff", "{fx}/plain.pt", "missing.pt"], 2, "CheckpointNotFoundError"),
    (["verify", "{fx}"], 1, None),  # verify reports a folder without .metadata as a failed check
])  # fmt: skip
def test_json_errors_are_json_on_stdout(fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                        args: list[str], code: int, kind: str | None) -> None:  # fmt: skip
    monkeypatch.chdir(tmp_path)
    got, out, err = run(*[a.format(fx=fixtures_dir) for a in args], "--json")
    assert got == code, err
    data = json.loads(out)
    assert data["ok"] is False
    if kind is not None:
        assert data["error"]["type"] == kind and data["error"]["exit_code"] == code
        assert lines(err) == [f"ckptkit: error: {data['error']['message']}"]


# -- 7. summaries that say what was left and what was stored once ----------------------------


def test_convert_says_which_other_copy_of_the_weights_it_left(fixtures_dir: Path, tmp_path: Path) -> None:
    ddp = torch.load(fixtures_dir / "ddp.pt", weights_only=True)
    torch.save({"model": ddp, "ema": {"model": ddp}, "step": 7}, tmp_path / "ema.pt")
    code, out, err = run("convert", tmp_path / "ema.pt", tmp_path / "single.pt")
    assert code == 0, err
    assert "note: 'ema/model' also holds wrapped weights, left as they were; convert them with --key ema/model" in err
    report = ckptkit.convert_checkpoint(tmp_path / "ema.pt", tmp_path / "again.pt")
    assert report.left == ["ema/model"]
    again = ckptkit.convert_checkpoint(tmp_path / "single.pt", tmp_path / "both.pt", key="ema/model")
    assert again.left == [] and again.renamed == 9  # the note's command does convert it


def test_a_tied_safetensors_output_says_what_was_stored_once(fixtures_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file

    code, out, err = run("convert", fixtures_dir / "tied_ddp.pt", tmp_path / "tied.safetensors")
    assert code == 0, err
    assert out.startswith(f"{tmp_path / 'tied.safetensors'}: 4 tensors (3 stored)")
    assert "stored once and re-tied on load: head.weight is embed.weight" in err and "load_model" in err
    assert len(load_file(str(tmp_path / "tied.safetensors"))) == 3  # what the note warns about
    assert len(ckptkit.read_checkpoint(tmp_path / "tied.safetensors")) == 4


def test_inspect_counts_in_words(tmp_path: Path) -> None:
    torch.save({"model": {"w": torch.ones(1)}, "one": {"a": 1}, "pair": [1, 2], "single": [3]}, tmp_path / "c.pt")
    code, out, _ = run("inspect", tmp_path / "c.pt")
    assert code == 0
    assert re.search(r"\bone\s+dict\s+1 entry\b", out) and re.search(r"\bsingle\s+list\s+1 item\b", out)
    assert re.search(r"\bpair\s+list\s+2 items\b", out) and re.search(r"\bmodel\s+state dict\s+1 tensor\b", out)


# -- 8. progress for verify and diff ----------------------------------------------------------


def test_verify_and_diff_report_progress(fixtures_dir: Path, tmp_path: Path) -> None:
    ckptkit.save_on_master({"w": torch.ones(1 << 16), "b": torch.zeros(100)}, tmp_path / "a.pt")
    seen: list[tuple[int, int]] = []
    assert ckptkit.verify_checkpoint(tmp_path / "a.pt", progress=lambda n, total: seen.append((n, total))).ok
    payload = 4 * ((1 << 16) + 100)
    assert sum(n for n, _ in seen) >= payload and {t for _, t in seen} == {(tmp_path / "a.pt").stat().st_size}
    seen.clear()
    assert ckptkit.diff_checkpoints(tmp_path / "a.pt", tmp_path / "a.pt", progress=lambda n, t: seen.append((n, t))).equal
    assert sum(n for n, _ in seen) == 2 * payload and seen[-1][1] == 2 * payload


# -- 2. the README's Python blocks run as written ---------------------------------------------


def _readme_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


@pytest.mark.dist
@pytest.mark.parametrize("index", range(len(_readme_blocks())))
def test_the_readmes_python_blocks_run_as_written(tmp_path: Path, index: int) -> None:
    code = _readme_blocks()[index]
    (tmp_path / "example.py").write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = code.splitlines()[0]
    if first.startswith("# torchrun"):  # distributed code: under torchrun with 2 processes, as the block says
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "example.py"]
    else:
        assert first.startswith("# python"), "say how the block runs on its first line"
        cmd = [sys.executable, "example.py"]
    for attempt in ("first run", "second run: resumes or redoes"):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{attempt}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def test_a_checkpoint_folder_creates_itself(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path / "runs" / "x" / "checkpoints")
    ckptkit.save_on_master({"w": torch.ones(1)}, folder.path_for(1))
    folder.commit(folder.path_for(1))
    assert folder.latest() == folder.path_for(1)


# -- 3, 4. the trainer's launcher: one line, the right exit code, nothing left ---------------


@pytest.mark.parametrize(("args", "code", "says"), [
    (["--epochs", "abc"], 2, "argument --epochs: invalid int value: 'abc'"),
    (["--keep", "0"], 2, "argument --keep: must be at least 1, got 0"),
    (["--amp", "fp8"], 2, "argument --amp: invalid choice: 'fp8'"),
    (["--no-such-flag"], 2, "unrecognized arguments: --no-such-flag"),
    (["--resume", "missing.pt"], 1, "--resume missing.pt: no such checkpoint"),
    (["--model", "nosuchpkg.nets:make"], 1, "--model nosuchpkg.nets:make: cannot import it"),
])  # fmt: skip
def test_trainer_option_errors_are_one_line_and_create_nothing(tmp_path: Path, args: list[str], code: int, says: str) -> None:
    proc = cli(tmp_path, "train", "--nproc", "2", "--out", "run", *args)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert len(lines(err)) == 1 and says in err and "Traceback" not in err, err
    assert not (tmp_path / "run").exists()


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.dist
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_signal_to_ckptkit_train_saves_and_exits_0(tmp_path: Path, sig: signal.Signals) -> None:
    args = ["train", "--nproc", "2", "--out", "run", "--data", "tests.train_data:small", "--batch-size", "16", "--log-every", "1"]
    proc = cli(tmp_path, *args, "--epochs", "50", start_new_session=True)  # Ctrl-C reaches the launcher alone: its workers have their own sessions
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
    assert lines(err) == [f"ckptkit: stopped by {sig.name} at step {end['step']}; saved {checkpoint}; run the same command to resume"]
    assert (tmp_path / checkpoint).exists() and "Traceback" not in out
    again = cli(tmp_path, *args, "--epochs", "50", "--max-steps", str(end["step"] + 3))  # the same command resumes
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err
    resumed = [r for r in _records(tmp_path / "run") if r.get("event") == "resumed"]
    assert resumed and resumed[-1]["step"] == end["step"]


def test_rerunning_a_finished_run_says_how_to_train_on(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "ckptkit.train", "--out", "run", "--data", "tests.train_data:small", "--epochs", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    for _ in range(2):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
    assert "note: this run already finished (1 epochs" in proc.stdout and "pass --epochs N with N > 1" in proc.stdout


def _workers_started(pid: int) -> bool:
    from tests.test_train import descendants

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
    proc = cli(tmp_path, "train", "--nproc", "2", "--out", "run", "--save-every", "0", "--batch-size", "8",
               start_new_session=True)  # fmt: skip
    if when == "while the launcher starts":
        time.sleep(0.5)  # importing torch
    else:
        deadline = time.monotonic() + 60
        while not _workers_started(proc.pid):  # the moment a worker is still importing its modules
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.005)
        time.sleep(0 if when == "as the workers start" else 1.0)
    from tests.test_train import descendants

    workers = descendants(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert len(lines(err)) == 1 and "stopped by SIGINT; nothing was saved" in err, err
    assert not list(tmp_path.glob("run/checkpoints/step_*"))
    alive = [p for p in workers if os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
    assert not alive, f"workers left running: {alive}"


# -- 10. small things ------------------------------------------------------------------------


def test_train_help_shows_each_default_once() -> None:
    code, out, _ = run("train", "--help")
    text = " ".join(out.split())
    assert code == 0 and "(default: '')" not in text
    assert "(default: the built-in MLP)" in text and "--device DEVICE auto, cuda, cpu;" in text


def test_large_rates_are_printed_in_plain_digits() -> None:
    from ckptkit.train.log import _number

    assert (_number(18240.4), _number(0.0003), _number(12)) == ("18,240", "0.0003", "12")


def test_numpy_is_a_dependency() -> None:
    from importlib.metadata import requires

    assert any(r.startswith("numpy") for r in requires("ckptkit") or [])


# -- 1. a new user, from the parent folder of a fresh clone ------------------------------------


@pytest.mark.slow
@pytest.mark.dist
def test_a_new_user_from_the_parent_folder_of_a_fresh_clone(tmp_path: Path) -> None:
    """The README's install, then its commands, from the folder that holds the clone: the clone's
    root (named ckptkit) must not shadow the installed package there."""
    assert (ROOT / ".git").exists(), "run from a git checkout: this test clones it"
    clone = tmp_path / "ckptkit"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=120)
    venv = tmp_path / "venv"
    # A fresh venv that sees this machine's torch, pip and setuptools (so "pip install
    # torch==2.13.0" is already met and nothing is downloaded), then the README's "pip install -e .".
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)], check=True, timeout=120)
    bin_ = venv / "bin"
    subprocess.run([bin_ / "python", "-m", "pip", "install", "-q", "--no-build-isolation", "-e", "."], cwd=clone,
                   check=True, timeout=600, capture_output=True)  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PATH=f"{bin_}:{env['PATH']}")

    def here(*cmd: object) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(c) for c in cmd], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    where = here("python", "-c", "import ckptkit; print(ckptkit.__file__, ckptkit.ResumableDistributedSampler.__name__)")
    assert where.returncode == 0, where.stderr
    assert where.stdout.split() == [str(clone / "src" / "ckptkit" / "__init__.py"), "ResumableDistributedSampler"]
    assert here("ckptkit", "--help").returncode == 0
    trained = here("ckptkit", "train", "--nproc", "2", "--epochs", "1", "--out", "run")
    assert trained.returncode == 0, trained.stdout[-2000:] + trained.stderr[-2000:]
    assert (tmp_path / "run" / "model.safetensors").exists()
    (tmp_path / "example.py").write_text(_readme_blocks()[0])
    example = here("python", "example.py")
    assert example.returncode == 0, example.stderr[-2000:]


def test_paths_are_checked_by_ckptkit_not_by_click() -> None:
    """click's own readability check turned an unreadable SRC into a usage error (exit 2, usage
    text); ckptkit opens the file and says what is wrong in its one line, exit 1."""
    import click

    ctx = click.Context(main)
    names = main.list_commands(ctx)
    assert {"convert", "inspect", "diff", "verify", "train"} <= set(names)  # train's module loads on demand
    for name in names:
        command = main.get_command(ctx, name)
        assert command is not None, name
        for param in command.params:
            if isinstance(param.type, click.Path):
                assert not param.type.readable and not param.type.exists, (name, param.name)
