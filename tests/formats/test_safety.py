"""Advice that is tested (issue 25, item 4): every refusal to unpickle names exactly the globals a
weights-only load needs, and following it, as written, loads the file.

Each checkpoint of the catalogue below is refused by the Python API (``load_for_rank``) and by the
CLI's ``convert``, ``inspect`` and ``verify``; the advised flags are read from the message text
(``allow_globals=[...]`` or ``--allow-global X``, else ``trust=True`` / ``--trust``), the command is
run again with exactly those, and it must succeed. No message on the way may end in an empty cause.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import enum
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import CkptkitError, UnsafeCheckpointError
from ckptkit.model.layout import find_model_state
from fixtures.models import TinyNet


@dataclasses.dataclass
class TrainConfig:
    lr: float = 0.1
    name: str = "run"


class Phase(enum.Enum):
    TRAIN = 1
    EVAL = 2


class Meter:
    """A class of the training script's own, as resuming code pickles them."""

    def __init__(self) -> None:
        self.count, self.total = 3, 1.5


def _sd() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TinyNet().state_dict()


def _mmengine() -> dict[str, Any]:
    # mmengine's CheckpointHook: numpy scalars and dtypes in "meta"; numpy.dtype(code) builds the
    # numpy.dtypes classes (Float64DType, Int64DType) that the pickle never names.
    meta = {
        "epoch": np.int64(3),
        "iter": np.int64(120),
        "lr": np.float64(0.01),
        "seed": np.int32(7),
        "hist": np.arange(3, dtype=np.float32),
        "dtype": np.dtype("float64"),
        "exp_name": "r50",
    }
    return {"meta": meta, "state_dict": _sd(), "message_hub": {"log_scalars": {"loss": np.float64(0.3)}}}


def _timm() -> dict[str, Any]:
    args = argparse.Namespace(model="resnet18", lr=0.1, epochs=3, sched="cosine", mixup=0.0, amp=True)
    return {
        "epoch": 3,
        "arch": "resnet18",
        "state_dict": _sd(),
        "state_dict_ema": _sd(),
        "args": args,
        "version": 2,
        "metric": 0.5,
    }


# name -> (what torch.save gets, torch.save keyword arguments)
CATALOGUE: dict[str, Callable[[], tuple[Any, dict[str, Any]]]] = {
    "namespace": lambda: ({"model": _sd(), "args": argparse.Namespace(lr=0.1, epochs=3)}, {}),
    "namespace-legacy": lambda: (
        {"model": _sd(), "args": argparse.Namespace(lr=0.1)},
        {"_use_new_zipfile_serialization": False},
    ),
    "timm-args": lambda: (_timm(), {}),
    "numpy-array": lambda: ({"model": _sd(), "hist": np.arange(4, dtype=np.float32)}, {}),
    "numpy-scalars": lambda: ({"model": _sd(), "best": np.float64(0.5), "step": np.int64(3)}, {}),
    "numpy-rng-state": lambda: ({"model": _sd(), "rng": np.random.get_state()}, {}),
    "numpy-randomstate": lambda: ({"model": _sd(), "rng": np.random.RandomState(0)}, {}),
    "numpy-generator": lambda: ({"model": _sd(), "rng": np.random.default_rng(0)}, {}),
    "mmengine": lambda: (_mmengine(), {}),
    "dataclass": lambda: ({"model": _sd(), "cfg": TrainConfig()}, {}),
    "enum": lambda: ({"model": _sd(), "phase": Phase.EVAL}, {}),
    "defaultdict": lambda: ({"model": _sd(), "counts": collections.defaultdict(list, a=[1])}, {}),
    "custom-class": lambda: ({"model": _sd(), "meter": Meter()}, {}),
}
# Not yet right, each for a reason outside the advice's own modules (the report of issue 25 has the
# diffs): a filled defaultdict loads only trusted (torch's unpickler sets items on dicts alone), but
# inspect and verify advise the static scan's names (they do not ask needed_globals yet), and
# ckptkit's inert pickle walk calls its items "malformed pickle" (torchpickle.Call takes no items).
PENDING: set[tuple[str, str]] = set()


