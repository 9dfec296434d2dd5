"""Opening a DCP folder torch-free (``open_dcp``): each chunk zip read through two windows, each
distinct chunk layout unpickled once, and nothing checked less than before; and a damaged
``.metadata`` failing ``verify`` exactly where ``read_checkpoint`` (torch's reader) refuses it.

The folders are written by ``torch.distributed.checkpoint`` itself; chunks are 16 KiB, so that
a chunk's headers and its central directory fall in different windows.
"""

from __future__ import annotations

import io
import pickle
import re
import struct
import subprocess
import sys
import threading
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptkit import convert_checkpoint, read_checkpoint, verify_checkpoint
from ckptkit.errors import CheckpointFormatError
from ckptkit.formats.dcp import stream as dcpstream
from ckptkit.formats.dcp.meta import read_metadata
from ckptkit.formats.dcp.stream import DcpTensor, open_dcp
from ckptkit.formats.pickles import reader as torchpickle
from ckptkit.formats.source import NeedsTorch
from ckptkit.formats.torchzip.container import SliceReader, TorchZip
from ckptkit.formats.torchzip.directory import CENTRAL, read_directory
from ckptkit.io.fileio import crc32
from tests.torchcompat import SAVE_ALONE

WHERE = "chunk at [0, 0] in __0_0.distcp"
WHERE_RE = re.escape(WHERE)


def _state() -> dict[str, torch.Tensor]:
    # "a" and "b": one shape and dtype, so their chunks hold the same data.pkl bytes
    return {
        "a": torch.arange(64 * 64, dtype=torch.float32).reshape(64, 64),
        "b": torch.full((64, 64), 2.5),
        "c": torch.ones(3),
    }


