"""DCP folders converted torch-free, chunk by chunk (issue 12, part 3).

The committed ``fixtures/fsdp2_dcp`` was saved by FSDP2 on 2 gloo ranks
(``fixtures/make_dcp_fixtures.py``); ``fsdp2_dcp.expected.pt`` holds its full state dict.
"""

from __future__ import annotations

import itertools
import json
import math
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import ckptkit
from ckptkit.errors import CheckpointFormatError
from ckptkit.formats.dcp.stream import DcpTensor, open_dcp
from ckptkit.io.atomic import TMP_SUFFIX
from tests import not_regular
from tests.torchcompat import SAVE_ALONE
from tests.torchfree import limited_memory, run_torch_free


def _read(path: Path) -> dict[str, torch.Tensor]:
    """Read back by the format's own library: torch for .pt, safetensors for .safetensors."""
    if path.suffix == ".safetensors":
        return load_file(path)
    return torch.load(path, weights_only=True)


def _assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)  # the metadata's order, which is the model's
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _convert_in_subprocess(*args: str) -> tuple[subprocess.CompletedProcess[str], bool]:
    """``ckptkit convert ARGS --json`` in a fresh interpreter; also whether torch was imported."""
    return run_torch_free(["convert", *args, "--json"])


# fsdp2_dcp_dim1: row-parallel weights (Shard(1)) used to send the whole checkpoint through torch's loader
@pytest.mark.parametrize("folder", ["fsdp2_dcp", "fsdp2_dcp_dim1"])
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_fsdp2_folder_converts_without_torch(fixtures_dir: Path, tmp_path: Path, suffix: str, folder: str) -> None:
    out = tmp_path / f"single{suffix}"
    proc, imported_torch = _convert_in_subprocess(str(fixtures_dir / folder), str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["fast"] is True and report["fallback_reason"] == "" and report["tensors"] == 16
    assert not imported_torch
    _assert_same(_read(out), torch.load(fixtures_dir / f"{folder}.expected.pt", weights_only=True))
    assert ckptkit.verify_checkpoint(out).ok


def test_each_record_header_is_written_once_with_its_chunks_crc(
    fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tensor's CRC-32 is known before its bytes are copied (its chunks' CRCs, combined), so
    its local header is written with it: patching it in afterwards rewrote a page the disk may
    already have written back, once per tensor."""
    import os
    import zipfile

    patched: list[int] = []
    real_pwrite = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, at: patched.append(at) or real_pwrite(fd, data, at))
    out = tmp_path / "single.pt"
    ckptkit.convert_checkpoint(fixtures_dir / "fsdp2_dcp", out)
    assert patched == []
    with zipfile.ZipFile(out) as z, open(out, "rb") as f:
        assert z.testzip() is None  # every record's bytes match the CRC-32 of its central header
        for info in z.infolist():  # ... and of its local header
            f.seek(info.header_offset + 14)
            assert int.from_bytes(f.read(4), "little") == info.CRC, info.filename
    _assert_same(_read(out), torch.load(fixtures_dir / "fsdp2_dcp.expected.pt", weights_only=True))


def test_pieces_are_the_chunks_in_offset_order(fixtures_dir: Path) -> None:
    src = open_dcp(fixtures_dir / "fsdp2_dcp")
    try:
        embed = src.obj["embed.weight"]
        assert isinstance(embed, DcpTensor) and embed.shape == (37, 8)
        # 37 rows over 2 ranks: 19 then 18, each float32 row 32 bytes
        assert [(p.file, p.length) for p in embed.pieces] == [("__0_0.distcp", 19 * 32), ("__1_0.distcp", 18 * 32)]
    finally:
        src.close()


def _flip_payload_bit(folder: Path, fqn: str, piece: int) -> None:
    src = open_dcp(folder)
    try:
        p = src.obj[fqn].pieces[piece]
    finally:
        src.close()
    with open(folder / p.file, "r+b") as f:
        f.seek(p.offset + p.length // 2)
        byte = f.read(1)[0]
        f.seek(p.offset + p.length // 2)
        f.write(bytes([byte ^ 0x10]))


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_damaged_chunk_fails_naming_the_tensor_and_writes_nothing(
    fixtures_dir: Path, tmp_path: Path, suffix: str
) -> None:
    folder = tmp_path / "ckpt.dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp", folder)
    _flip_payload_bit(folder, "mlp.0.weight", 1)
    out = tmp_path / f"single{suffix}"
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", "convert", str(folder), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "tensor mlp.0.weight (chunk at [7, 0] in __1_0.distcp)" in proc.stderr and "damaged" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.dcp"]  # no output, no temp file


def _rewrite_metadata(folder: Path, edit: object) -> None:
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own copy of a committed folder: DCP's classes only
    edit(meta)  # type: ignore[operator]
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)


@pytest.mark.parametrize(
    ("row", "message"), [(18, "overlap at row 18"), (20, r"is \[37, 8\] but has a chunk of \[18, 8\] at \[20, 0\]")]
)
def test_chunks_that_do_not_tile_are_an_error_naming_the_key(
    fixtures_dir: Path, tmp_path: Path, row: int, message: str
) -> None:
    folder = tmp_path / "ckpt.dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp", folder)

    def move_second_chunk(meta: object) -> None:
        md = meta.state_dict_metadata["head.weight"]  # type: ignore[attr-defined]
        chunk = md.chunks[1]
        index = next(i for i in meta.storage_data if i.fqn == "head.weight" and list(i.offset) == [19, 0])  # type: ignore[attr-defined]
        info = meta.storage_data.pop(index)  # type: ignore[attr-defined]
        chunk.offsets = torch.Size([row, 0])
        meta.storage_data[type(index)("head.weight", [row, 0])] = info  # type: ignore[attr-defined]

    _rewrite_metadata(folder, move_second_chunk)
    with pytest.raises(CheckpointFormatError, match=rf"tensor head\.weight .*{message}"):
        ckptkit.convert_checkpoint(folder, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def _grid_entry(shape: tuple[int, ...], cuts: list[list[int]]) -> Any:
    """A tensor entry whose chunks are the boxes of a grid: ``cuts[d]`` are dim d's split points."""
    from ckptkit.formats.dcp.meta import Chunk, Stored, TensorEntry

    bounds = [[0, *c, n] for c, n in zip(cuts, shape, strict=True)]
    chunks = [
        Chunk(
            tuple(b[i] for b, i in zip(bounds, at, strict=True)),
            tuple(b[i + 1] - b[i] for b, i in zip(bounds, at, strict=True)),
            Stored("x", 0, 1),
        )
        for at in itertools.product(*(range(len(b) - 1) for b in bounds))
    ]
    return TensorEntry("t", "float32", shape, tuple(reversed(chunks)))  # metadata order is not offset order


@given(data=st.data())
@settings(max_examples=200, derandomize=True, deadline=None)
def test_any_grid_of_chunks_reassembles_in_row_major_order(data: st.DataObject) -> None:
    """2-D and 3-D meshes, uneven last chunks: the stretches rebuild the tensor exactly."""
    from ckptkit.formats.dcp.meta import chunks_in_order

    shape = tuple(data.draw(st.lists(st.integers(1, 7), min_size=1, max_size=4)))
    cuts = [sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=3))) if n > 1 else [] for n in shape]
    entry = _grid_entry(shape, cuts)
    chunks, tiling = chunks_in_order(Path("f"), entry)
    whole = torch.arange(math.prod(shape)).reshape(shape)
    assert torch.equal(_rebuilt(chunks, tiling, whole), whole.reshape(-1))


