"""megatron-core's torch_dist folders: read as DCP without Megatron or --trust, layers unstacked.

The fixture is megatron-core's own save (fixtures/make_megatron_fixtures.py); what ckptkit reads
is compared with torch's own DCP reader (``dcp_to_torch_save``) and, where megatron-core is
installed, with what megatron-core loads into a model itself.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import ckptkit
from ckptkit.errors import ArgumentError, CheckpointFormatError
from ckptkit.formats.dcp.megatron import layer_key
from tests.torchcompat import SAVE_ALONE
from tests.torchfree import run_torch_free

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def megatron(fixtures_dir: Path) -> Path:
    return fixtures_dir / "frameworks" / "megatron" / "torch_dist"


def _torch_reads(folder: Path, tmp_path: Path) -> dict[str, object]:
    """The folder as torch's own DCP reader gives it (which unpickles .metadata with plain pickle)."""
    try:
        dcp_to_torch_save(folder, tmp_path / "torch.pt")
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - torch 2.6's reader fails on the folder torch 2.13's DCP wrote
        pytest.skip(f"torch {torch.__version__}'s own DCP reader cannot read this folder ({type(e).__name__})")
    return torch.load(tmp_path / "torch.pt", weights_only=False)


def _assert_same(got: dict[str, object], want: dict[str, object]) -> None:
    assert sorted(got) == sorted(want)  # convert writes the weights first, then the entries beside them
    for k, v in want.items():
        if isinstance(v, torch.Tensor):
            assert isinstance(got[k], torch.Tensor) and got[k].dtype == v.dtype and torch.equal(got[k], v), k
        else:
            assert got[k] == v, k