def _save(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ckpt.dcp"
    dcp.save(_state(), checkpoint_id=str(folder), **SAVE_ALONE)
    return folder


def _chunk_zip(folder: Path, fqn: str) -> tuple[Path, int, zipfile.ZipFile, TorchZip]:
    """The ``.distcp`` file holding ``fqn``'s one chunk, the chunk's offset, and its zip read two ways."""
    stored = read_metadata(folder).entries[fqn].chunks[0].stored  # type: ignore[union-attr]
    with open(folder / stored.file, "rb") as f:
        f.seek(stored.offset)
        chunk = f.read(stored.length)
    return (
        folder / stored.file,
        stored.offset,
        zipfile.ZipFile(io.BytesIO(chunk)),
        TorchZip("chunk", file=io.BytesIO(chunk)),
    )


def _patch(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(data)


def test_chunks_of_one_layout_give_each_their_own_pieces(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    src = open_dcp(folder)
    try:
        pieces = {k: v.pieces for k, v in src.obj.items() if isinstance(v, DcpTensor)}
        crcs = {k: crc32(v.numpy().tobytes()) for k, v in _state().items()}
    finally:
        src.close()
    assert {k: [(p.length, p.crc) for p in v] for k, v in pieces.items()} == {
        "a": [(16384, crcs["a"])],
        "b": [(16384, crcs["b"])],
        "c": [(12, crcs["c"])],
    }
    assert len({p[0].offset for p in pieces.values()}) == 3


def test_damaged_central_directory_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    path, offset, zf, _ = _chunk_zip(folder, "b")
    _patch(path, offset + zf.start_dir + 3, b"\x09")  # the first directory header's signature: PK\x01\x09
    with pytest.raises(CheckpointFormatError, match=rf"tensor b's {WHERE_RE}: .*central directory is damaged"):
        open_dcp(folder)
    out = tmp_path / "out.pt"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "convert", str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and f"tensor b's {WHERE}" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_a_lazily_opened_folder_finds_each_tensors_chunks_when_asked(tmp_path: Path) -> None:
    """convert opens lazily, so that chunk headers are read while the disk writes back what was
    copied: a damaged chunk is then refused when its tensor is reached, naming it, not at open."""
    folder = _save(tmp_path)
    path, offset, zf, _ = _chunk_zip(folder, "b")
    _patch(path, offset + zf.start_dir + 3, b"\x09")
    src = open_dcp(folder, lazy=True)
    try:
        a = src.obj["a"]
        assert a._found is None and a.nbytes == 64 * 64 * 4  # nothing read yet; the size is .metadata's
        assert [(p.length, p.crc) for p in a.pieces] == [(64 * 64 * 4, crc32(_state()["a"].numpy().tobytes()))]
        with pytest.raises(CheckpointFormatError, match=rf"tensor b's {WHERE_RE}: .*central directory is damaged"):
            src.obj["b"].pieces  # noqa: B018
    finally:
        src.close()
    with pytest.raises(CheckpointFormatError, match="tensor b's "):
        open_dcp(folder)  # the default: every chunk read at open


@pytest.mark.parametrize("damage", ["directory", "split"])
def test_chunks_found_lazily_fail_when_the_writer_reaches_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    """convert finds each tensor's chunks when the writer reaches it. What it finds wrong there is
    raised then: a damaged chunk fails naming it, leaving nothing; one torch must read falls back
    to torch."""
    import torch.distributed.checkpoint as dcp

    state = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.full((64, 64), 2.5), "c": torch.ones(3)}
    folder = tmp_path / "ckpt.dcp"
    dcp.save(state, checkpoint_id=str(folder), **SAVE_ALONE)  # a: one 4 MiB chunk
    if damage == "directory":
        path, offset, zf, _ = _chunk_zip(folder, "b")
        _patch(path, offset + zf.start_dir + 3, b"\x09")
    found_by: dict[str, str] = {}
    real = dcpstream._pieces

    def pieces(src: Any, e: Any, seen: Any) -> Any:
        found_by[e.fqn] = threading.current_thread().name
        if damage == "split" and e.fqn == "b":
            raise NeedsTorch("tensor b is split along dim 1")  # what chunks_in_order raises for such chunks
        return real(src, e, seen)

    monkeypatch.setattr(dcpstream, "_pieces", pieces)
    out = tmp_path / "out.pt"
    if damage == "directory":
        with pytest.raises(CheckpointFormatError, match=rf"tensor b's {WHERE_RE}: .*central directory is damaged"):
            convert_checkpoint(folder, out)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.dcp"]
    else:
        report = convert_checkpoint(folder, out)
        assert not report.fast and "split along dim 1" in report.fallback_reason
        assert {k: torch.equal(v, state[k]) for k, v in torch.load(out).items()} == dict.fromkeys(state, True)
    assert (found_by["a"], found_by["b"]) == ("MainThread", "MainThread")


def _replace_data_pkl(folder: Path, fqn: str, payload: bytes) -> None:
    """Put ``payload`` (as long as the old data.pkl) in ``fqn``'s chunk, its CRC-32 set to match in
    the local and the central header, as a writer of such a pickle would."""
    path, offset, zf, z = _chunk_zip(folder, fqn)
    info = zf.getinfo(f"{z.prefix}data.pkl")
    assert len(payload) == info.file_size and zf.infolist()[0] == info  # torch writes data.pkl first
    _patch(path, offset + z.by_name[info.filename].data_offset, payload)
    crc = struct.pack("<I", crc32(payload))
    _patch(path, offset + info.header_offset + 14, crc)  # local header: CRC-32 at byte 14
    _patch(path, offset + zf.start_dir + 16, crc)  # the first central header: CRC-32 at byte 16


def test_protocol_5_buffer_in_a_chunk_pickle_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    _, _, zf, z = _chunk_zip(folder, "b")
    size = zf.getinfo(f"{z.prefix}data.pkl").file_size
    # BYTEARRAY8 claiming 1 TiB: refused before anything is allocated
    _replace_data_pkl(folder, "b", (b"\x80\x05\x96" + (1 << 40).to_bytes(8, "little")).ljust(size, b"."))
    with pytest.raises(CheckpointFormatError, match=rf"tensor b's {WHERE_RE}: .*protocol-5 buffer opcodes"):
        open_dcp(folder)


def test_damaged_data_pkl_of_a_repeated_layout_is_refused_naming_the_tensor(tmp_path: Path) -> None:
    folder = _save(tmp_path)
    path, offset, _, z = _chunk_zip(folder, "b")
    at = offset + z.by_name[f"{z.prefix}data.pkl"].data_offset + 20
    with open(path, "rb") as f:
        f.seek(at)
        byte = f.read(1)[0]
    _patch(path, at, bytes([byte ^ 0x01]))
    with pytest.raises(CheckpointFormatError, match=rf"tensor b's {WHERE_RE}: .*data\.pkl fails its CRC-32 check"):
        open_dcp(folder)


def _edit_b(folder: Path, what: str) -> None:
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # written by this test's dcp.save: DCP's classes only
    md = meta.state_dict_metadata["b"]
    if what == "dtype":
        md.properties.dtype = torch.float16
    else:
        md.size = md.chunks[0].sizes = torch.Size([32, 128])
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


@pytest.mark.parametrize(("what", "says"), [("dtype", r"float16\[64, 64\]"), ("size", r"float32\[32, 128\]")])
def test_a_chunk_whose_data_pkl_was_seen_is_still_checked_against_the_metadata(
    tmp_path: Path, what: str, says: str
) -> None:
    folder = _save(tmp_path)
    _edit_b(folder, what)  # "a" (first, same data.pkl bytes) still agrees with the metadata; "b" no longer does
    with pytest.raises(
        CheckpointFormatError, match=rf"tensor b's {WHERE_RE} is float32\[64, 64\]; \.metadata says {says}"
    ):
        open_dcp(folder)


_READS = [(0, 4), (0, 120), (10, 30), (40, 60), (90, 30), (110, 50), (119, 1), (120, 5), (130, 5), (5, -1), (60, 0)]


@pytest.mark.parametrize("window", [0, 1, 7, 16, 50, 64])
def test_windowed_slice_reads_what_the_file_holds(tmp_path: Path, window: int) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(256)) * 4)
    expected = path.read_bytes()[100:220]
    with open(path, "rb") as f:
        view = SliceReader(f, 100, 120, window=window)  # windows of 16 and 50: head, a gap, tail; 64: all of it
        for at, n in _READS:
            view.seek(at)
            data = expected[at : at + n] if n >= 0 else expected[at:]
            assert (view.read(n), view.tell()) == (data, at + len(data)), (at, n)
        view.seek(-22, 2)
        assert view.read() == expected[-22:]