def _rebuilt(chunks: list[Any], tiling: Any, whole: torch.Tensor) -> torch.Tensor:
    """The tensor as a reader rebuilds it from ``whole``'s chunks, by :func:`chunks_in_order`'s answer."""
    parts = [whole[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))].reshape(-1) for c in chunks]
    if tiling is None:
        return torch.cat(parts) if parts else whole.reshape(-1)[:0]
    rows = []
    for g in tiling.groups:
        assert g.row == len(rows)  # groups follow one another
        for r in range(g.rows):
            rows.append(
                torch.cat([parts[k][first + r * width : first + (r + 1) * width] for k, first, width in g.parts])
            )
    return torch.cat(rows)


@st.composite
def _boxes(draw: st.DrawFn) -> tuple[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """A shape and boxes that tile it, not always as a grid (each box cut in two along any dim,
    again and again), then sometimes spoiled: a box dropped, moved, grown or shrunk, or doubled."""
    shape = tuple(draw(st.lists(st.integers(1, 6), min_size=1, max_size=4)))
    boxes = [((0,) * len(shape), shape)]
    for _ in range(draw(st.integers(0, 8))):
        i = draw(st.integers(0, len(boxes) - 1))
        (at, size), d = boxes[i], draw(st.integers(0, len(shape) - 1))
        if size[d] < 2:
            continue
        cut = draw(st.integers(1, size[d] - 1))
        boxes[i : i + 1] = [
            (at, size[:d] + (cut,) + size[d + 1 :]),
            (at[:d] + (at[d] + cut,) + at[d + 1 :], size[:d] + (size[d] - cut,) + size[d + 1 :]),
        ]
    spoil = draw(st.sampled_from(["none", "none", "drop", "move", "resize", "double"]))
    i, d = draw(st.integers(0, len(boxes) - 1)), draw(st.integers(0, len(shape) - 1))
    at, size = boxes[i]
    if spoil == "drop" and len(boxes) > 1:
        del boxes[i]
    elif spoil == "move":
        boxes[i] = (at[:d] + (max(0, at[d] + draw(st.sampled_from([-1, 1]))),) + at[d + 1 :], size)
    elif spoil == "resize":
        boxes[i] = (at, size[:d] + (size[d] + draw(st.sampled_from([-1, 1])),) + size[d + 1 :])
    elif spoil == "double":
        boxes.append(boxes[i])
    return shape, draw(st.permutations(boxes))


@given(case=_boxes())
@settings(max_examples=600, derandomize=True, deadline=None)
def test_any_boxes_are_refused_unless_they_cover_each_element_once(case: Any) -> None:
    """Against counting each element's chunks: chunks_in_order refuses exactly the layouts that
    miss or repeat an element or leave the tensor, and what it accepts rebuilds the tensor."""
    from ckptkit.formats.dcp.meta import Chunk, Stored, TensorEntry, chunks_in_order

    shape, boxes = case
    entry = TensorEntry("t", "float32", shape, tuple(Chunk(at, size, Stored("x", 0, 1)) for at, size in boxes))
    count = torch.zeros(shape, dtype=torch.int64)
    inside = all(o + n <= d for at, size in boxes for o, n, d in zip(at, size, shape, strict=True))
    for at, size in boxes if inside else []:
        count[tuple(slice(o, o + n) for o, n in zip(at, size, strict=True))] += 1
    if not inside or not bool((count == 1).all()):
        with pytest.raises(
            CheckpointFormatError, match="each (element|row) must be in exactly one chunk|has a chunk of"
        ):
            chunks_in_order(Path("f"), entry)
        return
    whole = torch.arange(math.prod(shape)).reshape(shape)
    assert torch.equal(_rebuilt(*chunks_in_order(Path("f"), entry), whole), whole.reshape(-1))


@given(
    case=_boxes(), band=st.sampled_from([1, 8, 24, 100, 1 << 20]), dtype=st.sampled_from([torch.float32, torch.int8])
)
@settings(max_examples=300, derandomize=True, deadline=None)
def test_a_copy_through_any_tiling_and_band_gives_the_tensor_and_its_crc(
    case: Any, band: int, dtype: torch.dtype, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The chunks' bytes laid one after another in a file, as .distcp files hold them: the copy
    writes the whole tensor's bytes in order and its CRC-32, bands of any size (a row wider than
    a band, rows cut, a band of many rows), and finds each chunk's bytes as they were."""
    import io
    import zlib

    from ckptkit.formats.dcp import stream
    from ckptkit.formats.dcp.meta import Chunk, Stored, TensorEntry, chunks_in_order

    shape, boxes = case
    entry = TensorEntry("t", "float32", shape, tuple(Chunk(at, size, Stored("x", 0, 1)) for at, size in boxes))
    try:
        chunks, tiling = chunks_in_order(Path("f"), entry)
    except CheckpointFormatError:
        return  # a spoiled layout: the test above
    whole = (torch.arange(math.prod(shape)) * 7).to(dtype).reshape(shape)
    folder = tmp_path_factory.mktemp("tiling")
    pieces, at, blob = [], 0, bytearray()
    for c in chunks:
        data = whole[tuple(slice(o, o + n) for o, n in zip(c.offsets, c.sizes, strict=True))].contiguous()
        raw = data.reshape(-1).view(torch.uint8).numpy().tobytes()
        blob += raw
        pieces.append(stream.Piece("x", at, len(raw), zlib.crc32(raw), f"chunk at {list(c.offsets)}"))
        at += len(raw)
    (folder / "x").write_bytes(bytes(blob))
    src = stream.DcpSource(folder, {})
    src.files["x"] = open(folder / "x", "rb")  # noqa: SIM115 - closed by src.close
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stream, "BAND", band)
        t = DcpTensor("t", str(dtype).removeprefix("torch."), shape, lambda: (tuple(pieces), tiling), src)
        out = io.BytesIO()
        crc = src.copy(t, out)
    src.close()
    src.damage.raise_if_any()
    want = whole.reshape(-1).view(torch.uint8).numpy().tobytes()
    assert out.getvalue() == want and crc == zlib.crc32(want)