def _save(tmp_path: Path, name: str) -> Path:
    obj, kwargs = CATALOGUE[name]()
    path = tmp_path / f"{name}.pt"
    torch.save(obj, path, **kwargs)
    return path


def _run(*args: Any) -> tuple[int, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, " ".join((result.stdout + result.stderr).split())  # rich wraps long lines


def advised_cli(text: str) -> list[str]:
    """The flags a CLI message advises: every ``--allow-global X``, else ``--trust``."""
    names = re.findall(r"--allow-global ([\w.]+?)(?=[,\s]|\.?$)", text)
    if names:
        return [a for n in names for a in ("--allow-global", n)]
    assert "--trust" in text, text
    return ["--trust"]


def advised_python(text: str) -> dict[str, Any]:
    """The keywords a Python message advises: ``allow_globals=[...]``, else ``trust=True``."""
    found = re.search(r"allow_globals=\[([^\]]*)\]", text)
    if found:
        return {"allow_globals": [n.strip() for n in found.group(1).split(",")]}
    assert "trust=True" in text, text
    return {"trust": True}


def assert_full_cause(message: str) -> None:
    """A message never ends in an empty cause: no trailing colon, no empty brackets, no ': .'."""
    text = message.strip()
    assert text and not text.endswith(":"), message
    assert not re.search(r":\s*[.;)]|\(\s*\)|:\s*,", text), message


def _cases(command: str) -> list[Any]:
    """The catalogue's names for ``command``; those in PENDING expected to fail until fixed (strict)."""
    pending = pytest.mark.xfail(strict=True, reason="see PENDING")
    return [pytest.param(n, marks=pending) if (command, n) in PENDING else n for n in sorted(CATALOGUE)]


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_python_advice_works_when_followed(tmp_path: Path, name: str) -> None:
    path = _save(tmp_path, name)
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptkit.load_for_rank(path)
    assert_full_cause(str(info.value))
    advice = advised_python(str(info.value))
    if "allow_globals" in advice:  # the error's names are the advice's, in the same order
        assert list(info.value.globals) == advice["allow_globals"]
    got = ckptkit.load_for_rank(path, **advice)
    assert torch.equal(find_model_state(got)[1]["fc1.weight"], _sd()["fc1.weight"])


@pytest.mark.parametrize("name", _cases("convert"))
def test_convert_advice_works_when_followed(tmp_path: Path, name: str) -> None:
    _cli_advice_works(tmp_path, name, "convert")


@pytest.mark.parametrize("name", _cases("inspect"))
def test_inspect_advice_works_when_followed(tmp_path: Path, name: str) -> None:
    _cli_advice_works(tmp_path, name, "inspect")


def _cli_advice_works(tmp_path: Path, name: str, command: str) -> None:
    path = _save(tmp_path, name)
    extra = [tmp_path / "out.pt"] if command == "convert" else []
    code, said = _run(command, path, *extra)
    assert code == 1 and ("refused" in said or "not loaded" in said), said
    assert_full_cause(said)
    flags = advised_cli(said)
    code, again = _run(command, path, *extra, *flags)
    assert code == 0, again
    if command == "convert":  # what it wrote: the same weights (its other entries still need the flags)
        written = ckptkit.read_checkpoint(tmp_path / "out.pt", trust=True)
        assert torch.equal(find_model_state(written)[1]["fc1.weight"], _sd()["fc1.weight"])


@pytest.mark.parametrize("name", _cases("verify"))
def test_verify_advice_admits_the_load(tmp_path: Path, name: str) -> None:
    """``verify`` has no --allow-global: what it advises must be what the load it gates needs."""
    path = _save(tmp_path, name)
    code, said = _run("verify", path)
    assert code == 1 and "--trust" in said, said
    assert_full_cause(said)
    flags = advised_cli(said)
    names = flags[1::2] if flags != ["--trust"] else []
    report = ckptkit.verify_checkpoint(path)
    report.gate(**({"allow_globals": names} if names else {"trust": True}))
    ckptkit.load_for_rank(path, verify=True, **({"allow_globals": names} if names else {"trust": True}))


def test_names_come_from_loading_not_only_from_the_scan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A static scan that misses globals (as it once missed numpy.dtypes classes, as torch's own
    get_unsafe_globals_in_checkpoint still does) no longer makes advice that fails when followed."""
    import ckptkit.formats.pickles.safety as safety
    from ckptkit.formats.pickles.scan import checkpoint_globals

    path = _save(tmp_path, "mmengine")
    full = safety.needed_globals(path).names
    scanned = checkpoint_globals(path)
    monkeypatch.setattr(
        safety, "checkpoint_globals", lambda p: [g for g in scanned if not g.startswith("numpy.dtypes.")]
    )
    found = safety.needed_globals(path)
    assert found.loads and set(found.names) == set(full)
    assert {"numpy.dtypes.Float64DType", "numpy.dtypes.Int64DType"} <= set(found.names)
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptkit.load_for_rank(path)
    assert set(advised_python(str(info.value))["allow_globals"]) == set(full)
    assert set(safety.needed_globals(path, first_guess=[]).names) == set(full)  # no guess at all: found by loading


def test_the_probe_runs_nothing_the_file_names(tmp_path: Path) -> None:
    """A pickle calling ``builtins.exec`` is probed with an inert stand-in: nothing runs."""
    import pickle

    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (exec, (f"import pathlib; pathlib.Path({str(tmp_path / 'ran')!r}).write_text('ran')",))

    torch.save({"model": _sd(), "x": Evil()}, tmp_path / "evil.pt", pickle_protocol=pickle.DEFAULT_PROTOCOL)
    with pytest.raises(UnsafeCheckpointError, match="builtins.exec"):
        ckptkit.load_for_rank(tmp_path / "evil.pt")
    assert not (tmp_path / "ran").exists()


def test_advice_that_cannot_work_is_not_given(tmp_path: Path) -> None:
    """A filled defaultdict: torch's weights-only unpickler sets items only on dicts, so allowing
    its globals is not enough; the refusal says so, with torch's reason, and advises only trust."""
    path = _save(tmp_path, "defaultdict")
    with contextlib.suppress(pickle.UnpicklingError), torch.serialization.safe_globals([collections.defaultdict, list]):
        torch.load(path, weights_only=True)
        pytest.skip(f"torch {torch.__version__} sets items on an allowed defaultdict: allowing its globals works there")
    with pytest.raises(UnsafeCheckpointError) as info:
        ckptkit.load_for_rank(path)
    assert "allow_globals" not in str(info.value) and "Can only SETITEM" in str(info.value)
    with pytest.raises(CkptkitError) as again:  # the advice not taken: still told why, never "...:"
        ckptkit.load_for_rank(path, allow_globals=["collections.defaultdict", "builtins.list"])
    assert isinstance(again.value, UnsafeCheckpointError) and "Can only SETITEM" in str(again.value)
    assert_full_cause(str(again.value))


def test_torch_reason_is_never_empty() -> None:
    """torch puts some reasons on the lines after "WeightsUnpickler error:"; reading only that line
    once made "torch cannot load this checkpoint...:" end in nothing."""
    from ckptkit.formats.pickles.safety import torch_reason

    e = __import__("pickle").UnpicklingError(
        "Weights only load failed. Please file an issue: WeightsUnpickler error: \n\nUnsupported operand 149"
    )
    assert torch_reason(e) == "Unsupported operand 149"
    assert torch_reason(RuntimeError("")) == "RuntimeError"
