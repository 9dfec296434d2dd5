"""A sharded convert by every rank of a process group: under real torchrun, a real single-node
SLURM (srun), and gloo groups where one rank fails at a chosen point. Every test here starts
several processes: marked slow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.errors import ArgumentError
from ckptkit.formats.dcp.stream import open_dcp
from ckptkit.io.atomic import TMP_SUFFIX
from tests.conftest import ROOT
from tests.group import run_group

pytestmark = pytest.mark.slow

SOURCE = ROOT / "fixtures" / "fsdp2_dcp_dim1"  # chunks split along dim 1: the slowest copy, several shards
SHARD = "600"  # bytes: every tensor its own shard, more shards than ranks


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}"}


def _torchrun(*args: str | Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += ["-m", "ckptkit.cli", "convert", *map(str, args), "--ranks"]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)


def _one_process(tmp_path: Path, source: Path = SOURCE) -> Path:
    ckptkit.convert_checkpoint(source, tmp_path / "one", max_shard_size=SHARD)
    return tmp_path / "one"


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if TMP_SUFFIX in p.name]


def test_under_torchrun_each_rank_writes_its_share_of_the_one_process_folder(tmp_path: Path) -> None:
    proc = _torchrun(SOURCE, f"{tmp_path}/hf/", "--max-shard-size", SHARD, "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"destination_format": "hf-sharded"') == 1  # rank 0 reports, for all
    assert _files(tmp_path / "hf") == _files(_one_process(tmp_path))
    assert not _leftovers(tmp_path)


def test_under_torchrun_each_rank_writes_its_distcp_file_of_a_dcp_folder(tmp_path: Path) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    proc = _torchrun(SOURCE, tmp_path / "out.dcp", "--format", "dcp", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count('"destination_format": "dcp"') == 1  # rank 0 reports, for all
    assert sorted(p.name for p in (tmp_path / "out.dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    ckptkit.convert_checkpoint(SOURCE, tmp_path / "one.dcp", format="dcp")
    for name in ("out", "one"):
        dcp_to_torch_save(tmp_path / f"{name}.dcp", tmp_path / f"{name}.pt")
    got, want = (torch.load(tmp_path / f"{name}.pt", weights_only=True) for name in ("out", "one"))
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert not _leftovers(tmp_path)


def _damaged(tmp_path: Path) -> tuple[Path, str]:
    """A copy of SOURCE with a flipped bit in its last tensor (in rank 1's share: see the test)."""
    folder = tmp_path / "dim1.dcp"
    shutil.copytree(SOURCE, folder)
    src = open_dcp(folder)
    name = list(src.obj)[-1]
    piece = src.obj[name].pieces[0]
    src.close()
    data = bytearray((folder / piece.file).read_bytes())
    data[piece.offset + 3] ^= 0x40
    (folder / piece.file).write_bytes(bytes(data))
    return folder, name


def test_under_torchrun_damage_in_one_ranks_share_fails_every_rank_naming_it(tmp_path: Path) -> None:
    folder, name = _damaged(tmp_path)
    proc = _torchrun(folder, f"{tmp_path}/hf/", "--max-shard-size", SHARD)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "ckptkit: error:" in line]
    assert len(errors) == 2 and len(set(errors)) == 1, proc.stderr[-3000:]  # every rank, the same words
    assert f"rank 1: {folder} is damaged: tensor {name}" in errors[0], errors
    assert not (tmp_path / "hf").exists() and not _leftovers(tmp_path)


def _convert_as(rank: int, world: int, good: str, out: str, bad: int) -> Any:
    """Rank ``bad`` converts a source that is not there: it fails before the first meeting."""
    src = good if rank != bad else good + ".missing"
    return ckptkit.convert_checkpoint(src, out, max_shard_size=SHARD, ranks=True).tensors


@pytest.mark.parametrize("bad", [0, 1])
def test_a_rank_that_fails_before_the_others_meet_fails_them_all_naming_it(tmp_path: Path, bad: int) -> None:
    results = run_group(_convert_as, 2, tmp_path, str(SOURCE), f"{tmp_path}/hf/", bad, timeout=180)
    assert [r.status for r in results] == ["error", "error"], [r.message for r in results]
    messages = {r.message.splitlines()[0] for r in results}  # the error's words; the traceback follows
    assert len(messages) == 1 and f"rank {bad}: " in messages.pop(), [r.message for r in results]
    assert all(r.raised("CheckpointNotFoundError") for r in results)
    assert not (tmp_path / "hf").exists() and not _leftovers(tmp_path)