def test_chunks_that_overlap_or_leave_a_gap_in_a_grid_are_refused() -> None:
    from dataclasses import replace

    from ckptkit.formats.dcp.meta import chunks_in_order

    entry = _grid_entry((4, 6), [[2], [3]])
    moved = replace(entry, chunks=(replace(entry.chunks[0], offsets=(2, 2)), *entry.chunks[1:]))
    with pytest.raises(CheckpointFormatError, match="overlap at element"):
        chunks_in_order(Path("f"), moved)
    with pytest.raises(CheckpointFormatError, match=r"leave elements 15\.\.17 uncovered"):  # the box at [2, 3]
        chunks_in_order(Path("f"), replace(entry, chunks=entry.chunks[1:]))
    with pytest.raises(
        CheckpointFormatError, match=r"leave elements 21\.\.23 uncovered"
    ):  # the box at [2, 3], cut short
        short = replace(entry.chunks[0], sizes=(1, 3))
        chunks_in_order(Path("f"), replace(entry, chunks=(short, *entry.chunks[1:])))


def _save(tmp_path: Path, state: dict[str, object]) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "single.dcp"
    dcp.save(state, checkpoint_id=str(folder), **SAVE_ALONE)
    return folder


def _nested_state() -> dict[str, object]:
    torch.manual_seed(0)
    model = {
        "module.fc.weight": torch.randn(5, 3),
        "module.fc.bias": torch.randn(5),
        "module.emb.weight": torch.randn(7, 2).to(torch.bfloat16),
        "module.steps": torch.tensor(3),
    }
    return {"model": model, "epoch": 4, "optim": {"param_groups": [{"lr": 0.1, "params": [0, 1]}], "note": "x"}}


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (_nested_state, ""),  # nested dicts, lists, plain values and a 0-d tensor: all modelled
        (
            lambda: {"w": torch.randn(3, 4).t(), "b": torch.ones(2)},
            "tensor w's chunk at [0, 0] in __0_0.distcp is not contiguous",
        ),
        (lambda: {"model": {"w": torch.ones(2)}, "size": torch.Size([2, 3])}, ""),
        (lambda: {"model": {"w": torch.ones(2)}, "dtype": torch.float16, "lists": [[torch.zeros(1)], {"a": [1]}]}, ""),
        (lambda: {"model": {"w": torch.ones(2)}, "pair": (torch.ones(1), 2)}, "value pair holds tensors"),
    ],
    ids=["nested", "transposed", "size", "dtype-and-lists", "tensor-in-tuple"],
)
def test_stream_and_torch_give_the_same_checkpoint(tmp_path: Path, state: object, reason: str) -> None:
    folder = _save(tmp_path, state())  # type: ignore[operator]
    streamed = ckptkit.convert_checkpoint(folder, tmp_path / "streamed.pt")
    loaded = ckptkit.convert_checkpoint(folder, tmp_path / "loaded.pt", trust=True)  # always torch
    assert not loaded.fast
    assert streamed.fast is (reason == "") and streamed.fallback_reason == (
        f"{reason}: loaded with torch" if reason else ""
    )
    a = torch.load(tmp_path / "streamed.pt", weights_only=True)
    b = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert _flat(a) == _flat(b)