def test_windows_of_a_file_shorter_than_the_slice_are_not_used(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    path.write_bytes(bytes(range(90)))
    with open(path, "rb") as f:
        view = SliceReader(f, 0, 100, window=16)  # the tail window would be 6 bytes, 10 short
        view.seek(94)
        assert view.read(6) == b""  # not bytes 84..89 placed as if they ended the slice
        view.seek(80)
        assert view.read() == bytes(range(80, 90))


def _pt(tmp_path: Path, comment: bytes = b"", *, appended: int = 0, zip64_only: bool = False) -> Path:
    """A torch file with an archive comment, ``appended`` stray bytes after it, and with
    ``zip64_only`` its own end records kept (torch writes zip64 ones) and the 32-bit record's
    counts and offsets set to zip64's placeholders, so only the zip64 record says where things are."""
    path = tmp_path / "t.pt"
    torch.save({"w": torch.arange(50_000.0)}, path)  # 200 kB: a file smaller than its 64 KiB search trips a miniz bug
    if zip64_only:
        data = bytearray(path.read_bytes())
        struct.pack_into("<2HIIH", data, len(data) - 22 + 8, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, len(comment))
        data += comment
    else:
        with zipfile.ZipFile(path, "a") as zf:  # zipfile writes the comment (and its length) into the end record
            zf.comment = comment
        data = bytearray(path.read_bytes())
    path.write_bytes(bytes(data) + b"z" * appended)
    return path


END_RECORDS = {
    "none": {},
    "plain": {"comment": b"a note"},
    "signature-in-comment": {"comment": b"x" * 30 + b"PK\x05\x06" + b"y" * 10},
    "signature-at-end": {"comment": b"tail ends with PK\x05\x06"},
    "many-signatures": {"comment": b"PK\x05\x06" * 20 + b"zz"},
    "signature-at-both-ends": {"comment": b"PK\x05\x06" + b"q" * 14 + b"PK\x05\x06"},
    "longest comment, zip64 records": {"comment": b"c" * 65520, "zip64_only": True},
    **{f"{n} bytes appended": {"appended": n} for n in (65_540, 66_000, 68_000, 69_700)},
}


@pytest.mark.parametrize("case", list(END_RECORDS))
def test_end_record_is_found_where_torch_finds_it(tmp_path: Path, case: str) -> None:
    """miniz takes the last signature with a whole 22-byte record after it, searching back in 4 KiB
    blocks until 64 KiB are covered, and looks for a zip64 locator 20 bytes before it. zipfile took
    the last signature of all ("signature-in-comment": a file torch reads, called damaged)."""
    path = _pt(tmp_path, **END_RECORDS[case])  # type: ignore[arg-type]
    try:
        expected = torch.load(path, weights_only=True)["w"]
    except RuntimeError:  # e.g. the comment's signatures stand for a multi-disk end record
        with pytest.raises(CheckpointFormatError):
            read_checkpoint(path)
    else:
        assert torch.equal(read_checkpoint(path)["w"], expected)


def test_a_zip64_size_of_exactly_0xffffffff_is_read() -> None:
    """torch (and ckptkit's writer) use zip64 from 2**32 - 1 bytes on, so the 64-bit size may be
    0xFFFFFFFF itself; it was taken for a missing field."""
    name, extra = b"a/data/0", struct.pack("<HHQQ", 1, 16, 0xFFFFFFFF, 0xFFFFFFFF)
    central = CENTRAL.pack(
        0x02014B50, 45, 45, 0, 0, 0, 0, 0, 0xFFFFFFFF, 0xFFFFFFFF, len(name), len(extra), 0, 0, 0, 0, 0
    )
    directory = central + name + extra
    data = directory + struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 1, 1, len(directory), 0, 0)
    (entry,) = read_directory(Path("x.pt"), io.BytesIO(data), len(data))
    assert (entry.size, entry.compressed_size, entry.header_offset) == (0xFFFFFFFF, 0xFFFFFFFF, 0)


