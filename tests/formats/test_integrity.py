"""Checksums: recorded at save time, carried through conversions, checked by verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from fixtures.models import TinyNet


def flip(path: Path, offset_from_end: int) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def verify_ok(path: Path) -> bool:
    result = CliRunner().invoke(main, ["verify", str(path), "--json"])
    return json.loads(result.stdout)["ok"]


def test_safetensors_written_by_ckptkit_detects_a_flipped_bit(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    ckptkit.write_checkpoint(TinyNet().state_dict(), path)
    assert verify_ok(path)
    flip(path, 10)  # inside the last tensor's bytes
    assert not verify_ok(path)
    with pytest.raises(
        ckptkit.errors.CheckpointFormatError, match="failed verification: CRC-32 of every tensor: damaged"
    ):
        ckptkit.load_for_rank(path, verify=True)


@pytest.mark.parametrize(
    "route", [("ddp.pt", ".safetensors"), ("tied.safetensors", ".safetensors"), ("tied.safetensors", ".pt")]
)
def test_conversions_keep_checksums_valid(fixtures_dir: Path, tmp_path: Path, route: tuple[str, str]) -> None:
    src, suffix = route
    out = tmp_path / f"out{suffix}"
    assert ckptkit.convert_checkpoint(fixtures_dir / src, out).fast
    report = ckptkit.verify_checkpoint(out)
    assert report.ok, report.checks
    crc_check = [c for c in report.checks if c.name.startswith("CRC-32")]
    assert crc_check and crc_check[0].ok  # checksums present and matching, not merely absent


def test_foreign_safetensors_says_it_has_no_checksums(fixtures_dir: Path) -> None:
    report = ckptkit.verify_checkpoint(fixtures_dir / "ddp.safetensors")  # written by safetensors itself
    assert report.ok
    assert any("cannot be detected" in c.detail for c in report.checks)


def test_load_for_rank_verify_catches_a_zip_payload_flip(fixtures_dir: Path, tmp_path: Path) -> None:
    path = tmp_path / "flipped.pt"
    path.write_bytes((fixtures_dir / "ddp.pt").read_bytes())
    from ckptkit.formats.torchzip.container import TorchZip

    rec = TorchZip(path).storage("0")
    data = bytearray(path.read_bytes())
    data[rec.data_offset] ^= 0x04
    path.write_bytes(bytes(data))
    ckptkit.load_for_rank(path)  # torch.load itself checks no CRC: the flip loads silently
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="CRC-32 of every record: damaged"):
        ckptkit.load_for_rank(path, verify=True)


def test_verify_true_still_refuses_unsafe_files_as_unsafe(fixtures_dir: Path) -> None:
    with pytest.raises(ckptkit.errors.UnsafeCheckpointError):
        ckptkit.load_for_rank(fixtures_dir / "needs_trust.pt", verify=True)
    model = TinyNet()
    import argparse

    ckptkit.load_for_rank(fixtures_dir / "needs_trust.pt", verify=True, model=model, allow_globals=[argparse.Namespace])