def _flat(node: object, where: str = "") -> list[tuple[str, object]]:
    """Every leaf with its path, in order; tensors as (dtype, shape, values) for an exact compare."""
    if isinstance(node, dict):
        return [x for k, v in node.items() for x in _flat(v, f"{where}/{k}")]
    if isinstance(node, list):
        return [x for i, v in enumerate(node) for x in _flat(v, f"{where}[{i}]")]
    if isinstance(node, torch.Tensor):
        return [(where, (node.dtype, tuple(node.shape), node.reshape(-1).contiguous().view(torch.uint8).tolist()))]
    return [(where, node)]


def test_renamed_like_any_convert(tmp_path: Path) -> None:
    folder = _save(tmp_path, _nested_state())
    report = ckptkit.convert_checkpoint(folder, tmp_path / "w.safetensors", model_only=True)
    assert report.fast and report.weights_at == "model" and report.renamed == 4
    got = load_file(tmp_path / "w.safetensors")
    expected = {k.removeprefix("module."): v for k, v in _nested_state()["model"].items()}  # type: ignore[attr-defined]
    _assert_same(got, expected)
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(TMP_SUFFIX)]


def test_inspect_reads_the_metadata_without_torch(fixtures_dir: Path) -> None:
    script = (
        "import json, sys\n"
        "from ckptkit import inspect_checkpoint\n"
        f"s = inspect_checkpoint({str(fixtures_dir / 'fsdp2_dcp')!r})\n"
        "print(json.dumps([s.loaded_with_torch, [[t.name, t.shape, t.dtype, t.nbytes] for t in s.tensors][:2], len(s.tensors)]))\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    summary, imported_torch = proc.stdout.splitlines()
    assert json.loads(summary) == [
        False,
        [["embed.weight", [37, 8], "float32", 37 * 8 * 4], ["ln1.weight", [8], "float32", 32]],
        16,
    ]
    assert imported_torch == "False"
    assert not ckptkit.inspect_checkpoint(fixtures_dir / "fsdp2_dcp_dim1").loaded_with_torch  # dim 1 too


def test_fsdp2_folder_into_hugging_face_shards_without_torch(fixtures_dir: Path, tmp_path: Path) -> None:
    """DCP in, Hugging Face shards out: chunk by chunk, read back by huggingface_hub."""
    from huggingface_hub import load_torch_model

    out = tmp_path / "hf"
    proc, imported_torch = _convert_in_subprocess(str(fixtures_dir / "fsdp2_dcp"), f"{out}/", "--max-shard-size", "300")
    assert proc.returncode == 0, proc.stderr
    assert not imported_torch and json.loads(proc.stdout)["fast"]
    assert (out / "model.safetensors.index.json").exists() and len(list(out.glob("*.safetensors"))) > 1
    expected = torch.load(fixtures_dir / "fsdp2_dcp.expected.pt", weights_only=True)
    got: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        got |= load_file(shard)
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], v) for k, v in expected.items())

    from fixtures.make_dcp_fixtures import TinyGPT

    model = TinyGPT()
    load_torch_model(model, out, strict=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_metadata_naming_a_dotted_attribute_of_a_dcp_module_is_refused(tmp_path: Path, command: str) -> None:
    """STACK_GLOBAL ("torch.distributed.checkpoint.metadata", "os.system") is os.system: only
    DCP's exact class names are safe, not everything under its modules' names."""
    folder, marker = tmp_path / "evil.dcp", tmp_path / "ran"
    folder.mkdir()
    module, name, arg = b"torch.distributed.checkpoint.metadata", b"os.system", f"touch {marker}".encode()
    (folder / ".metadata").write_bytes(
        b"\x80\x04"
        + pickle.SHORT_BINUNICODE
        + bytes([len(module)])
        + module
        + pickle.SHORT_BINUNICODE
        + bytes([len(name)])
        + name
        + pickle.STACK_GLOBAL
        + pickle.SHORT_BINUNICODE
        + bytes([len(arg)])
        + arg
        + pickle.TUPLE1
        + pickle.REDUCE
        + pickle.STOP
    )
    args = [command, str(folder)] + ([str(tmp_path / "out.pt")] if command == "convert" else [])
    proc = subprocess.run([sys.executable, "-m", "ckptkit.cli", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and not marker.exists()
    assert (
        "torch.distributed.checkpoint.metadata.os.system" in proc.stdout + proc.stderr
        and "Traceback" not in proc.stderr
    )


@pytest.mark.parametrize("command", ["inspect", "verify", "convert", "read"])
def test_a_planner_data_index_beyond_the_entries_is_refused_before_any_reader_allocates(
    fixtures_dir: Path, tmp_path: Path, command: str
) -> None:
    """planner_data ('embed.weight', 10**14) made ckptkit's reader and torch's allocate a list that
    long from a 60-byte .metadata field: a MemoryError traceback, or the machine's memory."""
    folder = tmp_path / "big.dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp", folder)
    meta = pickle.loads((folder / ".metadata").read_bytes())  # the fixture's own, written by DCP
    meta.planner_data["embed.weight"] = ("embed.weight", 10**14)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    args = {
        "convert": ["convert", str(folder), str(tmp_path / "o.pt")],
        "read": [],
        "verify": ["verify", str(folder), "--json"],
    }.get(command, [command, str(folder)])
    cmd = (
        [sys.executable, "-m", "ckptkit.cli", *args]
        if args
        else [sys.executable, "-c", f"import ckptkit; ckptkit.read_checkpoint({str(folder)!r})"]
    )
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, preexec_fn=limited_memory)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert (
        "planner_data path ['embed.weight', 100000000000000] has list index 100000000000000, beyond the folder's 16 entries"
        in (proc.stdout + proc.stderr)
    )
    assert "MemoryError" not in proc.stderr and (command == "read" or "Traceback" not in proc.stderr)


def test_verify_checks_every_chunk_against_its_crc(fixtures_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "flip.dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp", folder)
    src = open_dcp(folder)
    piece = src.obj["qkv.weight"].pieces[1]
    src.close()
    data = bytearray((folder / piece.file).read_bytes())
    data[piece.offset + 3] ^= 0x10
    (folder / piece.file).write_bytes(bytes(data))
    report = ckptkit.verify_checkpoint(folder)
    failed = [c for c in report.checks if not c.ok]
    assert [c.name for c in failed] == ["CRC-32 of every chunk"]
    assert f"qkv.weight ({piece.where})" in failed[0].detail
    assert ckptkit.verify_checkpoint(fixtures_dir / "fsdp2_dcp").ok


@pytest.mark.parametrize("field, value", [("offset", -5), ("length", 0)])
def test_a_chunk_at_a_negative_offset_or_of_no_length_fails_verify_as_the_reader_fails(
    tmp_path: Path, field: str, value: int
) -> None:
    import torch.distributed.checkpoint as dcp
    from click.testing import CliRunner

    from ckptkit.cli import main

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(6.0), "b": torch.ones(2)}, checkpoint_id=folder, **SAVE_ALONE)
    meta = pickle.loads((folder / ".metadata").read_bytes())
    index = next(i for i in meta.storage_data if i.fqn == "w")
    setattr(meta.storage_data[index], field, value)
    (folder / ".metadata").write_bytes(pickle.dumps(meta))
    report = ckptkit.verify_checkpoint(folder)
    assert not report.ok, report.checks
    with pytest.raises(ckptkit.errors.CheckpointFormatError):
        ckptkit.read_checkpoint(folder)
    result = CliRunner().invoke(main, ["convert", str(folder), str(tmp_path / "out.safetensors")])
    assert result.exit_code == 1 and not (tmp_path / "out.safetensors").exists(), result.output