def test_end_record_checks_still_refuse_a_multi_disk_zip(tmp_path: Path) -> None:
    path = _pt(tmp_path, b"")
    data = bytearray(path.read_bytes())
    struct.pack_into(
        "<H", data, len(data) - 22 + 8, struct.unpack_from("<H", data, len(data) - 22 + 8)[0] - 1
    )  # entries on this disk
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match="multi-disk archive"):
        TorchZip(path)


def _framed(body: bytes, frame: int | None = None) -> bytes:
    """A protocol-4 pickle of ``body`` opcodes in one frame (claiming ``frame`` bytes if given)."""
    return b"\x80\x04\x95" + struct.pack("<Q", len(body) if frame is None else frame) + body


FRAMES = {
    "whole": pickle.dumps({"a": [1, 2.5, "x" * 300], "b": (None, True)}, protocol=4),
    "many frames": pickle.dumps([list(range(50)) for _ in range(3000)], protocol=4),
    "frame past the end": _framed(b"K\x01.", frame=1000),
    "opcode running past its frame": _framed(b"J\x01\x00", frame=3)
    + b"\x00\x00.",  # C reads on; pickle's Python frame reader refused
    "short frame length": b"\x80\x04\x95\x02\x00",
}


@pytest.mark.parametrize("case", sorted(FRAMES))
def test_in_memory_pickles_read_frames_as_the_c_unpickler_does(case: str) -> None:
    """ckptkit reads a pickle in memory without pickle's frame reader (a third of a .metadata
    read): what C's unpickler (torch's DCP reader) accepts, it accepts the same, and what C refuses
    (a frame past the end), it refuses."""
    data = FRAMES[case]
    try:
        expected: object = pickle.loads(data)
    except pickle.UnpicklingError:
        expected = CheckpointFormatError
    plain = torchpickle._Unpickler  # every opcode, as .metadata's reader: pickle.load's, not weights-only
    if expected is CheckpointFormatError:
        with pytest.raises(CheckpointFormatError, match="malformed pickle"):
            torchpickle.loads(data, unpickler=plain)
    else:
        assert torchpickle.loads(data, unpickler=plain) == expected


