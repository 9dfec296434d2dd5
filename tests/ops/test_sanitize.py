"""``convert --trust --sanitize``: old checkpoints made loadable by ``torch.load(weights_only=True)``.

The sources are laid out as the projects whose users hit torch 2.6's default write them:
fairseq (``args`` an ``argparse.Namespace``, numpy scalars in ``extra_state``), e3nn-style and
HF Trainer RNG files (numpy's ``get_state()`` tuple next to torch's and Python's), a dataclass
config, numpy arrays and a bit generator's state. Each output loads weights-only, with the
values exact, the tensors byte for byte, and every change in the notes.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from ckptkit.ops.reports import ConvertReport


@dataclass
class OptimConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.98)


@dataclass
class ModelConfig:
    dim: int = 8
    optim: OptimConfig = field(default_factory=OptimConfig)
    mean: np.ndarray = field(default_factory=lambda: np.array([0.5, 0.25], dtype=np.float32))


class Opaque:
    """A class no weights-only load builds, and sanitize has no plain form for."""


def model_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    return {
        "encoder.weight": w,
        "encoder.bias": torch.randn(6, generator=g).bfloat16(),
        "decoder.weight": w,
        "encoder.rows": w[2:4],
        "steps": torch.arange(3),
    }


def fairseq_like() -> dict[str, Any]:
    args = argparse.Namespace(
        arch="transformer", lr=[0.0005], max_tokens=4096, seed=np.int64(1), data=Path("/data/bin")
    )
    return {
        "args": args,
        "cfg": None,
        "model": model_state(),
        "optimizer_history": [
            {
                "criterion_name": "CrossEntropyCriterion",
                "optimizer_name": "FairseqAdam",
                "lr_scheduler_state": {"best": np.float64(3.25)},
                "num_updates": 10,
            }
        ],
        "extra_state": {
            "epoch": np.int32(2),
            "val_loss": np.float32(3.5),
            "train_iterator": {"epoch": 2, "shuffle": np.bool_(True)},
        },
    }


def e3nn_like() -> dict[str, Any]:
    np.random.seed(7)
    np.random.rand(3)  # a state partway through the stream
    return {
        "model": model_state(),
        "config": ModelConfig(),
        "rng": {"numpy": np.random.get_state(), "torch": torch.get_rng_state(), "python": random.getstate()},
        "generator": np.random.default_rng(3).bit_generator.state,
        "mt": np.random.Generator(np.random.MT19937(5)).bit_generator.state,
        "stats": {
            "mean": np.linspace(0, 1, 5),
            "counts": np.array([[1, 2], [3, 4]], dtype=np.int16),
            "labels": np.array(["a", "b"]),
        },
    }


def raw(t: torch.Tensor) -> bytes:
    return bytes(t.contiguous().view(torch.uint8).numpy())


def convert(tmp_path: Path, obj: Any, **kw: Any) -> tuple[ConvertReport, Any]:
    torch.save(obj, tmp_path / "old.pt")
    report = ckptkit.convert_checkpoint(tmp_path / "old.pt", tmp_path / "clean.pt", trust=True, sanitize=True, **kw)
    return report, torch.load(tmp_path / "clean.pt", weights_only=True)


def assert_weights_identical(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and raw(got[k]) == raw(v), k
    assert got["decoder.weight"] is got["encoder.weight"]  # a tie stays a tie
    assert (
        got["encoder.rows"].untyped_storage().data_ptr() == got["encoder.weight"].untyped_storage().data_ptr()
    )  # a view a view


def test_a_fairseq_checkpoint_loads_weights_only(tmp_path: Path) -> None:
    old = fairseq_like()
    torch.save(old, tmp_path / "before.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        torch.load(tmp_path / "before.pt", weights_only=True)  # what users hit since torch 2.6
    report, new = convert(tmp_path, old)
    assert new["args"] == {"arch": "transformer", "lr": [0.0005], "max_tokens": 4096, "seed": 1, "data": "/data/bin"}
    assert type(new["args"]["seed"]) is int
    assert new["extra_state"] == {"epoch": 2, "val_loss": 3.5, "train_iterator": {"epoch": 2, "shuffle": True}}
    assert new["optimizer_history"][0]["lr_scheduler_state"]["best"] == 3.25
    assert_weights_identical(new["model"], old["model"])
    assert report.sanitized == [
        "args: argparse.Namespace -> dict",
        "args/seed: numpy.int64 -> int",
        "args/data: pathlib.PosixPath -> str",
        "optimizer_history/0/lr_scheduler_state/best: numpy.float64 -> float",
        "extra_state/epoch: numpy.int32 -> int",
        "extra_state/val_loss: numpy.float32 -> float",
        "extra_state/train_iterator/shuffle: numpy.bool -> bool",
    ]
    assert any(
        n.startswith("sanitized for torch.load(weights_only=True): args: argparse.Namespace -> dict; ")
        for n in report.notes
    )


def test_numpy_rng_state_dataclasses_and_arrays_become_plain_values(tmp_path: Path) -> None:
    old = e3nn_like()
    report, new = convert(tmp_path, old)
    np.random.set_state(new["rng"]["numpy"])  # numpy takes the plain state back, and goes on where it was
    after = np.random.rand(4)
    np.random.set_state(old["rng"]["numpy"])
    assert np.array_equal(after, np.random.rand(4))
    assert isinstance(new["rng"]["numpy"][1], list) and new["rng"]["python"] == old["rng"]["python"]
    assert raw(new["rng"]["torch"]) == raw(old["rng"]["torch"])
    for key in ("generator", "mt"):  # a bit generator takes its plain state back
        g, ref = (getattr(np.random, old[key]["bit_generator"])() for _ in range(2))
        g.state, ref.state = new[key], old[key]
        assert np.array_equal(np.random.Generator(g).random(3), np.random.Generator(ref).random(3))
    assert new["config"] == {"dim": 8, "optim": {"lr": 3e-4, "betas": (0.9, 0.98)}, "mean": new["config"]["mean"]}
    assert torch.equal(new["config"]["mean"], torch.tensor([0.5, 0.25]))
    assert new["stats"]["mean"].dtype == torch.float64 and np.array_equal(
        new["stats"]["mean"].numpy(), old["stats"]["mean"]
    )
    assert new["stats"]["counts"].dtype == torch.int16 and new["stats"]["counts"].tolist() == [[1, 2], [3, 4]]
    assert new["stats"]["labels"] == ["a", "b"]
    assert_weights_identical(new["model"], old["model"])
    assert report.sanitized == [
        "config: tests.ops.test_sanitize.ModelConfig (a dataclass) -> dict",
        "config/optim: tests.ops.test_sanitize.OptimConfig (a dataclass) -> dict",
        "config/mean: numpy.ndarray float32 (2,) -> tensor float32",
        "rng/numpy: numpy RNG state (np.random.get_state()'s MT19937 tuple) -> plain values (np.random.set_state takes them)",
        "generator: numpy RNG state (PCG64 bit_generator.state) -> plain values (arrays as lists)",
        "mt: numpy RNG state (MT19937 bit_generator.state) -> plain values (arrays as lists)",
        "stats/mean: numpy.ndarray float64 (5,) -> tensor float64",
        "stats/counts: numpy.ndarray int16 (2, 2) -> tensor int16",
        "stats/labels: numpy.ndarray <U1 (2,) -> list",
    ]


def test_a_plain_checkpoint_is_written_as_it_was(tmp_path: Path) -> None:
    report, new = convert(tmp_path, {"model": model_state(), "epoch": 3})
    assert report.sanitized == [] and "sanitize: nothing to change" in report.notes[-1]
    assert_weights_identical(new["model"], model_state()) and new["epoch"] == 3


def test_with_model_only_only_the_weights_are_sanitized(tmp_path: Path) -> None:
    report, new = convert(
        tmp_path, {"model": model_state(), "args": argparse.Namespace(lr=1), "opaque": Opaque()}, model_only=True
    )
    assert report.sanitized == [] and list(new) == list(model_state())


def test_an_unknown_class_is_refused_naming_its_key_path_and_class(tmp_path: Path) -> None:
    torch.save({"model": model_state(), "extra": {"hooks": [Opaque()]}}, tmp_path / "old.pt")
    with pytest.raises(ckptkit.errors.UnsupportedCheckpointError) as e:
        ckptkit.convert_checkpoint(tmp_path / "old.pt", tmp_path / "clean.pt", trust=True, sanitize=True)
    message = str(e.value)
    assert "extra/hooks/0 is a tests.ops.test_sanitize.Opaque" in message and "model_only=True" in message
    assert "add_safe_globals([tests.ops.test_sanitize.Opaque])" in message
    assert not (tmp_path / "clean.pt").exists()


def test_sanitize_needs_trust(tmp_path: Path) -> None:
    torch.save(fairseq_like(), tmp_path / "old.pt")
    with pytest.raises(ckptkit.errors.ArgumentError, match=r"add trust=True if you trust"):
        ckptkit.convert_checkpoint(tmp_path / "old.pt", tmp_path / "clean.pt", sanitize=True)


def run(*args: object) -> Any:
    return CliRunner().invoke(main, [str(a) for a in args])


def test_the_cli_shows_each_change_and_exits_right(tmp_path: Path) -> None:
    torch.save(fairseq_like(), tmp_path / "old.pt")
    result = run("convert", tmp_path / "old.pt", tmp_path / "clean.pt", "--sanitize")
    assert result.exit_code == 2 and "add --trust if you trust" in result.stderr and "Traceback" not in result.output
    result = run("convert", tmp_path / "old.pt", tmp_path / "clean.pt", "--trust", "--sanitize")
    assert result.exit_code == 0, result.output
    assert "note: sanitized for torch.load(weights_only=True): args: argparse.Namespace -> dict;" in result.stderr
    assert "extra_state/val_loss: numpy.float32 -> float" in result.stderr
    torch.load(tmp_path / "clean.pt", weights_only=True)
    result = run("convert", tmp_path / "old.pt", tmp_path / "clean2.pt", "--trust", "--sanitize", "--json")
    assert json.loads(result.stdout)["sanitized"][0] == "args: argparse.Namespace -> dict"
    torch.save({"model": model_state(), "x": Opaque()}, tmp_path / "bad.pt")
    result = run("convert", tmp_path / "bad.pt", tmp_path / "out.pt", "--trust", "--sanitize")
    assert (
        result.exit_code == 1
        and "x is a tests.ops.test_sanitize.Opaque" in result.stderr
        and "--model-only" in result.stderr
    )
    assert "Traceback" not in result.output and not (tmp_path / "out.pt").exists()


def test_sanitize_and_dtype_together(tmp_path: Path) -> None:
    report, new = convert(tmp_path, fairseq_like(), dtype="bf16")
    assert new["model"]["encoder.weight"].dtype == torch.bfloat16 and new["args"]["seed"] == 1
    assert torch.equal(new["model"]["encoder.weight"], model_state()["encoder.weight"].bfloat16())
    assert any(n.startswith("cast ") for n in report.notes) and report.sanitized