def _fewer_shards(rank: int, world: int, src: str, out: str) -> Any:
    return ckptkit.convert_checkpoint(src, out, ranks=True).shards  # one file: rank 1 has no share


def test_fewer_shards_than_ranks_still_meet_and_publish(tmp_path: Path) -> None:
    results = run_group(_fewer_shards, 2, tmp_path, str(SOURCE), f"{tmp_path}/hf/", timeout=180)
    assert [r.status for r in results] == ["ok", "ok"], [r.message for r in results]
    ckptkit.convert_checkpoint(SOURCE, f"{tmp_path}/one/")
    assert _files(tmp_path / "hf") == _files(tmp_path / "one")


def test_ranks_need_a_process_group_and_a_shard_folder(tmp_path: Path) -> None:
    with pytest.raises(ArgumentError, match="rank 0: .*needs torch.distributed's process group"):
        ckptkit.convert_checkpoint(SOURCE, tmp_path / "hf/", ranks=True)
    proc = _torchrun(SOURCE, tmp_path / "one.safetensors")
    assert proc.returncode != 0  # torchrun says 1 for a worker's usage error (2)
    assert (
        "error: rank 0: a convert under torchrun or srun writes a folder (Hugging Face shards, or --format dcp)"
        in proc.stderr
    )


def test_under_srun_each_task_writes_its_share(slurm: Any, tmp_path: Path) -> None:
    script = tmp_path / "convert.sbatch"
    script.write_text(
        f"#!/bin/bash\nsrun python -m ckptkit.cli convert {SOURCE} {tmp_path}/hf/ --max-shard-size {SHARD} --ranks\n"
    )
    env = {**_env(), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}  # the script's python is this one
    job = slurm.sbatch(script, "--ntasks=2", f"--output={tmp_path}/slurm.out", "--chdir", str(ROOT), env=env)
    state = slurm.wait_until_done(job)
    assert state == "COMPLETED", (tmp_path / "slurm.out").read_text()[-3000:]
    assert _files(tmp_path / "hf") == _files(_one_process(tmp_path))
    assert (tmp_path / "slurm.out").read_text().count("hf-sharded") == 1  # rank 0's report


def test_a_convert_that_inherits_a_launchers_variables_converts_alone(tmp_path: Path) -> None:
    """A training rank under torchrun calling `ckptkit convert` (WORLD_SIZE=2 in its environment,
    no partner coming) converts as one process: it once waited for the other rank for good."""
    env = {**_env(), "WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29599"}
    cmd = [sys.executable, "-m", "ckptkit.cli", "convert", SOURCE, f"{tmp_path}/hf/", "--max-shard-size", SHARD]
    proc = subprocess.run(list(map(str, cmd)), capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _files(tmp_path / "hf") == _files(_one_process(tmp_path))


def _from_pointer(rank: int, world: int, latest: str, out: str) -> Any:
    return ckptkit.convert_checkpoint(latest, out, max_shard_size=SHARD, ranks=True).source


def test_ranks_follow_a_latest_pointer_as_one_process_does(tmp_path: Path) -> None:
    (tmp_path / "ckpts").mkdir()
    shutil.copy(ROOT / "fixtures" / "ddp.pt", tmp_path / "ckpts" / "step1.pt")
    (tmp_path / "ckpts" / "latest").write_text("step1.pt\n")
    results = run_group(_from_pointer, 2, tmp_path, str(tmp_path / "ckpts" / "latest"), f"{tmp_path}/hf/", timeout=180)
    assert [r.status for r in results] == ["ok", "ok"], [r.message for r in results]
    assert results[0].value == str(tmp_path / "ckpts" / "step1.pt")
    ckptkit.convert_checkpoint(tmp_path / "ckpts" / "latest", f"{tmp_path}/one/", max_shard_size=SHARD)
    assert _files(tmp_path / "hf") == _files(tmp_path / "one")