# -- DCP output on a full disk (issue 33) ----------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Any:
    """A 1 MiB tmpfs: a real full disk, where writes fail with ENOSPC."""
    mount = tmp_path / "disk"
    mount.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or 'mount failed'}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.mark.parametrize("model_only", [False, True])
def test_dcp_output_on_a_full_disk_names_the_full_device(tmp_path: Path, small_disk: Path, model_only: bool) -> None:
    """It exited 2 blaming the checkpoint ("torch.distributed.checkpoint cannot save this checkpoint
    (RuntimeError: [enforce fail at inline_container.cc ...]); --model-only writes the weights alone"):
    torch.save inside DCP's writer hides the ENOSPC. The cause is the disk, exit 1, nothing left behind."""
    src = tmp_path / "src.pt"
    torch.save({"model": {"w": torch.ones(1 << 20), "b": torch.zeros(3)}, "epoch": 3}, src)  # 4 MiB
    dst = small_disk / "out_dcp"
    cmd = [sys.executable, "-m", "ckptkit.cli", "convert", str(src), str(dst), "--format", "dcp"]
    proc = subprocess.run(cmd + ["--model-only"] * model_only, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.splitlines() == [
        f"ckptkit: error: cannot write {dst}: no space left on the device holding {small_disk}; "
        "free space or save elsewhere"
    ]
    assert list(small_disk.iterdir()) == []


def test_dcp_output_on_a_full_disk_raises_a_write_error_from_the_library(tmp_path: Path, small_disk: Path) -> None:
    from ckptkit.errors import CheckpointWriteError

    src = tmp_path / "src.pt"
    torch.save({"w": torch.ones(1 << 20)}, src)
    with pytest.raises(CheckpointWriteError, match=f"no space left on the device holding {re.escape(str(small_disk))}"):
        convert_checkpoint(src, small_disk / "out_dcp", format="dcp")
    assert list(small_disk.iterdir()) == []


# -- verify passes exactly what read_checkpoint reads: .metadata damage --------------------------
# Each kind of damage is made on a folder torch saved, by editing its Metadata and pickling it again
# (_Built and _Called write what no dataclass pickles to: a damaged file's opcodes). verify must fail
# it and read_checkpoint refuse it, in one line; torch's own reader fails on each too, but for the
# cases ckptkit refuses rather than guess (torch would read them, dropping or inventing values).


class _Built:
    """Pickles as ``cls`` created without its ``__init__`` and given ``state`` (NEWOBJ, BUILD)."""

    def __init__(self, cls: type, state: Any) -> None:
        self.cls, self.state = cls, state

    @property  # type: ignore[misc]
    def __class__(self) -> type:  # pickle's check that NEWOBJ's class is the object's own
        return self.cls

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        import copyreg

        return (copyreg.__newobj__, (self.cls,), self.state)


class _Called:
    """Pickles as ``func(*args)`` (REDUCE)."""

    def __init__(self, func: Any, *args: Any) -> None:
        self.func, self.args = func, args

    def __reduce__(self) -> tuple[Any, ...]:
        return (self.func, self.args)


def _damage_base(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "ckpt.dcp"
    state = {
        "model": {
            "fc.weight": torch.arange(12.0).reshape(4, 3),
            "half": torch.tensor([1.5, -2.0], dtype=torch.float16),
        },
        "step": 7,
        "lst": [torch.ones(2), torch.zeros(3)],
    }
    dcp.save(state, checkpoint_id=str(folder), **SAVE_ALONE)
    return folder


def _edit_metadata(folder: Path, edit: Any) -> None:
    meta = pickle.loads((folder / ".metadata").read_bytes())  # a folder this test saved: DCP's classes only
    edit(meta)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))


