"""DeepSpeed ZeRO folders: convert, inspect, verify and load_for_rank give exactly zero_to_fp32's state dict.

The fixtures (``fixtures/deepspeed/``, see its ABOUT.json) are real DeepSpeed 0.19.8 checkpoints of
2 gloo ranks, with ``zero{N}.expected.pt`` = DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from ckptkit.errors import ArgumentError, CheckpointFormatError, PartialCheckpointError
from ckptkit.formats.deepspeed.detect import DEEPSPEED
from ckptkit.formats.deepspeed.rebuild import to_float32
from ckptkit.formats.deepspeed.stream import open_deepspeed
from ckptkit.formats.entry import Bytes
from ckptkit.formats.pickles.dump import new_tensor
from ckptkit.formats.registry import detect
from ckptkit.formats.torchzip.writer import write_torch_zip
from ckptkit.io.atomic import TMP_SUFFIX
from tests import not_regular
from tests.torchfree import run_torch_free

DS = Path(__file__).resolve().parents[2] / "fixtures" / "deepspeed"
CASES = [(mode, stage) for mode in ("bf16", "fp32") for stage in (1, 2, 3)]
VOCAB, DIM, HIDDEN, SEQ = 37, 8, 13, 6


class TinyLM(nn.Module):
    """fixtures/make_deepspeed_fixtures.py's model: tied embed/head, a frozen table, buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.1, requires_grad=False)
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM, bias=False)
        self.temperature = nn.Parameter(torch.tensor([1.5]))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.linspace(0.5, 1.5, DIM))
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(3), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]].to(self.embed.weight.dtype)
        x = self.norm(x) * self.scale.to(x.dtype)
        return self.head(x + self.down(F.gelu(self.up(x)))) / self.temperature


def run(*args: Any) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def folder(mode: str, stage: int) -> Path:
    return DS / mode / f"zero{stage}"


def expected(mode: str, stage: int) -> dict[str, torch.Tensor]:
    return torch.load(DS / mode / f"zero{stage}.expected.pt", weights_only=True)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_exact(got: Any, want: dict[str, torch.Tensor], *, order: bool = True) -> None:
    """Keys (and their order), dtypes, shapes, bits, and ties (names sharing memory) as ``want``'s."""
    assert (list(got) if order else sorted(got)) == (list(want) if order else sorted(want))
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, k
        assert torch.equal(bits(g), bits(w)), k
    for a in want:
        for b in want:
            if a < b:
                tied = want[a].data_ptr() == want[b].data_ptr() and want[a].numel() > 0
                assert (got[a].data_ptr() == got[b].data_ptr()) == tied, (a, b)


def no_temps(where: Path) -> bool:
    return not any(TMP_SUFFIX in p.name for p in where.iterdir())


@pytest.mark.parametrize(("mode", "stage"), CASES)
def test_detected_and_read_exactly(mode: str, stage: int) -> None:
    assert detect(folder(mode, stage)).name == DEEPSPEED
    assert detect(folder(mode, stage) / "global_step3").name == DEEPSPEED  # the tag folder itself
    assert_exact(ckptkit.read_checkpoint(folder(mode, stage)), expected(mode, stage))
    assert_exact(ckptkit.read_checkpoint(folder(mode, stage) / "global_step3"), expected(mode, stage))


@pytest.mark.parametrize(("mode", "stage"), CASES)
def test_convert_pt_and_safetensors_exactly(mode: str, stage: int, tmp_path: Path) -> None:
    for name in ("out.pt", "out.safetensors"):
        report = ckptkit.convert_checkpoint(folder(mode, stage), tmp_path / name)
        assert report.fast and report.source_format == DEEPSPEED
        assert any(f"ZeRO stage {stage}, 2 ranks, tag global_step3" in n for n in report.notes)
        assert_exact(ckptkit.read_checkpoint(tmp_path / name), expected(mode, stage))
    assert_exact(torch.load(tmp_path / "out.pt", weights_only=True), expected(mode, stage))


@pytest.mark.parametrize("stage", [1, 3])
def test_convert_hf_shards_and_dcp(stage: int, tmp_path: Path) -> None:
    want = expected("bf16", stage)
    code, _, err = run("convert", folder("bf16", stage), tmp_path / "hf", "--max-shard-size", "1000")
    assert code == 0, err
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 1
    assert_exact(ckptkit.read_checkpoint(tmp_path / "hf"), want, order=False)
    code, _, err = run("convert", folder("bf16", stage), tmp_path / "dcp", "--format", "dcp")
    assert code == 0, err
    got = ckptkit.read_checkpoint(tmp_path / "dcp")
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == w.dtype and torch.equal(bits(got[k]), bits(w)) for k, w in want.items())


