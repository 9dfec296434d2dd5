"""torch.optim.swa_utils.AveragedModel (SWA/EMA): its weights under ``module.`` beside the buffer
``n_averaged``, which broke the common prefix, so nothing was stripped (issue 25, finding 3)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.optim.swa_utils import AveragedModel

import ckptkit
from fixtures.models import TinyNet
from tests.cli.test_cli import run
from tests.train.test_trainer import assert_same_tree


def _averaged(wrap: bool) -> tuple[AveragedModel, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    net = TinyNet()
    avg = AveragedModel(torch.nn.DataParallel(net) if wrap else net)
    for _ in range(3):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(0.5)
        avg.update_parameters(torch.nn.DataParallel(net) if wrap else net)
    plain = {
        k.removeprefix("module.").removeprefix("module."): v for k, v in avg.state_dict().items() if k != "n_averaged"
    }
    return avg, plain


@pytest.mark.parametrize("wrap", [False, True], ids=["AveragedModel(m)", "AveragedModel(DataParallel(m))"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_unwraps_an_averaged_model(tmp_path: Path, wrap: bool, suffix: str) -> None:
    avg, plain = _averaged(wrap)
    assert "n_averaged" in avg.state_dict() and int(avg.state_dict()["n_averaged"]) == 3
    torch.save(avg.state_dict(), tmp_path / "swa.pt")
    code, _, err = run("convert", tmp_path / "swa.pt", tmp_path / f"single{suffix}")
    assert code == 0, err
    assert "n_averaged (AveragedModel's count of averaged models) not written" in err
    got = ckptkit.read_checkpoint(tmp_path / f"single{suffix}")
    assert_same_tree(dict(got), plain)
    TinyNet().load_state_dict(got, strict=True)


def test_convert_to_keep_keeps_the_count(tmp_path: Path) -> None:
    avg, _ = _averaged(False)
    torch.save(avg.state_dict(), tmp_path / "swa.pt")
    code, _, err = run("convert", tmp_path / "swa.pt", tmp_path / "kept.pt", "--to", "keep")
    assert code == 0, err
    assert_same_tree(dict(ckptkit.read_checkpoint(tmp_path / "kept.pt")), dict(avg.state_dict()))


def test_model_only_from_a_training_checkpoint(tmp_path: Path) -> None:
    avg, plain = _averaged(True)
    torch.save({"model": avg.state_dict(), "epoch": 3}, tmp_path / "ckpt.pt")
    code, _, err = run("convert", tmp_path / "ckpt.pt", tmp_path / "m.safetensors", "--model-only")
    assert code == 0, err
    assert_same_tree(dict(ckptkit.read_checkpoint(tmp_path / "m.safetensors")), plain)


@pytest.mark.parametrize("wrap", [False, True], ids=["AveragedModel(m)", "AveragedModel(DataParallel(m))"])
def test_load_for_rank_into_a_plain_model_and_into_an_averaged_one(tmp_path: Path, wrap: bool) -> None:
    avg, plain = _averaged(wrap)
    torch.save(avg.state_dict(), tmp_path / "swa.pt")
    model = TinyNet()
    ckptkit.load_for_rank(tmp_path / "swa.pt", model=model)
    assert_same_tree(dict(model.state_dict()), plain)
    again = AveragedModel(TinyNet())  # the count stays where the model has it
    ckptkit.load_for_rank(tmp_path / "swa.pt", model=again)
    assert int(again.n_averaged) == 3
    assert_same_tree(
        {k: v for k, v in again.state_dict().items() if k != "n_averaged"}, {f"module.{k}": v for k, v in plain.items()}
    )


def test_a_plain_key_named_n_averaged_among_others_is_left_alone() -> None:
    sd = {"fc.weight": torch.ones(1), "n_averaged": torch.tensor(2)}
    assert list(ckptkit.strip_prefix(sd, "module.")) == list(sd)
    from ckptkit.prefix import rewrite_prefixes

    assert list(rewrite_prefixes(sd)) == ["fc.weight", "n_averaged"]  # not an AveragedModel's: kept


def test_diff_still_sees_a_different_count(tmp_path: Path) -> None:
    """diff compares what the files hold: two averages of different counts differ."""
    avg, _ = _averaged(False)
    torch.save(avg.state_dict(), tmp_path / "a.pt")
    avg.n_averaged.fill_(5)
    torch.save(avg.state_dict(), tmp_path / "b.pt")
    code, out, err = run("diff", tmp_path / "a.pt", tmp_path / "b.pt")
    assert code == 1 and "n_averaged" in out + err, out + err


def test_load_into_a_wrapped_averaged_model_keeps_the_count(tmp_path: Path) -> None:
    avg, _ = _averaged(False)
    torch.save(avg.state_dict(), tmp_path / "swa.pt")
    wrapped = torch.nn.DataParallel(AveragedModel(TinyNet()))  # its count is module.n_averaged
    ckptkit.load_for_rank(tmp_path / "swa.pt", model=wrapped)
    assert int(wrapped.module.n_averaged) == 3


def test_mmengine_ema_steps_go_with_its_wrapper(tmp_path: Path) -> None:
    """mmengine's EMA (BaseAveragedModel) keeps ``steps`` beside ``module.*``, as AveragedModel
    keeps ``n_averaged``: --key ema_state_dict gives the plain weights without it, and says so."""
    ema = {
        "module.fc.weight": torch.arange(6.0).reshape(2, 3),
        "module.fc.bias": torch.ones(2),
        "steps": torch.tensor(7),
    }
    torch.save(
        {
            "meta": {"epoch": 1},
            "state_dict": {"fc.weight": torch.zeros(2, 3), "fc.bias": torch.zeros(2)},
            "ema_state_dict": ema,
        },
        tmp_path / "epoch_1.pth",
    )
    report = ckptkit.convert_checkpoint(
        tmp_path / "epoch_1.pth", tmp_path / "ema.safetensors", key="ema_state_dict", model_only=True
    )
    got = load_file(tmp_path / "ema.safetensors")
    assert sorted(got) == ["fc.bias", "fc.weight"] and torch.equal(got["fc.weight"], ema["module.fc.weight"])
    assert any(n.startswith("steps (mmengine's EMA step count) not written") for n in report.notes), report.notes
