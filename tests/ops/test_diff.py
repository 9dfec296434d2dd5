"""``ckptkit diff`` compares weights as a plain model names them, whatever wraps them."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
from click.testing import CliRunner
from torch.optim.swa_utils import AveragedModel

import ckptkit
from ckptkit.cli import main


def test_an_averaged_model_diffs_equal_to_its_plain_weights(tmp_path: Path) -> None:
    """n_averaged kept module. from reading as a prefix: "0 of 0 shared tensors", every key different."""
    model = nn.Linear(3, 2)
    torch.save(AveragedModel(model).state_dict(), tmp_path / "swa.pt")  # module.weight, module.bias, n_averaged
    torch.save(model.state_dict(), tmp_path / "plain.pt")
    report = ckptkit.diff_checkpoints(tmp_path / "swa.pt", tmp_path / "plain.pt")
    assert report.equal and report.compared == 2
    assert report.notes == [
        f"{tmp_path / 'swa.pt'}: n_averaged (AveragedModel's count of averaged models) set aside: a plain model has no such buffer"
    ]
    result = CliRunner().invoke(main, ["diff", str(tmp_path / "swa.pt"), str(tmp_path / "plain.pt")])
    assert result.exit_code == 0 and "n_averaged" in result.output, result.output
