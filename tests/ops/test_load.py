from __future__ import annotations

import argparse
import builtins
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import ckptkit
from ckptkit.model.layout import find_model_state
from fixtures.models import TiedLM, TinyNet


def reference(fixtures_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(fixtures_dir / "plain.pt", weights_only=True)


def assert_weights(model: nn.Module, ref: dict[str, torch.Tensor]) -> None:
    got = ckptkit.unwrap_model(model).state_dict()
    assert list(got) == list(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.parametrize(
    "name",
    [
        "plain.pt",
        "ddp.pt",
        "dp.pth",
        "compiled.pt",
        "compiled_of_ddp.pt",
        "ddp_of_compiled.pt",
        "legacy_ddp.pt",
        "ddp.safetensors",
        "train_ckpt.pt",
        "cuda0_ddp.pt",
    ],
)
@pytest.mark.parametrize("wrap", [lambda m: m, nn.DataParallel, torch.compile])
def test_load_for_rank_into_any_wrapping(fixtures_dir: Path, name: str, wrap) -> None:
    model = wrap(TinyNet())
    ckptkit.load_for_rank(fixtures_dir / name, model=model)
    assert_weights(model, reference(fixtures_dir))


def test_cuda_tagged_checkpoint_opens_on_a_cpu_only_machine(fixtures_dir: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; the CPU fallback is what is tested here")
    with pytest.raises(RuntimeError, match="CUDA"):  # what plain torch.load does here
        torch.load(fixtures_dir / "cuda0_ddp.pt", weights_only=True)
    ckpt = ckptkit.load_for_rank(fixtures_dir / "cuda0_ddp.pt")
    assert {t.device.type for t in ckpt["model"].values()} == {"cpu"}
    assert ckpt["epoch"] == 1


def test_device_for_rank_maps_local_rank_and_wraps_around() -> None:
    assert ckptkit.device_for_rank(local_rank=1, cuda_available=True, device_count=2) == "cuda:1"
    assert ckptkit.device_for_rank(local_rank=3, cuda_available=True, device_count=2) == "cuda:1"
    assert ckptkit.device_for_rank(local_rank=1, cuda_available=False) == "cpu"


def test_explicit_map_location_is_honoured(fixtures_dir: Path) -> None:
    ckpt = ckptkit.load_for_rank(fixtures_dir / "cuda0_ddp.pt", map_location="meta")
    assert {t.device.type for t in ckpt["model"].values()} == {"meta"}


class _Payload:
    """Unpickling this creates a marker file: harmless, and observable."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (builtins.open, (str(self.marker), "w"))


@pytest.mark.parametrize("legacy", [False, True])
def test_code_payload_is_refused_and_never_runs(tmp_path: Path, legacy: bool) -> None:
    marker = tmp_path / "PAYLOAD_RAN"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Payload(marker)}, path, _use_new_zipfile_serialization=not legacy)
    with pytest.raises(ckptkit.errors.UnsafeCheckpointError) as err:
        ckptkit.load_for_rank(path, model=None)
    assert err.value.globals == ("io.open",)
    assert "io.open" in str(err.value) and "trust=True" in str(err.value)
    assert not marker.exists()
    # The same file with explicit trust does run the payload: proof the test above can fail.
    ckptkit.load_for_rank(path, trust=True)
    assert marker.exists()


def test_unsafe_error_is_also_a_value_error(fixtures_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"argparse\.Namespace"):
        ckptkit.load_for_rank(fixtures_dir / "needs_trust.pt")


def test_allow_globals_admits_only_the_named_type(fixtures_dir: Path) -> None:
    model = TinyNet()
    ckpt = ckptkit.load_for_rank(fixtures_dir / "needs_trust.pt", model=model, allow_globals=[argparse.Namespace])
    assert ckpt["args"].lr == 0.01
    assert_weights(model, reference(fixtures_dir))


def test_mismatch_lists_every_problem_at_once(fixtures_dir: Path) -> None:
    class Wider(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(8, 32)
            self.bn = nn.BatchNorm1d(32)
            self.out = nn.Linear(32, 4)

    with pytest.raises(ckptkit.errors.StateDictMismatchError) as err:
        ckptkit.load_for_rank(fixtures_dir / "ddp.pt", model=Wider())
    e = err.value
    assert sorted(e.missing) == ["out.bias", "out.weight"]
    assert sorted(e.unexpected) == ["fc2.bias", "fc2.weight"]
    assert ("fc1.weight", (16, 8), (32, 8)) in e.mismatched
    assert len(e.mismatched) == 6
    text = str(e)
    assert "ddp.pt does not fit Wider" in text and "2 missing" in text and "strict=False" in text
    assert isinstance(e, KeyError) and not text.startswith("'")


def test_strict_false_loads_what_fits(fixtures_dir: Path) -> None:
    model = nn.Sequential()
    model.fc1 = nn.Linear(8, 16)
    model.fc2 = nn.Linear(16, 5)  # wrong width: skipped with a warning
    before = model.fc2.weight.clone()
    with pytest.warns(UserWarning, match="skipped 2 key"):
        ckptkit.load_for_rank(fixtures_dir / "ddp.pt", model=model, strict=False)
    assert torch.equal(model.fc1.weight, reference(fixtures_dir)["fc1.weight"])
    assert torch.equal(model.fc2.weight, before)


def test_lightning_checkpoint_hint_and_wrappers(fixtures_dir: Path) -> None:
    found = TinyNet()  # Lightning's model. prefix is the one part that fits: found by shape (issue 12)
    with pytest.warns(UserWarning, match="loaded the weights under 'model.'"):
        ckptkit.load_for_rank(fixtures_dir / "lightning.ckpt", model=found)
    assert_weights(found, reference(fixtures_dir))
    model = TinyNet()
    ckptkit.load_for_rank(fixtures_dir / "lightning.ckpt", model=model, wrappers=("model.", "module."))
    assert_weights(model, reference(fixtures_dir))


def test_tied_safetensors_round_trip(fixtures_dir: Path, tmp_path: Path) -> None:
    torch.manual_seed(1)
    lm = TiedLM()
    loaded = ckptkit.read_checkpoint(fixtures_dir / "tied.safetensors")
    assert list(loaded) == list(lm.state_dict())
    assert loaded["head.weight"] is loaded["embed.weight"]
    fresh = TiedLM()
    ckptkit.load_for_rank(fixtures_dir / "tied.safetensors", model=fresh)
    assert fresh.head.weight is fresh.embed.weight
    assert torch.equal(fresh.embed.weight, lm.embed.weight)


@pytest.mark.parametrize("key,expect", [(None, "model"), ("model", "model")])
def test_layout_lookup(fixtures_dir: Path, key: str | None, expect: str) -> None:
    ckpt = torch.load(fixtures_dir / "train_ckpt.pt", weights_only=True)
    path, sd = find_model_state(ckpt, key=key)
    assert path == (expect,) and sd is ckpt["model"]


def test_layout_errors_name_what_is_there(fixtures_dir: Path) -> None:
    with pytest.raises(ckptkit.errors.LayoutError, match=r"no entry 'ema'.*entries: model, optimizer"):
        ckptkit.load_for_rank(fixtures_dir / "train_ckpt.pt", model=TinyNet(), key="ema")
    with pytest.raises(ckptkit.errors.LayoutError, match="no model state dict found"):
        find_model_state({"epoch": 1, "lr": 0.1})


def test_missing_file_suggests_near_names(fixtures_dir: Path) -> None:
    with pytest.raises(ckptkit.errors.CheckpointNotFoundError, match="similar names there: ddp.pt") as err:
        ckptkit.load_for_rank(fixtures_dir / "ddp.ptt")
    assert isinstance(err.value, FileNotFoundError)


@pytest.mark.parametrize(
    "content,match",
    [(b"", "empty"), (b"hello world, not a checkpoint", "not a checkpoint"), (b"PK\x03\x04" + b"\0" * 40, "damaged")],
)
def test_garbage_files_give_format_errors(tmp_path: Path, content: bytes, match: str) -> None:
    path = tmp_path / "x.pt"
    path.write_bytes(content)
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match=match):
        ckptkit.load_for_rank(path)


@pytest.mark.parametrize("cut", [0.3, 0.6, 0.95])
def test_truncated_zip_is_a_format_error(fixtures_dir: Path, tmp_path: Path, cut: float) -> None:
    data = (fixtures_dir / "ddp.pt").read_bytes()
    path = tmp_path / "cut.pt"
    path.write_bytes(data[: int(len(data) * cut)])
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="cut.pt"):
        ckptkit.load_for_rank(path)


def test_directory_without_metadata_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="folder without a .metadata"):
        ckptkit.load_for_rank(tmp_path)


def test_loading_does_not_modify_the_file(fixtures_dir: Path) -> None:
    path = fixtures_dir / "ddp.pt"
    before = (path.read_bytes(), os.stat(path).st_mtime_ns)
    ckptkit.load_for_rank(path, model=TinyNet())
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before