def _rename(meta: Any, old: str, new: str, *, path: bool = False) -> None:
    """Key ``old`` renamed ``new`` everywhere but (unless ``path``) its planner_data path."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    meta.state_dict_metadata = {new if k == old else k: v for k, v in meta.state_dict_metadata.items()}
    meta.planner_data = {new if k == old else k: v for k, v in meta.planner_data.items()}
    meta.storage_data = {MetadataIndex(new, i.offset) if i.fqn == old else i: v for i, v in meta.storage_data.items()}
    if path:
        meta.planner_data[new] = tuple(new.split("."))


def _reindex(meta: Any, fqn: str, offset: Any) -> None:
    """``fqn``'s (first) stored item indexed by ``offset`` instead."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    index = next(i for i in meta.storage_data if i.fqn == fqn)
    meta.storage_data[MetadataIndex(fqn, offset)] = meta.storage_data.pop(index)


def _properties(*state: Any) -> Any:
    from torch.distributed.checkpoint.metadata import TensorProperties

    return _Built(TensorProperties, state)


def _code(value: Any) -> Any:
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    return _Called(_MEM_FORMAT_ENCODING, value)


def _bytes_entry(meta: Any, fqn: str) -> None:
    """``fqn``, a tensor, listed as a value (indexed as one), its bytes where its chunk's are."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    meta.state_dict_metadata[fqn] = BytesStorageMetadata()
    index = next(i for i in meta.storage_data if i.fqn == fqn)
    meta.storage_data[MetadataIndex(fqn)] = meta.storage_data.pop(index)


def _drop(meta: Any, fqn: str) -> None:
    del meta.state_dict_metadata[fqn], meta.planner_data[fqn]
    meta.storage_data = {i: v for i, v in meta.storage_data.items() if i.fqn != fqn}


def _chunk_info(meta: Any, fqn: str) -> Any:
    return next(v for i, v in meta.storage_data.items() if i.fqn == fqn)


def _move_chunk(meta: Any) -> None:
    """model.half's chunk said to start 8 bytes into its torch.save zip."""
    _chunk_info(meta, "model.half").offset += 8


def _stored_as_another_class(meta: Any) -> None:
    """model.half's _StorageInfo replaced by another DCP class holding the same fields (the fuzzer
    pointed one pickle reference at the Metadata class)."""
    from torch.distributed.checkpoint.metadata import Metadata

    index = next(i for i in meta.storage_data if i.fqn == "model.half")
    info, other = meta.storage_data[index], Metadata({})
    other.relative_path, other.offset, other.length = info.relative_path, info.offset, info.length
    meta.storage_data[index] = other


