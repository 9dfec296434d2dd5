"""``convert --workers N``: shards written by several processes give the folder one process writes.

Every test here spawns worker processes: marked slow.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.errors import ArgumentError, CheckpointFormatError, CheckpointWriteError
from ckptkit.formats.dcp.stream import open_dcp
from ckptkit.formats.spec import Part
from ckptkit.io.atomic import TMP_SUFFIX
from ckptkit.ops.workers import Workers
from tests.cli.test_cli import run
from tests.ops.test_adapter import ADAPTER, BASE

pytestmark = pytest.mark.slow


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _report(report: Any) -> dict[str, Any]:
    return {k: v for k, v in report.to_dict().items() if k != "destination"}


def _one_and_many(src: Path, one: Path, many: Path, workers: int, **options: Any) -> tuple[Any, Any]:
    """The same convert by one process and by ``workers``; every worker's bytes reach the
    caller's progress, against one total."""
    told: dict[Path, list[tuple[int, int]]] = {one: [], many: []}
    reports = [
        ckptkit.convert_checkpoint(
            src, out, workers=n, progress=lambda got, total, out=out: told[out].append((got, total)), **options
        )
        for out, n in ((one, 1), (many, workers))
    ]
    done = {k: (sum(n for n, _ in v), {t for _, t in v}) for k, v in told.items()}
    assert done[many] == done[one]
    return reports[0], reports[1]


@pytest.mark.parametrize(
    ("source", "options"),
    [
        ("fsdp2_dcp_dim1", {}),  # chunks split along dim 1: assembled in memory, band by band
        ("fsdp2_dcp", {"dtype": "bf16"}),  # cast as copied: each worker's casts in the report
        ("ddp.pt", {"to": "ddp"}),
        ("hf/safetensors", {"model_only": True}),
        ("merge", {}),  # an adapter merged in: each worker merges its share
        ("hf-llama", {}),  # torchtitan's Llama for transformers: rows permuted by each worker, config.json once
    ],
)
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_write_the_folder_and_report_one_process_writes(
    fixtures_dir: Path, tmp_path: Path, source: str, options: dict[str, Any], workers: int
) -> None:
    if source == "merge":
        src, options = BASE, {"merge_adapter": ADAPTER}
    elif source == "hf-llama":
        config = tmp_path / "config.json"
        config.write_text('{"num_attention_heads": 2}')
        src, options = fixtures_dir / "frameworks" / "torchtitan" / "step-2", {"hf_llama": config}
    else:
        src = fixtures_dir / source
    one, many = _one_and_many(src, tmp_path / "one", tmp_path / "many", workers, max_shard_size="600", **options)
    assert one.shards >= 2  # the other workers had shares
    assert _files(tmp_path / "many") == _files(tmp_path / "one")
    assert _report(many) == _report(one)
    assert not [p for p in tmp_path.iterdir() if TMP_SUFFIX in p.name]


