"""The trainer's errors name the first cause, in one line (issue 37): a run folder that cannot be
made is refused before any worker starts, a worker's exception reaches the user as its own line
with its rank (not as "rank 1 was killed by SIGTERM"), and ``--model pkg.mod:fn`` finds a
package in the current folder, as ``python -m`` does. Each fix a message suggests is followed."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ckptkit.errors import CheckpointWriteError
from ckptkit.train import TrainConfig, check_environment
from tests.cli.test_exits import lines
from tests.conftest import ROOT

SMALL = ["--data", "tests.train_data:small", "--batch-size", "32", "--log-every", "1"]


def _env() -> dict[str, str]:
    # The checkout's own src first: the processes run the code under test, wherever it is installed.
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}


def _run(cwd: Path, *cmd: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)


def _ckptkit(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``ckptkit ARGS`` as its console script runs it: ``sys.path`` starts at the script's own
    folder, not the current one (``python -m ckptkit.cli`` would add the current folder)."""
    script = cwd.parent / f"{cwd.name}-bin" / "ckptkit_console.py"
    script.parent.mkdir(exist_ok=True)
    script.write_text("import sys\n\nfrom ckptkit.cli import main\n\nsys.exit(main())\n")
    return _run(cwd, sys.executable, str(script), *args)


def _suggested(message: str, flag: str) -> str:
    found = re.search(rf"e\.g\. {flag} (\S+)$", message)
    assert found, message
    return found.group(1)


# -- options and paths, checked before a worker starts ---------------------------------------------


@pytest.mark.parametrize(
    ("layout", "options", "says"),
    [
        ({"afile": "x"}, {"out": "afile"}, "--out afile: a file is there;"),
        ({"afile": "x"}, {"out": "afile/run"}, "--out afile/run: afile is a file, so no folder can be made in it;"),
        ({"run/checkpoints": "x"}, {"out": "run"}, "run/checkpoints is a file, where the run keeps its checkpoints"),
        ({"afile": "x"}, {"out": "s3://bucket/run", "log_dir": "afile"}, "--log-dir afile: a file is there;"),
    ],
    ids=["out is a file", "out inside a file", "checkpoints is a file", "log-dir is a file"],
)
def test_a_file_where_the_run_folder_goes_is_refused_with_a_fix_that_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: dict[str, str], options: dict[str, str], says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    for name, text in layout.items():
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text(text)
    with pytest.raises(CheckpointWriteError) as e:
        check_environment(TrainConfig(**options))  # type: ignore[arg-type]
    message = str(e.value)
    assert says in message and "\n" not in message, message
    flag = "--log-dir" if "log_dir" in options else "--out"
    fixed = {**options, flag.lstrip("-").replace("-", "_"): _suggested(message, flag)}
    check_environment(TrainConfig(**fixed))  # type: ignore[arg-type]  # following the advice passes the check


@pytest.mark.slow  # the launcher process (and on failure, torchrun)
def test_ckptkit_train_into_a_file_is_one_line_before_any_worker_starts(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("mine")
    proc = _run(tmp_path, sys.executable, "-m", "ckptkit.cli", "train", "--nproc", "2", "--out", "afile", *SMALL)
    assert proc.returncode == 1, proc.stderr
    assert lines(proc.stderr) == [
        "ckptkit: error: --out afile: a file is there; --out names the folder for checkpoints/, metrics.jsonl and "
        "model.safetensors: pass another, e.g. --out afile-run"
    ], proc.stderr
    assert (tmp_path / "afile").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # The advice, followed:
    proc = _run(
        tmp_path, sys.executable, "-m", "ckptkit.cli", "train", "--out", "afile-run", *SMALL, "--max-steps", "1"
    )
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "afile-run" / "model.safetensors").is_file()


# -- a worker's error: its own line and its rank ---------------------------------------------------

OTHER_MODEL = """
import torch.nn as nn


def make():
    return nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 10))
"""

BAD_SAMPLE_ON_RANK_1 = """
import os

from torch.utils.data import Dataset

from tests.train_data import small


class Corrupt(Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        if os.environ["RANK"] == "1":
            raise RuntimeError(f"sample {i} is corrupt\\n(a second line of details)")
        return self.inner[i]


def make():
    train, val = small()
    return Corrupt(train), val
"""


