"""The trainer as one plain process: Python entry point, --resume PATH/none, --accum, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.utils.data import TensorDataset

from tests.conftest import ROOT

SMALL = ["--data", "tests.train_data:small", "--batch-size", "32", "--log-every", "1", "--warmup-steps", "2"]


def run(out: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ckptkit.train", "--out", str(out), *SMALL, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def events(out: Path, name: str) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == name]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return list(wa) == list(wb) and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_python_entry_point_with_my_model_and_data(tmp_path: Path) -> None:
    from ckptkit.train import TrainConfig, train
    from fixtures.models import TinyNet

    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 8, generator=g)
    data = TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())
    result = train(
        TrainConfig(out=str(tmp_path), epochs=3, batch_size=32, save_every=4, log_every=100),
        model=TinyNet(),
        data=(data, data),
    )
    assert (result["status"], result["step"], result["epoch"]) == ("done", 24, 3)
    model = TinyNet()
    model.load_state_dict(load_file(tmp_path / "model.safetensors"), strict=True)
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000000024.pt"


@pytest.mark.slow  # trainer processes
def test_resume_from_a_path_with_gradient_accumulation_is_exact(tmp_path: Path) -> None:
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    opts = ["--accum", "2", "--epochs", "2", "--save-every", "3", "--keep", "100"]
    assert run(straight, *opts).returncode == 0
    middle = straight / "checkpoints" / "step_000000006.pt"  # mid-epoch: 8 steps of 2 micro-batches per epoch
    assert torch.load(middle, weights_only=True)["sampler"]["position"] == 6 * 2 * 32
    proc = run(resumed, *opts, "--resume", str(middle))
    assert proc.returncode == 0, proc.stderr
    assert events(resumed, "resumed")[0]["step"] == 6
    assert same_weights(straight, resumed)


@pytest.mark.slow  # trainer processes
def test_resume_none_starts_over(tmp_path: Path) -> None:
    assert run(tmp_path, "--max-steps", "8").returncode == 0
    first = load_file(tmp_path / "model.safetensors")
    assert run(tmp_path, "--max-steps", "8", "--resume", "none").returncode == 0
    assert not events(tmp_path, "resumed")
    assert len(events(tmp_path, "start")) == 2
    again = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(first[k], again[k]) for k in first)  # same seed, same options, same run


@pytest.mark.slow  # trainer processes
@pytest.mark.parametrize("stop", [["--max-steps", "8"], ["--epochs", "1"]])  # mid-epoch, epoch end
def test_resume_auto_after_completion_does_nothing_more(tmp_path: Path, stop: list[str]) -> None:
    assert run(tmp_path, *stop).returncode == 0
    assert run(tmp_path, *stop).returncode == 0
    ends = events(tmp_path, "end")
    assert events(tmp_path, "resumed")[0]["step"] == ends[0]["step"] > 0
    assert [e["step"] for e in ends] == [ends[0]["step"]] * 2
    assert ends[1]["val_acc"] == ends[0]["val_acc"]  # the same weights evaluated again, not NaN


@pytest.mark.slow  # trainer processes
def test_sync_bn_without_cuda_is_a_clear_error(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: --sync-bn is valid here")
    proc = run(tmp_path, "--sync-bn", "--max-steps", "2")
    assert proc.returncode != 0 and "--sync-bn needs CUDA" in proc.stderr


def _tiny_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long())


def test_a_resume_says_where_from_after_start_and_before_the_note(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: a user must see that a run resumed, and a finished run's lines come in order:
    [start], then where it resumed from, then what to do about a finished run."""
    from ckptkit.train import TrainConfig, train
    from fixtures.models import TinyNet

    cfg = TrainConfig(out=str(tmp_path), epochs=1, batch_size=32, log_every=100)
    train(cfg, model=TinyNet(), data=(_tiny_data(), _tiny_data()))
    assert "resumed from" not in capsys.readouterr().out
    train(cfg, model=TinyNet(), data=(_tiny_data(), _tiny_data()))
    lines = capsys.readouterr().out.splitlines()
    checkpoint = tmp_path / "checkpoints" / "step_000000002.pt"
    said = [
        i
        for i, line in enumerate(lines)
        if line.startswith(("[start]", "resumed from", "note: this run already finished"))
    ]
    assert [lines[i].split(" ")[0] for i in said] == ["[start]", "resumed", "note:"], lines
    assert lines[said[1]] == f"resumed from step 2 (checkpoint {checkpoint})"
    assert events(tmp_path, "resumed")[0]["path"] == str(checkpoint)


def test_resuming_into_another_model_names_the_folder_and_how_to_start_fresh(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 26: two examples sharing runs/x: the second died with "Fix the model definition",
    naming neither the checkpoint's folder nor --resume none."""
    from ckptkit.errors import StateDictMismatchError
    from ckptkit.train import TrainConfig, main, train
    from fixtures.models import TinyNet

    cfg = TrainConfig(out=str(tmp_path), epochs=1, batch_size=32, log_every=100)
    train(cfg, model=TinyNet(), data=(_tiny_data(), _tiny_data()))
    with pytest.raises(StateDictMismatchError) as e:
        train(cfg, model=TinyNet(hidden=32), data=(_tiny_data(), _tiny_data()))
    folder = tmp_path / "checkpoints"
    assert f"the newest checkpoint in {folder}" in str(e.value) and "TrainConfig(resume='none')" in str(e.value)
    assert "strict=False" not in str(e.value) and e.value.mismatched
    capsys.readouterr()
    # The same from the command line names the flag (the built-in MLP is not TinyNet).
    assert main(["--out", str(tmp_path), "--epochs", "1"]) == 1
    err = capsys.readouterr().err
    assert f"the newest checkpoint in {folder}" in err and "--resume none" in err and "TrainConfig" not in err
    assert len(err.strip().splitlines()) == 1
