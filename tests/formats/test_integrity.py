"""Checksums: recorded at save time, carried through conversions, checked by verify."""

from __future__ import annotations

import json
import struct
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


def _edit_header(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (of the same length) in a safetensors header."""
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = data[8 : 8 + n]
    assert len(old) == len(new) and header.count(old) >= 1, header
    path.write_bytes(data[:8] + header.replace(old, new, 1) + data[8 + n :])


HEADER_EDITS = {
    # one bit of a tensor name: "ab" -> "ac"
    "a flipped bit in a name": (b'"ab":{', b'"ac":{'),
    # -1 would then convert to 18446744073709551615
    "I64 edited to U64": (b'"I64"', b'"U64"'),
    "the CRC map naming a tensor that is not there": (b'{\\"ab\\"', b'{\\"zz\\"'),
}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
def test_an_edited_safetensors_header_fails_verify_and_convert_refuses_it(tmp_path: Path, edit: str) -> None:
    import torch

    path = tmp_path / "m.safetensors"
    ckptkit.write_checkpoint({"ab": torch.tensor([-1, 2], dtype=torch.int64)}, path)
    assert verify_ok(path)
    _edit_header(path, *HEADER_EDITS[edit])
    report = ckptkit.verify_checkpoint(path, full=False)
    said = "changed since ckptkit wrote it"
    assert not report.ok and said in report.checks[-1].detail
    for read in (ckptkit.read_checkpoint, ckptkit.load_for_rank):  # the readers judge it as verify does
        with pytest.raises(ckptkit.errors.CheckpointFormatError, match=said):
            read(path)
    result = CliRunner().invoke(main, ["convert", str(path), str(tmp_path / "out.pt")])
    assert result.exit_code == 1 and said in result.stderr and result.stderr.count("\n") == 1, result.output
    assert not (tmp_path / "out.pt").exists()


def test_a_crc_map_that_misses_a_tensor_fails_verify(tmp_path: Path) -> None:
    """Files from other writers may carry the map (no header checksum): it must name each tensor once."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.ones(2), "b": torch.ones(2)}, path, metadata={"ckptkit.crc32": json.dumps({"a": "00000000"})})
    report = ckptkit.verify_checkpoint(path, full=False)
    assert [(c.name, c.detail) for c in report.checks if not c.ok] == [
        ("structure", f"{path}: its ckptkit.crc32 map misses b: the file is damaged")
    ]
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="map misses b"):
        ckptkit.read_checkpoint(path)


def test_a_header_nested_100000_deep_is_one_error(tmp_path: Path) -> None:
    header = (
        b'{"__metadata__":{"x":'
        + b"[" * 100_000
        + b"]" * 100_000
        + b'},"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    )
    path = tmp_path / "deep.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    report = ckptkit.verify_checkpoint(path)
    assert not report.ok and "RecursionError" in report.checks[-1].detail
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="header is not valid JSON"):
        ckptkit.read_checkpoint(path)


def test_another_writers_aliases_are_ignored_as_every_reader_ignores_them(tmp_path: Path) -> None:
    """ckptkit.aliases in a header ckptkit did not write (no header checksum) adds no tensor: the
    fuzzer's case, where read_checkpoint gave a key safetensors' own reader does not."""
    import torch
    from safetensors.torch import load_file, save_file

    path = tmp_path / "m.safetensors"
    save_file({"w": torch.ones(2)}, path, metadata={"ckptkit.aliases": json.dumps({"w.t": ["w", 1]})})
    assert sorted(ckptkit.read_checkpoint(path)) == sorted(load_file(path)) == ["w"]
    report = ckptkit.verify_checkpoint(path)
    assert report.ok and any("ckptkit.aliases ignored" in c.detail for c in report.checks), report.checks
    ckptkit.convert_checkpoint(path, tmp_path / "out.pt")
    assert sorted(torch.load(tmp_path / "out.pt", weights_only=True)) == ["w"]