def _save_on_a_2x2_mesh(rank: int, world: int, folder: str) -> None:
    """Weights laid out as 2-D parallelism lays them: a 2x2 mesh, each weight sharded along both
    dims (Shard(0) x Shard(1), uneven edges), a bias along dim 0 only, one replicated."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2, 2))
    full = _mesh_weights()
    state = {
        "attn.o_proj.weight": distribute_tensor(full["attn.o_proj.weight"], mesh, [Shard(0), Shard(1)]),
        "mlp.down_proj.weight": distribute_tensor(full["mlp.down_proj.weight"], mesh, [Shard(1), Shard(0)]),
        "mlp.down_proj.bias": distribute_tensor(full["mlp.down_proj.bias"], mesh, [Shard(0), Replicate()]),
        "norm.weight": distribute_tensor(full["norm.weight"], mesh, [Replicate(), Replicate()]),
    }
    dcp.save(state, checkpoint_id=folder)


def _mesh_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "attn.o_proj.weight": torch.randn(7, 9, generator=g),
        "mlp.down_proj.weight": torch.randn(6, 11, generator=g).to(torch.bfloat16),
        "mlp.down_proj.bias": torch.randn(5, generator=g),
        "norm.weight": torch.randn(3, generator=g),
    }


@pytest.mark.slow
@pytest.mark.parametrize("suffix", [".safetensors", ".pt", "/"])
def test_a_2d_mesh_checkpoint_converts_exactly_without_torch(tmp_path: Path, suffix: str) -> None:
    from tests.group import ok_values, run_group

    folder = tmp_path / "mesh.dcp"
    ok_values(run_group(_save_on_a_2x2_mesh, 4, tmp_path, str(folder), timeout=120))
    out = tmp_path / ("out" + suffix if suffix != "/" else "hf")
    proc, imported_torch = _convert_in_subprocess(str(folder), str(out) + ("/" if suffix == "/" else ""))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["fast"] is True and not imported_torch, report
    got, want = ckptkit.read_checkpoint(out), _mesh_weights()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert ckptkit.verify_checkpoint(out).ok


@pytest.mark.parametrize("band", [8 << 20, 16, 100])  # whole bands; stretches beyond a band; bands that cut stretches
def test_interleaved_chunks_copy_exactly_in_any_band(
    fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, band: int
) -> None:
    from ckptkit.formats.dcp import stream

    monkeypatch.setattr(stream, "BAND", band)
    ckptkit.convert_checkpoint(fixtures_dir / "fsdp2_dcp_dim1", tmp_path / "out.safetensors")
    _assert_same(
        _read(tmp_path / "out.safetensors"), torch.load(fixtures_dir / "fsdp2_dcp_dim1.expected.pt", weights_only=True)
    )


@pytest.mark.parametrize("band", [1 << 20, 100])  # rows read as one run; rows read into place, their run CRC'd apart
def test_a_flipped_bit_in_an_interleaved_chunk_fails_convert_naming_it(
    fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, band: int
) -> None:
    from ckptkit.formats.dcp import stream
    from ckptkit.formats.dcp.stream import open_dcp

    monkeypatch.setattr(stream, "BAND", band)

    folder = tmp_path / "dim1.dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp_dim1", folder)
    src = open_dcp(folder)
    weight = src.obj["mlp"]["0"]["weight"] if "mlp" in src.obj else src.obj["mlp.0.weight"]
    assert weight.tiling is not None
    piece = weight.pieces[1]
    src.close()
    data = bytearray((folder / piece.file).read_bytes())
    data[piece.offset + 5] ^= 0x10
    (folder / piece.file).write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=r"mlp\.0\.weight"):
        ckptkit.convert_checkpoint(folder, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("how", list(not_regular.FOUND))
def test_a_shard_that_is_not_a_regular_file_is_refused_in_one_line(
    fixtures_dir: Path, tmp_path: Path, how: str
) -> None:
    """A FIFO blocked every reader; a folder, a symlink loop or a dangling symlink raised a bare OSError."""
    folder = tmp_path / "dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp", folder)
    not_regular.replace(folder / "__0_0.distcp", how)
    not_regular.assert_refused_everywhere(folder, folder / "__0_0.distcp", how, tmp_path / "out.safetensors")


def test_a_model_only_copy_reads_no_optimizer_chunk_and_names_what_it_left_unchecked(tmp_path: Path) -> None:
    """torchtitan's folder: the model's weights beside AdamW's moments. A model-only copy never
    reads the optimizer's chunks (a flipped bit there goes unseen, and the report says which
    tensors went unchecked); a copy that keeps them reads them, and fails on it."""
    from tests.formats.test_producers import TITAN

    folder = tmp_path / "step-2"
    shutil.copytree(TITAN, folder)
    src = open_dcp(folder)
    moment = src.obj["optimizer"]["state.output.weight.exp_avg"]
    piece = moment.pieces[0]
    src.close()
    data = bytearray((folder / piece.file).read_bytes())
    data[piece.offset + 1] ^= 0x08
    (folder / piece.file).write_bytes(bytes(data))
    report = ckptkit.convert_checkpoint(folder, tmp_path / "w.safetensors", model_only=True)
    assert report.fast and moment.fqn in report.unread and "train_state.step" in report.unread
    assert not [n for n in report.unread if not n.startswith(("optimizer.", "train_state."))]  # the weights were read
    assert any(f"{len(report.unread)} source record(s) not written were not read" in n for n in report.notes)
    with pytest.raises(CheckpointFormatError, match=r"state\.output\.weight\.exp_avg"):
        ckptkit.convert_checkpoint(folder, tmp_path / "all.pt")


def test_a_band_of_narrow_rows_holds_no_object_per_row(tmp_path: Path) -> None:
    """An int8 [4M, 2] tensor split along dim 1 (one byte of each row per chunk): a band of a
    million rows once held a slice object per row per chunk (+169 MiB at this size); now its
    Python allocations stay near the band and one chunk's read."""
    import io
    import tracemalloc
    import zlib

    from ckptkit.formats.dcp import stream
    from ckptkit.formats.dcp.meta import Chunk, Stored, TensorEntry, chunks_in_order

    rows = 4 << 20
    whole = torch.arange(rows * 2, dtype=torch.int64).remainder(251).to(torch.int8).reshape(rows, 2)
    boxes = [((0, 0), (rows, 1)), ((0, 1), (rows, 1))]
    entry = TensorEntry("t", "int8", (rows, 2), tuple(Chunk(at, size, Stored("x", 0, 1)) for at, size in boxes))
    chunks, tiling = chunks_in_order(Path("f"), entry)
    blob, pieces = bytearray(), []
    for c in chunks:
        raw = whole[:, c.offsets[1]].contiguous().numpy().tobytes()
        pieces.append(stream.Piece("x", len(blob), len(raw), zlib.crc32(raw), "chunk"))
        blob += raw
    (tmp_path / "x").write_bytes(bytes(blob))
    del blob
    src = stream.DcpSource(tmp_path, {})
    src.files["x"] = open(tmp_path / "x", "rb")  # noqa: SIM115 - closed by src.close
    t = DcpTensor("t", "int8", (rows, 2), lambda: (tuple(pieces), tiling), src)
    out = io.BytesIO(bytearray(rows * 2))
    out.seek(0)
    tracemalloc.start()
    try:
        crc = src.copy(t, out)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        src.close()
    src.damage.raise_if_any()
    want = whole.reshape(-1).numpy().tobytes()
    assert out.getvalue() == want and crc == zlib.crc32(want)
    assert peak < 8 * stream.BAND, (
        peak
    )  # a few band-sized buffers (reads, the band, a strided column): no per-row objects


def test_convert_reads_each_chunk_header_once(
    fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check before the copy and the copy share one opening of the folder: every chunk's zip
    header was read twice (once to check, once to copy), twice the metadata work of a large run."""
    from ckptkit.formats.dcp import stream

    found: list[str] = []
    real = stream._pieces
    monkeypatch.setattr(stream, "_pieces", lambda src, e, seen: found.append(e.fqn) or real(src, e, seen))
    ckptkit.convert_checkpoint(fixtures_dir / "fsdp2_dcp_dim1", tmp_path / "out.safetensors")
    assert found and sorted(found) == sorted(set(found))
    _assert_same(
        _read(tmp_path / "out.safetensors"), torch.load(fixtures_dir / "fsdp2_dcp_dim1.expected.pt", weights_only=True)
    )
