"""Long copies land at their source's offset within a page; safetensors headers are written once.

ext4 copies a page into a page faster than across two (BENCHMARKS.md), so convert pads a
zip record's header, or a safetensors header, to keep a long tensor's bytes at the offset within
a 4 KiB page they had in the source. Stripping ``module.`` shortens the pickle or the header
before them, which used to move every tensor off its source's page offset. The outputs must
still be read by torch, safetensors and huggingface_hub as before, values exact.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import load_torch_model
from safetensors.torch import load_file, save_file

import ckptkit
from ckptkit.formats.detect import SAFETENSORS, ZIP
from ckptkit.formats.safetensors.codec import read_header, write_safetensors
from ckptkit.formats.source import open_source
from ckptkit.formats.torchzip.container import TorchZip

PAGE = 4096
LONG = 1 << 20  # fileio.PAGE_FROM: shorter copies keep torch's 64-byte alignment only


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(512, 512)  # 1 MiB weights, 2 KiB bias
        self.b = torch.nn.Linear(512, 640)
        self.c = torch.nn.Linear(640, 512)


def ddp_state() -> OrderedDict[str, torch.Tensor]:
    torch.manual_seed(0)
    return OrderedDict((f"module.{k}", v) for k, v in Net().state_dict().items())


def offsets(path: Path) -> dict[str, int]:
    """Where each tensor's bytes start in ``path``: a torch zip's storages by key, a safetensors
    file's (or a folder of shards') tensors by name, for those of LONG bytes or more."""
    found: dict[str, int] = {}
    if path.is_dir():
        for shard in sorted(path.glob("*.safetensors")):
            found |= {f"{shard.name}:{k}": v for k, v in offsets(shard).items()}
        return found
    if path.suffix == ".safetensors":
        with open(path, "rb") as f:
            header, start = read_header(f)
        spans = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
        return {k: start + b for k, (b, e) in spans.items() if e - b >= LONG}
    with TorchZip(path) as z:
        return {r.name.rsplit("/", 1)[-1]: r.data_offset for r in z.records if "/data/" in r.name and r.size >= LONG}


def residues(path: Path, by_name: bool) -> list[int]:
    """Page offsets of the long tensors, in a fixed order (names stripped of ``module.``)."""
    found = offsets(path)
    keys = sorted(found, key=lambda k: k.split(":")[-1].removeprefix("module.")) if by_name else sorted(found, key=int)
    return [found[k] % PAGE for k in keys]


def test_pt_to_pt_keeps_every_long_record_at_its_source_page_offset(tmp_path: Path) -> None:
    src, out = tmp_path / "ddp.pt", tmp_path / "single.pt"
    torch.save(ddp_state(), src)
    ckptkit.convert_checkpoint(src, out)
    assert len(residues(src, by_name=False)) == 3
    assert residues(out, by_name=False) == residues(src, by_name=False)
    got = torch.load(out, weights_only=True)
    want = {k.removeprefix("module."): v for k, v in ddp_state().items()}
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert ckptkit.verify_checkpoint(out).ok


def test_safetensors_rename_keeps_the_data_at_its_source_page_offset(tmp_path: Path) -> None:
    src, out = tmp_path / "ddp.safetensors", tmp_path / "single.safetensors"
    save_file(ddp_state(), src)
    ckptkit.convert_checkpoint(src, out)
    with open(src, "rb") as f:
        _, src_start = read_header(f)
    with open(out, "rb") as f:
        _, out_start = read_header(f)
    assert out_start % PAGE == src_start % PAGE and out_start % 8 == 0
    got, want = load_file(out), {k.removeprefix("module."): v for k, v in ddp_state().items()}
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("shards", [False, True])
def test_pt_to_safetensors_puts_the_most_long_bytes_at_their_source_page_offset(tmp_path: Path, shards: bool) -> None:
    """Tensors lie back to back in safetensors, so one residue is chosen per file: the one the
    most long bytes share (here b.weight's 1.25 MiB; shards of one long tensor each get all)."""
    src = tmp_path / "ddp.pt"
    torch.save(ddp_state(), src)
    out = tmp_path / ("hf" if shards else "single.safetensors")
    ckptkit.convert_checkpoint(src, out, max_shard_size="1500KB" if shards else None)
    with TorchZip(src) as z:
        source = open_source(src, ZIP)
        try:
            keys = {name.removeprefix("module."): ref.storage.key for name, ref in source.obj.items()}
        finally:
            source.close()
        at = {r.name.rsplit("/", 1)[-1]: r.data_offset for r in z.records}
    got = {k.split(":")[-1]: v for k, v in offsets(out).items()}
    congruent = [k for k, v in got.items() if (v - at[keys[k]]) % PAGE == 0]
    assert congruent == (sorted(got) if shards else ["b.weight"])
    want = {k.removeprefix("module."): v for k, v in ddp_state().items()}
    if shards:
        model = Net()
        load_torch_model(model, out, strict=True)
        loaded = model.state_dict()
    else:
        loaded = load_file(out)
    assert all(torch.equal(loaded[k], want[k]) for k in want)


class WriteSpy(io.FileIO):
    """A file that records where each write through Python lands (kernel copies do not pass here)."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, "w+")
        self.at: list[int] = []

    def write(self, b: Any) -> int:
        self.at.append(self.tell())
        return super().write(b)


@pytest.mark.parametrize("fmt", [ZIP, SAFETENSORS])
def test_a_safetensors_header_is_written_once_when_the_source_records_every_crc(tmp_path: Path, fmt: str) -> None:
    """A zip records each storage's CRC-32, and ckptkit's safetensors each tensor's: the header
    goes out final, not with placeholders rewritten after the data (a page the disk may be
    writing back already)."""
    src = tmp_path / ("ddp.pt" if fmt == ZIP else "ddp.safetensors")
    (torch.save if fmt == ZIP else ckptkit.write_checkpoint)(ddp_state(), src)
    source = open_source(src, fmt)
    f = WriteSpy(tmp_path / "out.safetensors")
    try:
        entries = OrderedDict((k.removeprefix("module."), source.entry(v, k)) for k, v in source.obj.items())
        write_safetensors(f, entries, {}, source=str(src))
    finally:
        f.close()
        source.close()
    assert f.at.count(0) == 1 and f.at == sorted(f.at)
    assert ckptkit.verify_checkpoint(tmp_path / "out.safetensors").ok