def _storage_meta_keyed_by_a_dataclass(meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    meta.storage_meta.modules = {_Built(BytesStorageMetadata, {}): 1}  # unhashable where torch unpickles it


def _chunk_fields(meta: Any) -> None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    chunk = meta.state_dict_metadata["model.half"].chunks[0]
    meta.state_dict_metadata["model.half"].chunks[0] = _Built(ChunkStorageMetadata, [chunk.offsets, chunk.sizes])


def _reads_transforms() -> bool:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return "transform_descriptors" in _StorageInfo.__dataclass_fields__  # later torch; 2.6 has none


_READS_TRANSFORMS = _reads_transforms()

# kind -> (the edit, what verify says, whether torch's own reader fails on it too)
DAMAGE: dict[str, tuple[Any, str, bool]] = {
    "a renamed path": (
        lambda m: m.planner_data.update({"model.fc.weight": ("model", "cuda:0")}),
        r"puts key 'model\.fc\.weight' at \('model', 'cuda:0'\), which torch's reader flattens back to key 'model\.cuda:0'",
        True,
    ),
    "a renamed key": (
        lambda m: _rename(m, "model.half", "modelYhalf"),
        r"puts key 'modelYhalf' at \('model', 'half'\), which torch's reader flattens back to key 'model\.half'",
        True,
    ),
    "a path holding a tuple": (
        lambda m: m.planner_data.update({"model.half": (("model", "half"), "step", "step")}),
        r"puts key 'model\.half' at \(\('model', 'half'\), 'step', 'step'\), not a path",
        True,
    ),
    "a key inside another key's value": (  # torch reads it, dropping model.fc.weight and model.half
        lambda m: _rename(m, "step", "model", path=True),
        r"puts key 'model' at \('model',\), where the keys under model already is",
        False,
    ),
    "a gap in a list": (
        lambda m: _drop(m, "lst.0"),
        r"fills list lst at \[1\] but not at 0, which torch's reader reads back as key 'lst\.0'",
        True,
    ),
    "a list of plain values": (
        lambda m: (_bytes_entry(m, "lst.0"), _bytes_entry(m, "lst.1")),
        r"puts keys lst\.0, lst\.1 in list lst of plain values only",
        True,
    ),
    "a negative size": (
        lambda m: setattr(m.state_dict_metadata["model.fc.weight"], "size", torch.Size([4, -3])),
        r"gives model\.fc\.weight's size as -3, below 0",
        True,
    ),
    "a negative chunk offset": (
        lambda m: setattr(m.state_dict_metadata["model.half"].chunks[0], "offsets", torch.Size([-1])),
        r"gives model\.half's chunk offset as -1, below 0",
        True,
    ),
    "a negative stored offset": (
        lambda m: _reindex(m, "model.fc.weight", [-2, 0]),
        r"gives model\.fc\.weight's stored chunk offset as -2, below 0",
        True,
    ),
    "a value indexed by an offset": (
        lambda m: _reindex(m, "step", []),
        r"malformed: it lists step but not where its value is stored",
        True,
    ),
    "properties of four values": (
        lambda m: setattr(
            m.state_dict_metadata["model.half"],
            "properties",
            _properties(torch.float16, torch.strided, False, _code(0)),
        ),
        r"TensorProperties hold 4 values; torch's reader unpacks 5",
        True,
    ),
    "a memory-format code that is none": (
        lambda m: setattr(
            m.state_dict_metadata["model.half"],
            "properties",
            _properties(torch.float16, torch.strided, False, _code(65535), False),
        ),
        r"memory-format code \(65535,\); torch's reader knows 0, 1 and 2",
        True,
    ),
    "a memory format that is no code": (
        lambda m: setattr(
            m.state_dict_metadata["model.half"],
            "properties",
            _properties(torch.float16, torch.strided, False, False, False),
        ),
        r"TensorProperties hold False where torch's reader expects a _MEM_FORMAT_ENCODING",
        True,
    ),
    "fields that are no dict": (
        _chunk_fields,
        r"builds a torch\.distributed\.checkpoint\.metadata\.ChunkStorageMetadata from a list",
        True,
    ),
    "a dataclass as a dict key": (
        _storage_meta_keyed_by_a_dataclass,
        r"unhashable type: 'BytesStorageMetadata'",
        True,
    ),
    "a chunk not at a torch.save zip": (
        _move_chunk,
        r"model\.half: no torch\.save zip at offset \d+ of __0_0\.distcp",
        True,
    ),
    "a chunk stored as another class": (  # torch's reader fails on it where it reads the transforms field
        _stored_as_another_class,
        r"says where model\.half is stored with a Metadata, not a _StorageInfo",
        _READS_TRANSFORMS,
    ),
    "a chunk cut short": (
        lambda m: setattr(_chunk_info(m, "model.half"), "length", 1),
        r"model\.half: no torch\.save zip at offset \d+ of __0_0\.distcp",
        True,
    ),
}


def _torch_reads(folder: Path) -> bool:
    """Whether torch's own reader loads the folder, as read_checkpoint loads it (the empty planner)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    try:
        _load_state_dict(
            {}, storage_reader=FileSystemReader(str(folder)), planner=_EmptyStateDictLoadPlanner(), no_dist=True
        )
    except (Exception, CheckpointException):  # noqa: BLE001 - any refusal counts: torch raises many kinds
        return False
    return True


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_metadata_fails_verify_as_read_checkpoint_refuses_it(tmp_path: Path, kind: str) -> None:
    edit, says, torch_fails = DAMAGE[kind]
    folder = _damage_base(tmp_path)
    _edit_metadata(folder, edit)
    report = verify_checkpoint(folder)
    failed = [f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
    assert not report.ok and any(re.search(says, f) for f in failed), failed
    with pytest.raises(CheckpointFormatError) as refused:
        read_checkpoint(folder)
    assert re.search(says, str(refused.value)) and "\n" not in str(refused.value)
    assert _torch_reads(folder) is not torch_fails


# Damage in a folder ckptkit's own parser does not model (a tensor whose dtype is None, which torch's
# reader makes its default dtype), so that verify asks torch's reader: what its load plans must hold.
BEYOND: dict[str, tuple[Any, str | None]] = {
    "no damage": (lambda m: None, None),
    "a renamed path": (
        lambda m: m.planner_data.update({"model.fc.weight": ("model", "cuda:0")}),
        r"puts key 'model\.fc\.weight' at \('model', 'cuda:0'\)",
    ),
    "a chunk not at a torch.save zip": (_move_chunk, r"model\.half: no torch\.save zip at offset"),
    "a value indexed by an offset": (
        lambda m: _reindex(m, "step", []),
        r"malformed: it lists step but not where its value is stored",
    ),
}


@pytest.mark.parametrize("kind", sorted(BEYOND))
def test_where_torch_reads_the_metadata_verify_asks_what_its_load_asks(tmp_path: Path, kind: str) -> None:
    edit, says = BEYOND[kind]
    folder = _damage_base(tmp_path)

    def untyped_then(meta: Any) -> None:
        meta.state_dict_metadata["model.half"].properties.dtype = None
        edit(meta)

    _edit_metadata(folder, untyped_then)
    with pytest.raises(NeedsTorch):
        read_metadata(folder)
    report = verify_checkpoint(folder)
    failed = [f"{c.name}: {c.detail}" for c in report.checks if not c.ok]
    if says is None:
        assert report.ok, failed
        assert read_checkpoint(folder)["model"]["half"].tolist() == [1.5, -2.0]
        return
    assert not report.ok and any(re.search(says, f) for f in failed), failed
    with pytest.raises(CheckpointFormatError, match=says):
        read_checkpoint(folder)
    assert not _torch_reads(folder)


def test_torch_s_reason_for_refusing_a_folder_is_one_line(tmp_path: Path) -> None:
    """torch's weights-only refusal runs over several lines; a CLI error is one."""
    from ckptkit.formats.dcp.torch import read_dcp

    folder = _damage_base(tmp_path)
    _edit_metadata(folder, _move_chunk)
    with pytest.raises(CheckpointFormatError) as refused:
        read_dcp(folder)  # torch's reader alone, without verify's checks first
    assert "Weights only load failed" in str(refused.value) or "UnpicklingError" in str(refused.value)
    assert "\n" not in str(refused.value)
