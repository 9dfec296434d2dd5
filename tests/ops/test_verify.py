"""One judge of "readable": for generated and mutated files, ``verify`` (its structural checks)
passes exactly what ``read_checkpoint`` reads, never passes what the peer reader (torch.load with
weights_only=True, safetensors) refuses, and where both read, they read the same values.

Hypothesis runs derandomized (the same mutants every run), so CI is repeatable.
"""

from __future__ import annotations

import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import ckptkit
from tests.torchcompat import SAVE_ALONE

MUTANTS = settings(max_examples=60, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
STATE = {"w": torch.arange(6.0), "b": torch.tensor([-1, 2], dtype=torch.int64)}


def _torch_file(folder: Path) -> Path:
    torch.save({"model": STATE, "step": 3, "name": "run", "lrs": [0.1, 0.01]}, folder / "t.pt")
    return folder / "t.pt"


def _ckptkit_zip(folder: Path) -> Path:
    ckptkit.write_checkpoint(STATE, folder / "c.pt")
    return folder / "c.pt"


def _ckptkit_safetensors(folder: Path) -> Path:
    ckptkit.write_checkpoint(STATE, folder / "c.safetensors")
    return folder / "c.safetensors"


def _dcp_folder(folder: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    dcp.save({**STATE, "step": 3}, checkpoint_id=folder / "dcp", **SAVE_ALONE)
    return folder / "dcp"


SOURCES: dict[str, Callable[[Path], Path]] = {
    "torch.save zip": _torch_file,
    "ckptkit zip": _ckptkit_zip,
    "ckptkit safetensors": _ckptkit_safetensors,
    "DCP folder": _dcp_folder,
}


def _peer_reads(path: Path) -> bool | None:
    """Whether the format's own reader reads it (None: a folder, whose peer is torch's DCP reader,
    which read_checkpoint already is)."""
    if path.is_dir():
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            load_file(path) if path.suffix == ".safetensors" else torch.load(path, weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal counts: the peers raise many kinds
        return False
    return True


def _mutate(src: Path, dst: Path, data: st.DataObject) -> None:
    if src.is_dir():
        shutil.copytree(src, dst)
        target = dst / data.draw(st.sampled_from(sorted(p.name for p in src.iterdir())))
    else:
        shutil.copy(src, dst)
        target = dst
    raw = bytearray(target.read_bytes())
    at = data.draw(st.integers(0, 1 << 20)) % len(raw)  # a DCP .metadata's length varies from save to save
    how = data.draw(st.sampled_from(["flip", "truncate", "delete"]))
    if how == "flip":
        raw[at] ^= 1 << data.draw(st.integers(0, 7))
    elif how == "truncate":
        del raw[at:]
    else:
        del raw[at]
    target.write_bytes(bytes(raw))


@pytest.mark.parametrize("source", sorted(SOURCES))
@given(data=st.data())
@MUTANTS
def test_verify_passes_exactly_what_the_reader_reads(tmp_path_factory: Any, source: str, data: st.DataObject) -> None:
    folder = tmp_path_factory.mktemp("mutant")
    src = SOURCES[source](folder)
    bad = folder / ("mutant" + src.suffix)
    _mutate(src, bad, data)
    try:
        verified = ckptkit.verify_checkpoint(bad, full=False).ok
    except ckptkit.errors.CkptkitError:
        verified = False
    try:
        got: Any = ckptkit.read_checkpoint(bad)
    except ckptkit.errors.CkptkitError:
        got = None
    assert verified == (got is not None), f"verify says {verified}, read_checkpoint {'reads' if got else 'refuses'}"
    peer = _peer_reads(bad)
    if peer is False:
        assert not verified, "verify passes a file its format's own reader refuses"
    if got is not None and peer:
        expected = load_file(bad) if bad.suffix == ".safetensors" else torch.load(bad, weights_only=True)
        assert _same(got, expected)


def _same(a: Any, b: Any) -> bool:
    """Equal trees, tensors bit for bit (dtype and shape too)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        bits = lambda t: t.detach().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and (a.dtype, a.shape) == (b.dtype, b.shape)
            and torch.equal(bits(a), bits(b))
        )
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
