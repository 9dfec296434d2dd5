"""The model's weights found by shape under an attribute prefix (issue 12, part 5).

Fixtures are Lightning's own checkpoints (fixtures/make_lightning_fixtures.py): a LightningModule
holding ``self.net = torch.compile(TinyNet())`` (keys ``net._orig_mod.*``), and one holding a
teacher and a student of the same shape.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ckptkit
from ckptkit.errors import StateDictMismatchError
from fixtures.models import TinyNet

LIGHTNING = Path(__file__).resolve().parents[2] / "fixtures" / "lightning"
COMPILED = LIGHTNING / "compiled_net.ckpt"
DISTIL = LIGHTNING / "teacher_student.ckpt"


def _expected(name: str) -> dict[str, torch.Tensor]:
    return torch.load(LIGHTNING / f"{name}.expected.pt", weights_only=True)


def _assert_equal(model: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert list(got) == list(expected)
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


@pytest.mark.parametrize("wrap", ["plain", "compiled", "dataparallel"])
def test_lightning_net_attribute_loads_into_the_plain_network(wrap: str) -> None:
    net = TinyNet()
    target = {
        "plain": net,
        "compiled": torch.compile(net, backend="eager"),
        "dataparallel": torch.nn.DataParallel(net),
    }[wrap]
    with pytest.warns(UserWarning, match=r"under 'net\.', the only part of the checkpoint that fits TinyNet"):
        ckptkit.load_for_rank(COMPILED, model=target)
    _assert_equal(net, _expected("compiled_net"))


def test_several_fitting_parts_are_an_error_that_names_them_and_the_fix() -> None:
    with pytest.raises(StateDictMismatchError) as e:
        ckptkit.load_for_rank(DISTIL, model=TinyNet())
    msg = str(e.value)
    assert "2 parts of the checkpoint fit TinyNet by name and shape ('teacher.', 'student.')" in msg
    assert "key='student.'" in msg and "--key student. --model-only" in msg
    assert "--strip" not in msg  # it renames in place, keeping the teacher: the file would not load either


def test_the_top_level_and_an_ema_copy_beside_it_are_two_fitting_parts(tmp_path: Path) -> None:
    # Before: "9 unexpected key(s) (ema.fc1.weight ...). Fix the model definition, or pass
    # strict=False", naming neither part nor key=.
    torch.manual_seed(0)
    live, ema = TinyNet().state_dict(), TinyNet().state_dict()
    torch.save({**live, **{f"ema.{k}": v for k, v in ema.items()}}, tmp_path / "ema.pt")
    with pytest.raises(StateDictMismatchError) as e:
        ckptkit.load_for_rank(tmp_path / "ema.pt", model=TinyNet())
    msg = str(e.value)
    assert "2 parts of the checkpoint fit TinyNet by name and shape (the top level, 'ema.')" in msg
    assert "key='ema.'" in msg and "--key ema. --model-only" in msg and "strict=False for the top level alone" in msg
    for key, want in ((None, live), ("ema.", ema)):
        net = TinyNet()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said explicitly: no note
            ckptkit.load_for_rank(tmp_path / "ema.pt", model=net, key=key, strict=key is not None)
        _assert_equal(net, want)


@pytest.mark.parametrize("key", ["student.", "state_dict/student.", "teacher."])
def test_key_with_a_trailing_dot_selects_a_prefix(key: str) -> None:
    net = TinyNet()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said explicitly: no note
        ckptkit.load_for_rank(DISTIL, model=net, key=key)
    _assert_equal(net, _expected("teacher_student")[key.split("/")[-1][:-1]])


def test_unknown_prefix_key_names_the_prefixes_there() -> None:
    with pytest.raises(
        ckptkit.errors.LayoutError, match=r"no weight starts with 'pupil\.' \(they start with teacher\., student\.\)"
    ):
        ckptkit.load_for_rank(DISTIL, model=TinyNet(), key="pupil.")


@pytest.mark.parametrize(
    ("state", "fits"),
    [
        ({"a.w": (2, 3), "a.b": (3,)}, ["a."]),
        ({"module.a._orig_mod.w": (2, 3), "module.a.b": (3,), "x": (1,)}, ["module.a."]),
        ({"a.w": (3, 2), "a.b": (3,)}, []),  # a shape differs
        ({"a.w": (2, 3), "a.b": (3,), "a.extra": (1,)}, []),  # not one to one
        ({"a.w": (2, 3)}, []),  # a model key missing
        ({"a.w": (2, 3), "a.b": (3,), "b.c.w": (2, 3), "b.c.b": (3,)}, ["a.", "b.c."]),
    ],
)
def test_fitting_prefixes(state: dict[str, tuple[int, ...]], fits: list[str]) -> None:
    from ckptkit.model.fit import fitting_prefixes

    sd = {k: torch.zeros(s) for k, s in state.items()}
    assert fitting_prefixes(sd, {"w": torch.zeros(2, 3), "b": torch.zeros(3)}) == fits


def test_convert_writes_one_part_with_key_and_model_only(tmp_path: Path) -> None:
    out = tmp_path / "student.safetensors"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "ckptkit.cli",
            "convert",
            str(DISTIL),
            str(out),
            "--key",
            "student.",
            "--model-only",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["dropped"][-1] == "9 weight(s) outside student."
    from safetensors.torch import load_file

    got, want = load_file(out), _expected("teacher_student")["student"]
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_convert_refuses_part_of_the_weights_without_model_only(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "convert", str(DISTIL), str(tmp_path / "s.pt"), "--key", "student."],
        capture_output=True,
        text=True,
    )
    assert run.returncode != 0 and not (tmp_path / "s.pt").exists()
    assert (
        "--key student. selects part of" in run.stderr
        and "--model-only" in run.stderr
        and "--strip student." in run.stderr
    )


@pytest.mark.parametrize("strict", [True, False])
def test_a_copy_that_fits_is_taken_when_the_top_level_does_not(tmp_path: Path, strict: bool) -> None:
    # The top level has every model key but one of another shape (a teacher of another width,
    # say); 'ema.' fits exactly: it is the only part that fits, so it is loaded and said so.
    # Before, strict raised a shape mismatch and strict=False loaded the top level minus that key.
    torch.manual_seed(0)
    fits = TinyNet().state_dict()
    top = {
        k: torch.zeros(v.shape[0] + 1, *v.shape[1:]) if k == "fc1.weight" else torch.zeros_like(v)
        for k, v in fits.items()
    }
    torch.save({**top, **{f"ema.{k}": v for k, v in fits.items()}}, tmp_path / "c.pt")
    net = TinyNet()
    with pytest.warns(
        UserWarning, match=r"loaded the weights under 'ema\.', the only part of the checkpoint that fits TinyNet"
    ):
        ckptkit.load_for_rank(tmp_path / "c.pt", model=net, strict=strict)
    _assert_equal(net, fits)