def test_a_megatron_folder_converts_as_torch_reads_it_without_torch_or_trust(megatron: Path, tmp_path: Path) -> None:
    # Was: refused, .metadata names torch's planner classes (megatron-core pickles its save plans there)
    proc, imported_torch = run_torch_free(["convert", megatron, tmp_path / "out.pt", "--json"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["fast"] is True and not imported_torch, report
    _assert_same(torch.load(tmp_path / "out.pt", weights_only=True), _torch_reads(megatron, tmp_path))
    assert ckptkit.verify_checkpoint(megatron).ok


def test_load_for_rank_reads_a_megatron_folder(megatron: Path, tmp_path: Path) -> None:
    want = _torch_reads(megatron, tmp_path)  # load_for_rank reads a DCP folder with torch's reader too
    _assert_same(ckptkit.load_for_rank(megatron), want)


def test_inspect_names_megatron_its_stacked_layers_and_common_pt(megatron: Path) -> None:
    proc, imported_torch = run_torch_free(["inspect", megatron, "--json"])
    assert proc.returncode == 0 and not imported_torch, proc.stderr
    producer = json.loads(proc.stdout)["producer"]
    assert producer["name"] == "megatron" and "torch_dist" in producer["what"]
    notes = " ".join(producer["notes"])
    assert "12 tensors stack the layers of decoder.layers (2 layers) along dim 0" in notes
    assert "--unstack-layers" in notes and "common.pt" in notes


def test_unstack_layers_gives_each_layer_its_slice_without_torch(megatron: Path, tmp_path: Path) -> None:
    out = tmp_path / "layers.pt"
    proc, imported_torch = run_torch_free(["convert", megatron, out, "--unstack-layers", "--json"])
    assert proc.returncode == 0 and not imported_torch, proc.stderr
    got, stacked = torch.load(out, weights_only=True), _torch_reads(megatron, tmp_path)
    want: dict[str, object] = {}
    for k, v in stacked.items():
        if k.startswith("decoder.layers.") and isinstance(v, torch.Tensor):
            want |= {layer_key(k, i): v[i] for i in range(2)}
        elif k.startswith("decoder.layers.") and "/shard_" in k:  # each layer's extra state, by its shard number
            key, layer = k.rsplit("/shard_", 1)[0], int(k.rsplit("/shard_", 1)[1].split("_")[0])
            want[layer_key(key, layer)] = v
        else:
            want[k] = v
    assert sorted(got) == sorted(want)
    _assert_same({k: got[k] for k in want}, want)
    assert got["decoder.layers.1.mlp.linear_fc2.weight"].shape == (16, 64)  # split along its last dim by TP
    assert ckptkit.verify_checkpoint(out).ok


def test_unstack_layers_refuses_what_it_cannot_split(fixtures_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="no tensor stacks layers.*leave unstack_layers=True out"):
        ckptkit.convert_checkpoint(fixtures_dir / "fsdp2_dcp", tmp_path / "a.pt", unstack_layers=True)
    with pytest.raises(ArgumentError, match="ddp.pt is torch-zip: leave it out"):
        ckptkit.convert_checkpoint(fixtures_dir / "ddp.pt", tmp_path / "b.pt", unstack_layers=True)
    assert not any(p.name.endswith(".pt") for p in tmp_path.iterdir())


def test_layers_in_one_chunk_are_unstacked_through_torch(tmp_path: Path) -> None:
    # Was: refused; a chunk spanning layers sends the folder through torch's reader, which splits them
    w = torch.arange(24.0).reshape(2, 3, 4)
    folder = tmp_path / "one_chunk.dcp"
    dcp.save(
        {"decoder.layers.linear.weight": w, "embedding.weight": torch.ones(5, 4)}, checkpoint_id=folder, **SAVE_ALONE
    )
    report = ckptkit.convert_checkpoint(folder, tmp_path / "one.pt", unstack_layers=True)
    assert not report.fast and "spans layers 0 to 1" in report.fallback_reason
    got = torch.load(tmp_path / "one.pt", weights_only=True)
    assert sorted(got) == ["decoder.layers.0.linear.weight", "decoder.layers.1.linear.weight", "embedding.weight"]
    assert all(torch.equal(got[f"decoder.layers.{i}.linear.weight"], w[i]) for i in range(2))


def test_unstacked_keys_stay_where_the_state_dict_nests_them(tmp_path: Path) -> None:
    w = torch.arange(24.0).reshape(2, 3, 4)
    folder = tmp_path / "nested.dcp"
    dcp.save({"model": {"decoder.layers.w": w, "decoder.final.w": torch.ones(3)}}, checkpoint_id=folder, **SAVE_ALONE)
    # Was: the layers escaped "model" (and --model-only dropped them)
    report = ckptkit.convert_checkpoint(folder, tmp_path / "m.pt", unstack_layers=True, model_only=True)
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert sorted(got) == ["decoder.final.w", "decoder.layers.0.w", "decoder.layers.1.w"], report
    assert torch.equal(got["decoder.layers.1.w"], w[1])


_MEGATRON_LOADS = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[3])
from fixtures.make_megatron_fixtures import gpt_model, on_cpu
from megatron.core import dist_checkpointing
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[4])
dist.init_process_group("gloo", rank=0, world_size=1)
on_cpu()
model = gpt_model(1)  # one rank, no tensor parallelism: megatron-core reshards the TP=2 save itself
loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, sys.argv[1])  # as Megatron-LM loads
assert loaded["iteration"] == 2, loaded["iteration"]  # from common.pt
model.load_state_dict(loaded["model"])
torch.save(model.state_dict(), sys.argv[2])
"""


@pytest.mark.slow  # a process group, and megatron-core's loader
def test_megatron_core_loads_the_weights_unstack_layers_writes(megatron: Path, tmp_path: Path) -> None:
    pytest.importorskip("megatron.core", reason="megatron-core is not installed: pip install --no-deps megatron-core")
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ref = tmp_path / "megatron.pt"
    proc = subprocess.run(
        [sys.executable, "-c", _MEGATRON_LOADS, str(megatron), str(ref), str(ROOT), str(port)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ckptkit.convert_checkpoint(megatron, tmp_path / "layers.pt", unstack_layers=True)
    got = torch.load(tmp_path / "layers.pt", weights_only=True)
    # megatron-core's local layer spec names its layer norms apart from the checkpoint's keys
    # (sharded_state_dict_keys_map): Transformer Engine's layer spec names them as saved
    renames = {
        "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
    }
    tensors = 0
    for k, v in torch.load(ref, weights_only=False).items():
        for old, new in renames.items():
            k = k.replace(old, new)
        if isinstance(v, torch.Tensor):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
            tensors += 1
        elif "layers." in k:  # a layer's extra state: megatron-core saves it as a one-item list
            assert got[k] == [v], k
    assert tensors == sum(isinstance(v, torch.Tensor) for v in got.values()) == 29