@pytest.mark.parametrize(
    ("source", "options"),
    [
        ("fsdp2_dcp_dim1", {}),  # chunks split along dim 1: each process assembles its tensors' bands
        ("train_ckpt.pt", {"to": "keep"}),  # optimizer state and plain values: the first file holds those
        ("fsdp2_dcp", {"dtype": "bf16"}),  # cast as copied: each worker's casts in the report
    ],
)
@pytest.mark.parametrize("workers", [2, 3])
def test_workers_split_a_dcp_folders_tensors_among_their_distcp_files(
    fixtures_dir: Path, tmp_path: Path, source: str, options: dict[str, Any], workers: int
) -> None:
    """One ``.distcp`` per process, named as DCP names ranks' files; the same state dict through
    torch's own reader as the one-process folder, bit for bit, and the same report and progress."""
    import pickle

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.formats.test_dcp_write import _same

    src = fixtures_dir / source
    one, many = _one_and_many(src, tmp_path / "one.dcp", tmp_path / "many.dcp", workers, format="dcp", **options)
    assert many.fast and {**_report(many), "bytes": 0} == {**_report(one), "bytes": 0}  # .metadata names each file
    distcp = [f"__{i}_0.distcp" for i in range(workers)]
    assert sorted(p.name for p in (tmp_path / "many.dcp").iterdir()) == [".metadata", *distcp]
    meta = pickle.loads((tmp_path / "many.dcp" / ".metadata").read_bytes())
    tensors = {k for k, v in meta.state_dict_metadata.items() if hasattr(v, "chunks")}
    used = {info.relative_path for index, info in meta.storage_data.items() if index.fqn in tensors}
    assert used == set(distcp)  # every process wrote tensors
    others = {info.relative_path for index, info in meta.storage_data.items() if index.fqn not in tensors}
    assert others <= {distcp[0]}  # plain values with the first, as DCP's rank 0 writes them
    assert (
        meta.state_dict_metadata == pickle.loads((tmp_path / "one.dcp" / ".metadata").read_bytes()).state_dict_metadata
    )
    for name in ("one", "many"):
        dcp_to_torch_save(tmp_path / f"{name}.dcp", tmp_path / f"{name}.pt")
    assert _same(
        torch.load(tmp_path / "many.pt", weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
    )
    assert ckptkit.verify_checkpoint(tmp_path / "many.dcp").ok
    assert not [p for p in tmp_path.iterdir() if TMP_SUFFIX in p.name]


def test_every_distcp_file_holds_bytes_however_many_tensors_are_empty(tmp_path: Path) -> None:
    # Found in review: empty tensors counted towards the files, and --workers 3 wrote an empty __2_0.distcp.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from tests.formats.test_dcp_write import _same

    state = {"model": {"a": torch.arange(4.0), "b": torch.empty(0), "c": torch.empty(0, 3), "d": torch.ones(3)}}
    torch.save({**state, "step": 3}, tmp_path / "src.pt")
    for name, workers in (("one", 1), ("many", 3)):
        ckptkit.convert_checkpoint(
            tmp_path / "src.pt", tmp_path / f"{name}.dcp", format="dcp", to="keep", workers=workers
        )
        dcp_to_torch_save(tmp_path / f"{name}.dcp", tmp_path / f"{name}.pt")
    files = sorted((tmp_path / "many.dcp").iterdir())
    assert [p.name for p in files] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert all(p.stat().st_size for p in files)
    assert _same(
        torch.load(tmp_path / "many.pt", weights_only=True), torch.load(tmp_path / "one.pt", weights_only=True)
    )


def test_damage_in_a_workers_distcp_share_fails_the_convert_naming_worker_and_tensor(
    fixtures_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "dim1.dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp_dim1", folder)
    ckptkit.convert_checkpoint(folder, tmp_path / "probe.dcp", format="dcp", workers=2)
    probe = open_dcp(tmp_path / "probe.dcp")  # which tensor the worker writes
    theirs = next(t for t in probe.obj.values() if not isinstance(t, dict) and t.pieces[0].file == "__1_0.distcp")
    probe.close()
    src = open_dcp(folder)
    piece = src.obj[theirs.fqn].pieces[0]
    src.close()
    data = bytearray((folder / piece.file).read_bytes())
    data[piece.offset + 3] ^= 0x40
    (folder / piece.file).write_bytes(bytes(data))
    name = theirs.fqn.replace(".", "[.]")
    with pytest.raises(CheckpointFormatError, match=rf"worker 1 of 2 \(file __1_0.distcp\): .*{name}.*damaged"):
        ckptkit.convert_checkpoint(folder, tmp_path / "out.dcp", format="dcp", workers=2)
    assert not (tmp_path / "out.dcp").exists() and not [p for p in tmp_path.iterdir() if TMP_SUFFIX in p.name]


def test_damage_in_a_workers_share_fails_the_convert_naming_worker_and_tensor(
    fixtures_dir: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "dim1.dcp"
    shutil.copytree(fixtures_dir / "fsdp2_dcp_dim1", folder)
    src = open_dcp(folder)
    last = list(src.obj)[-1]
    piece = src.obj[last].pieces[0] if not isinstance(src.obj[last], dict) else None
    src.close()
    assert piece is not None
    data = bytearray((folder / piece.file).read_bytes())
    data[piece.offset + 3] ^= 0x40
    (folder / piece.file).write_bytes(bytes(data))
    one = tmp_path / "probe"  # which share holds the damaged tensor: the one-process convert names it
    with pytest.raises(CheckpointFormatError, match=last.replace(".", r"\.")):
        ckptkit.convert_checkpoint(folder, one, max_shard_size="1KB")
    with pytest.raises(CheckpointFormatError, match=rf"worker \d of 4 \(shard.*{last.replace('.', r'[.]')}") as e:
        ckptkit.convert_checkpoint(folder, tmp_path / "hf", max_shard_size="1KB", workers=4)
    assert "damaged" in str(e.value)
    assert not (tmp_path / "hf").exists() and not [p for p in tmp_path.iterdir() if TMP_SUFFIX in p.name]


def _die(*_: Any, **__: Any) -> None:
    os._exit(3)


def test_a_worker_that_dies_fails_the_write_naming_it(tmp_path: Path) -> None:
    workers = Workers(_die, "src", str(tmp_path / "hf"), {})
    finish = workers(tmp_path, [["model-00002-of-00002.safetensors"]])
    with pytest.raises(
        CheckpointWriteError, match=r"worker 1 of 2 \(shard model-00002-of-00002.safetensors\) exited with code 3"
    ):
        finish(True)


def _fail(src: str, dst: str, *, progress: Any, part: Part) -> None:
    progress(10, 20)
    raise ArgumentError(f"{dst}: no room for {part.files[0]}")


def test_a_worker_error_keeps_its_type_and_adds_the_worker(tmp_path: Path) -> None:
    workers = Workers(_fail, "src", "out/", {})
    finish = workers(tmp_path, [["a.safetensors"]])
    with pytest.raises(
        ArgumentError, match=r"^worker 1 of 2 \(shard a.safetensors\): out/: no room for a.safetensors$"
    ):
        finish(True)


def test_workers_need_a_folder(fixtures_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match=r"\(Hugging Face shards, or format=\"dcp\"\), and .* is one file; end DST"):
        ckptkit.convert_checkpoint(fixtures_dir / "ddp.pt", tmp_path / "out.safetensors", workers=2)
    code, _, err = run("convert", fixtures_dir / "ddp.pt", tmp_path / "o.pt", "--workers", "2")
    assert (
        code == 2 and "--workers splits a folder's files among processes (Hugging Face shards, or --format dcp)" in err
    )
    code, _, err = run("convert", fixtures_dir / "ddp.pt", f"{tmp_path}/hf/", "--workers", "0")
    assert code == 2 and "--workers" in err


def test_a_source_read_with_torch_is_written_by_one_process_and_says_so(fixtures_dir: Path, tmp_path: Path) -> None:
    report = ckptkit.convert_checkpoint(
        fixtures_dir / "legacy_ddp.pt", tmp_path / "hf", max_shard_size="4KB", workers=2
    )
    assert not report.fast and any("one process wrote every file" in n for n in report.notes)
    got = ckptkit.read_checkpoint(tmp_path / "hf")
    want = ckptkit.read_checkpoint(fixtures_dir / "legacy_ddp.pt")
    assert sorted(got) == sorted(k.removeprefix("module.") for k in want)
    assert all(torch.equal(got[k.removeprefix("module.")], v) for k, v in want.items() if isinstance(v, torch.Tensor))