@pytest.mark.slow  # torchrun, 2 workers
def test_resuming_into_another_model_is_the_workers_one_line(tmp_path: Path) -> None:
    (tmp_path / "othernet.py").write_text(OTHER_MODEL)
    first = _run(tmp_path, sys.executable, "-m", "ckptkit.train", "--out", "run", *SMALL, "--max-steps", "2")
    assert first.returncode == 0, first.stderr
    cmd = [sys.executable, "-m", "ckptkit.cli", "train", "--nproc", "2", "--out", "run", *SMALL, "--max-steps", "4"]
    proc = _run(tmp_path, *cmd, "--model", "othernet:make")
    assert proc.returncode == 1, proc.stderr
    said = lines(proc.stderr)
    assert len(said) == 1 and "SIGTERM" not in said[0] and "Traceback" not in proc.stderr, proc.stderr
    assert re.match(r"ckptkit: error: rank [01]: cannot resume from run/checkpoints/step_000000002\.pt", said[0])
    assert "to start fresh, pass --resume none or another --out" in said[0]
    # The advice, followed:
    again = _run(tmp_path, *cmd, "--model", "othernet:make", "--resume", "none")
    assert again.returncode == 0, again.stderr


@pytest.mark.slow  # torchrun, 2 workers
def test_an_exception_on_one_worker_is_its_one_line_and_rank(tmp_path: Path) -> None:
    (tmp_path / "corrupt.py").write_text(BAD_SAMPLE_ON_RANK_1)
    cmd = ["train", "--nproc", "2", "--out", "run", "--data", "corrupt:make", "--batch-size", "32", "--max-steps", "4"]
    proc = _run(tmp_path, sys.executable, "-m", "ckptkit.cli", *cmd)
    assert proc.returncode == 1, proc.stderr
    # Rank 0 fails too, once rank 1 is gone (gloo: "Connection closed by peer"), but later: not the cause.
    said = lines(proc.stderr)
    assert len(said) == 1 and re.fullmatch(
        r"ckptkit: error: rank 1: RuntimeError: sample \d+ is corrupt; ckptkit --debug train \.\.\. shows its traceback",
        said[0],
    ), proc.stderr
    # The advice, followed: the workers' tracebacks, then the same cause last.
    debug = _run(tmp_path, sys.executable, "-m", "ckptkit.cli", "--debug", *cmd)
    assert debug.returncode == 1
    assert "Traceback" in debug.stderr and 'raise RuntimeError(f"sample {i} is corrupt' in debug.stderr
    assert re.fullmatch(r"ckptkit: error: rank 1: RuntimeError: sample \d+ is corrupt", lines(debug.stderr)[-1])


# -- --model pkg.mod:fn in the current folder ------------------------------------------------------

NETS = """
import torch.nn as nn


def make_model():
    return nn.Sequential(nn.Linear(32, 24), nn.ReLU(), nn.Linear(24, 10))
"""


def test_a_package_in_the_current_folder_resolves_as_with_python_m(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.train.config import resolve

    name = "ckptkit_issue37_nets"  # a name no other test imports
    (tmp_path / name).mkdir()
    (tmp_path / name / "__init__.py").write_text("")
    (tmp_path / name / "nets.py").write_text(NETS)
    monkeypatch.chdir(tmp_path)
    # As in the ckptkit command: the current folder is not on sys.path (pytest's may hold it).
    monkeypatch.setattr(sys, "path", [p for p in sys.path if os.path.abspath(p or os.curdir) != str(tmp_path)])
    monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.delitem(sys.modules, f"{name}.nets", raising=False)
    factory = resolve(f"{name}.nets:make_model", "--model")
    assert factory().state_dict()["0.weight"].shape == (24, 32)
    sys.modules.pop(f"{name}.nets", None)
    sys.modules.pop(name, None)


@pytest.mark.slow  # torchrun, 1 worker
def test_ckptkit_train_model_from_a_package_in_the_current_folder(tmp_path: Path) -> None:
    project = tmp_path / "project"
    (project / "mypkg").mkdir(parents=True)
    (project / "mypkg" / "__init__.py").write_text("")
    (project / "mypkg" / "nets.py").write_text(NETS)
    proc = _ckptkit(project, "train", "--out", "run", *SMALL, "--max-steps", "2", "--model", "mypkg.nets:make_model")
    assert proc.returncode == 0, proc.stderr
    from safetensors.torch import load_file

    weights = load_file(project / "run" / "model.safetensors")
    assert weights["0.weight"].shape == (24, 32)  # mypkg's model, not the built-in one