@pytest.mark.parametrize("stage", [2, 3])
def test_load_for_rank_into_the_model(stage: int) -> None:
    model = TinyLM()
    obj = ckptkit.load_for_rank(folder("bf16", stage), model=model)
    assert_exact(obj, expected("bf16", stage))
    want = expected("bf16", stage)
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k].to(v.dtype)), k
    assert model.head.weight is model.embed.weight  # still tied
    ckptkit.load_for_rank(folder("bf16", stage), model=TinyLM(), verify=True)


def test_load_for_rank_stage1_has_no_frozen_params() -> None:
    # zero_to_fp32 leaves stage 1's frozen parameters out (they exist only in 16-bit): so does ckptkit.
    with pytest.raises(ckptkit.errors.StateDictMismatchError, match="pos"):
        ckptkit.load_for_rank(folder("bf16", 1), model=TinyLM())
    model = TinyLM()
    ckptkit.load_for_rank(folder("bf16", 1), model=model, strict=False)
    assert torch.equal(model.up.weight, expected("bf16", 1)["up.weight"])


def test_module_weights_option(tmp_path: Path) -> None:
    module = torch.load(folder("bf16", 2) / "global_step3" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    ckptkit.convert_checkpoint(folder("bf16", 2), tmp_path / "m.pt", zero_weights="module")
    got = torch.load(tmp_path / "m.pt", weights_only=True)
    assert_exact(got, module)
    assert got["embed.weight"].dtype == torch.bfloat16
    with pytest.raises(ArgumentError, match="ZeRO-3"):
        ckptkit.convert_checkpoint(folder("bf16", 3), tmp_path / "m3.pt", zero_weights="module")
    code, _, err = run("convert", folder("bf16", 3), tmp_path / "m3.pt", "--zero-weights", "module")
    assert code != 0 and "--zero-weights module" in err and not (tmp_path / "m3.pt").exists()
    with pytest.raises(ArgumentError, match="DeepSpeed"):
        ckptkit.convert_checkpoint(tmp_path / "m.pt", tmp_path / "n.pt", zero_weights="module")


def test_zero3_rank_file_alone_is_refused(tmp_path: Path) -> None:
    rank_file = folder("bf16", 3) / "global_step3" / "zero_pp_rank_1_mp_rank_00_model_states.pt"
    code, out, err = run("convert", rank_file, tmp_path / "out.pt")
    assert code in (1, 2)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert str(folder("bf16", 3)) in err and "ZeRO-3" in err
    assert not (tmp_path / "out.pt").exists() and no_temps(tmp_path)
    with pytest.raises(PartialCheckpointError, match="Give the checkpoint folder instead"):
        ckptkit.load_for_rank(rank_file, model=TinyLM())
    assert "ZeRO-3" in " ".join(ckptkit.inspect_checkpoint(rank_file).notes)
    # Stage 1/2's model-state file holds full 16-bit weights: read as it is.
    ckptkit.convert_checkpoint(
        folder("bf16", 2) / "global_step3" / "mp_rank_00_model_states.pt", tmp_path / "ms.pt", model_only=True
    )


def test_empty_storage_under_a_nonempty_shape_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    t = new_tensor("0", "float32", (3,))
    t.args = (type(t.storage)(("storage", t.storage.pid[1], "0", "cpu", 0)), *t.args[1:])  # declares 0 elements
    with open(bad, "wb") as f:
        write_torch_zip(f, {"w": t}, records={"0": Bytes("uint8", (0,), 0, lambda f, p: 0)})
    with pytest.raises(CheckpointFormatError, match="w"):
        ckptkit.convert_checkpoint(bad, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_damaged_partition_byte_fails_naming_the_tensor(tmp_path: Path) -> None:
    src = tmp_path / "zero2"
    shutil.copytree(folder("bf16", 2), src)
    view = open_deepspeed(src)
    piece = view.obj["up.weight"].spec.pieces[0]
    path = view.paths[piece.file]
    view.close()
    with open(path, "r+b") as f:
        f.seek(piece.start + 5)
        byte = f.read(1)
        f.seek(piece.start + 5)
        f.write(bytes([byte[0] ^ 0x10]))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("a.pt", "a.safetensors"):
        with pytest.raises(CheckpointFormatError, match=r"damaged.*up\.weight"):
            ckptkit.convert_checkpoint(src, out / name)
    with pytest.raises(CheckpointFormatError, match=r"up\.weight"):
        ckptkit.read_checkpoint(src)
    assert list(out.iterdir()) == []
    code, _, err = run("convert", src, out / "b.pt")
    assert code == 1 and "up.weight" in err and list(out.iterdir()) == []
    report = ckptkit.verify_checkpoint(src)
    assert not report.ok and path.name in str(report.to_dict())


def test_inspect_and_verify(tmp_path: Path) -> None:
    s = ckptkit.inspect_checkpoint(folder("bf16", 3))
    assert s.format == DEEPSPEED and s.metadata["deepspeed"] == "DeepSpeed ZeRO stage 3, 2 ranks, tag global_step3"
    assert "optim_states" in s.metadata["weights"] and [t.name for t in s.tensors] == list(expected("bf16", 3))
    assert s.shared == 1  # head.weight is embed.weight
    code, out, _ = run("inspect", folder("bf16", 1))
    assert code == 0 and "ZeRO stage 1" in out
    report = ckptkit.verify_checkpoint(folder("fp32", 3))
    assert report.ok and any("records of 4 files match" in c.detail for c in report.checks)


def test_latest_naming_a_missing_tag(tmp_path: Path) -> None:
    shutil.copytree(folder("bf16", 1), tmp_path / "z")
    (tmp_path / "z" / "latest").write_text("global_step9")
    with pytest.raises(CheckpointFormatError, match="global_step9.*global_step3"):
        detect(tmp_path / "z")


@pytest.mark.parametrize("layout", ["a ZeRO folder", "latest alone"])
@pytest.mark.parametrize("call", ["read_checkpoint", "inspect_checkpoint", "verify_checkpoint", "convert_checkpoint"])
def test_latest_naming_a_tag_too_long_for_a_folder_name(tmp_path: Path, layout: str, call: str) -> None:
    """A 300-character tag made every reader raise a bare OSError (File name too long) from
    looking up its folder; the error is a CheckpointFormatError naming the latest file and the tag."""
    z = tmp_path / "z"
    if layout == "a ZeRO folder":
        shutil.copytree(folder("bf16", 1), z)
    else:
        z.mkdir()
    (z / "latest").write_text("t" * 300)
    run_call = {
        "read_checkpoint": lambda: ckptkit.read_checkpoint(z),
        "inspect_checkpoint": lambda: ckptkit.inspect_checkpoint(z),
        "verify_checkpoint": lambda: ckptkit.verify_checkpoint(z),
        "convert_checkpoint": lambda: ckptkit.convert_checkpoint(z, tmp_path / "out.safetensors"),
    }[call]
    says = rf"{z / 'latest'}: names tag 't{{40}}'\.\.\. \(300 characters\), which cannot be a folder name \(File name too long\)"
    if call == "verify_checkpoint":  # verify reports what it found rather than raising
        report = run_call()
        assert not report.ok
        assert re.search(says, str(report.to_dict()))
    else:
        with pytest.raises(CheckpointFormatError, match=says):
            run_call()
    assert not (tmp_path / "out.safetensors").exists()


def test_latest_naming_a_tag_too_long_is_one_line_from_the_cli(tmp_path: Path) -> None:
    z = tmp_path / "z"
    shutil.copytree(folder("bf16", 2), z)
    (z / "latest").write_text("t" * 300)
    proc = subprocess.run([sys.executable, "-m", "ckptkit.cli", "inspect", str(z)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"ckptkit: error: {z / 'latest'}: names tag {'t' * 40!r}... (300 characters), which cannot be a folder "
        f"name (File name too long); expected the name of a tag folder in {z}; give one of its tag folders "
        f"instead: {z / 'global_step3'}"
    ]


def test_latest_naming_a_tag_with_a_newline_is_one_line(tmp_path: Path) -> None:
    """The message joined the tag to the folder's path, so a tag holding a newline broke it in two
    (the fuzzer's finding)."""
    z = tmp_path / "z"
    shutil.copytree(folder("bf16", 1), z)
    (z / "latest").write_text("global_step3\nglobal_step4")
    proc = subprocess.run([sys.executable, "-m", "ckptkit.cli", "inspect", str(z)], capture_output=True, text=True)
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"ckptkit: error: {z}: a DeepSpeed checkpoint folder whose latest file names tag 'global_step3\\nglobal_step4', "
        f"but its folder is missing or holds no *_model_states.pt; give one of its tag folders instead: {z / 'global_step3'}"
    ]


def test_missing_rank_is_refused(tmp_path: Path) -> None:
    shutil.copytree(folder("bf16", 2), tmp_path / "z")
    next((tmp_path / "z" / "global_step3").glob("*rank_1_*optim_states.pt")).unlink()
    with pytest.raises(CheckpointFormatError, match="expected 2 .*found 1"):
        ckptkit.convert_checkpoint(tmp_path / "z", tmp_path / "out.pt")


def test_convert_needs_no_torch(tmp_path: Path) -> None:
    proc, imported = run_torch_free(
        ["convert", folder("bf16", 3), tmp_path / "a.safetensors"],
        ["inspect", folder("bf16", 2)],
        ["verify", folder("bf16", 1)],
    )
    assert proc.returncode == 0, proc.stderr
    assert not imported
    assert_exact(ckptkit.read_checkpoint(tmp_path / "a.safetensors"), expected("bf16", 3))


def test_upcast_matches_torch() -> None:
    values = torch.tensor([0.0, -1.5, 3.1e38, float("inf"), 1e-40, 65504.0, -(2.0**-24)], dtype=torch.float64)
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        t = values.to(dtype)
        raw = bytes(bits(t).numpy())
        got = torch.frombuffer(bytearray(to_float32(str(dtype).removeprefix("torch."), raw)), dtype=torch.float32)
        assert torch.equal(bits(got), bits(t.float())), dtype


@pytest.mark.slow
def test_regenerated_with_deepspeed_matches(tmp_path: Path) -> None:
    pytest.importorskip("deepspeed")
    script = Path(__file__).resolve().parents[2] / "fixtures" / "make_deepspeed_fixtures.py"
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in (1, 2, 3):
        fresh = torch.load(tmp_path / f"zero{stage}.expected.pt", weights_only=True)
        # Seeded: the committed fixture is what DeepSpeed makes, up to the last bits of fp32 training
        # arithmetic, which differ between CPUs (1.5e-8 on one CI machine). ckptkit's reading of the
        # fresh folder is compared bit for bit below.
        committed = expected("bf16", stage)
        assert list(fresh) == list(committed)
        for k, w in committed.items():
            assert fresh[k].dtype == w.dtype and fresh[k].shape == w.shape, k
            torch.testing.assert_close(fresh[k], w, rtol=1e-5, atol=1e-6, msg=k)
        ckptkit.convert_checkpoint(tmp_path / f"zero{stage}", tmp_path / f"{stage}.safetensors")
        assert_exact(ckptkit.read_checkpoint(tmp_path / f"{stage}.safetensors"), fresh)


def test_fixture_manifest() -> None:
    about = (DS / "ABOUT.json").read_text()
    assert "make_deepspeed_fixtures.py" in about and "0.19.8" in about
    assert isinstance(OrderedDict(expected("bf16", 1)), OrderedDict)


@pytest.mark.parametrize("how", list(not_regular.FOUND))
@pytest.mark.parametrize("file", ["mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"])
def test_a_rank_file_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path: Path, file: str, how: str) -> None:
    """A FIFO blocked every reader; a folder, a symlink loop or a dangling symlink raised a bare OSError."""
    zero = tmp_path / "zero2"
    shutil.copytree(folder("bf16", 2), zero, symlinks=True)
    victim = zero / "global_step3" / file
    not_regular.replace(victim, how)
    not_regular.assert_refused_everywhere(zero, victim, how, tmp_path / "out.safetensors")


def test_a_copy_names_the_records_it_never_read(tmp_path: Path) -> None:
    """zero_to_fp32's weights come from the optimizer's fp32 partitions: the moments and the 16-bit
    module weights are never read, so never checked. The report names them; verify checks them."""
    view = open_deepspeed(folder("bf16", 2))
    try:
        records = {
            f"{view.paths[i].name}:{r.name}"
            for i, z in enumerate(view.zips)
            for r in z.records
            if r.name.startswith(f"{z.prefix}data/")
        }
    finally:
        view.close()
    report = ckptkit.convert_checkpoint(folder("bf16", 2), tmp_path / "out.safetensors")
    assert report.unread and set(report.unread) < records  # some read, the rest named
    assert all(":" in name and "/data/" in name for name in report.unread)
    assert any("not read, so not checked" in n for n in report.notes)
