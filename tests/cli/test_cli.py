from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from ckptkit.io.atomic import TMP_SUFFIX
from ckptkit.model.layout import find_model_state
from fixtures.models import TiedLM, TinyNet
from tests import not_regular
from tests.torchcompat import SAVE_ALONE
from tests.torchfree import run_torch_free

ALL_FIXTURES = [
    "plain.pt",
    "ddp.pt",
    "dp.pth",
    "compiled.pt",
    "compiled_of_ddp.pt",
    "ddp_of_compiled.pt",
    "train_ckpt.pt",
    "legacy_ddp.pt",
    "ddp.safetensors",
    "cuda0_ddp.pt",
    "lightning.ckpt",
]


def run(*args: str) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def reference(fixtures_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(fixtures_dir / "plain.pt", weights_only=True)


def weights(path: Path, key: str | None = None) -> dict[str, torch.Tensor]:
    obj = ckptkit.read_checkpoint(path)
    return find_model_state(obj, key=key)[1]


def no_temps(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX)]


@pytest.mark.parametrize("name", ALL_FIXTURES)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_convert_every_fixture_to_single(fixtures_dir: Path, tmp_path: Path, name: str, suffix: str) -> None:
    dst = tmp_path / f"single{suffix}"
    extra = (
        ["--model-only"]
        if name in ("train_ckpt.pt", "cuda0_ddp.pt", "lightning.ckpt") and suffix == ".safetensors"
        else []
    )
    if name == "lightning.ckpt":
        extra += ["--strip", "model."]
    code, out, err = run("convert", fixtures_dir / name, dst, *extra)
    assert code == 0, err
    assert out.startswith(f"{dst}: 9 tensors")
    model = TinyNet()
    model.load_state_dict(weights(dst), strict=True)  # plain keys, strictly
    ref = reference(fixtures_dir)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in ref.items())
    assert no_temps(tmp_path)


def test_training_checkpoint_keeps_everything_but_the_names(fixtures_dir: Path, tmp_path: Path) -> None:
    code, _, _ = run("convert", fixtures_dir / "train_ckpt.pt", tmp_path / "s.pt")
    assert code == 0
    before = torch.load(fixtures_dir / "train_ckpt.pt", weights_only=True)
    after = torch.load(tmp_path / "s.pt", weights_only=True)
    assert list(after) == list(before)
    assert (after["epoch"], after["step"], after["best_loss"]) == (2, 3, 1.25)
    assert after["scheduler"] == before["scheduler"]
    for i, st in before["optimizer"]["state"].items():
        assert all(torch.equal(after["optimizer"]["state"][i][k], v) for k, v in st.items())
    model = TinyNet()
    model.load_state_dict(after["model"], strict=True)
    opt = torch.optim.Adam(model.parameters())
    opt.load_state_dict(after["optimizer"])  # still keyed by parameter index


@pytest.mark.parametrize("mid", [".pt", ".safetensors"])
@pytest.mark.parametrize("end", [".pt", ".safetensors"])
def test_round_trip_ddp_single_ddp(fixtures_dir: Path, tmp_path: Path, mid: str, end: str) -> None:
    single, back = tmp_path / f"single{mid}", tmp_path / f"ddp{end}"
    assert run("convert", fixtures_dir / "ddp.pt", single)[0] == 0
    assert run("convert", single, back, "--to", "ddp")[0] == 0
    original = torch.load(fixtures_dir / "ddp.pt", weights_only=True)
    again = weights(back)
    assert list(again) == list(original)
    assert all(torch.equal(again[k], v) for k, v in original.items())
    nn.DataParallel(TinyNet()).load_state_dict(again, strict=True)


def test_tied_weights_round_trip_through_safetensors(fixtures_dir: Path, tmp_path: Path) -> None:
    assert run("convert", fixtures_dir / "tied_ddp.pt", tmp_path / "lm.safetensors")[0] == 0
    assert run("convert", tmp_path / "lm.safetensors", tmp_path / "lm.pt")[0] == 0
    sd = torch.load(tmp_path / "lm.pt", weights_only=True)
    assert sd["head.weight"] is sd["embed.weight"]
    lm = TiedLM()
    lm.load_state_dict(sd, strict=True)
    assert lm.head.weight is lm.embed.weight


def test_dcp_folder_input(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    model = TinyNet()
    dcp.save(
        {"model": nn.DataParallel(model).state_dict(), "epoch": 4}, checkpoint_id=str(tmp_path / "dcp"), **SAVE_ALONE
    )
    code, _, err = run("convert", tmp_path / "dcp", tmp_path / "out.pt")
    # copied chunk by chunk, torch-free (tests/formats/test_dcp_stream.py)
    assert code == 0 and "loaded with torch" not in err
    restored = TinyNet()
    restored.load_state_dict(torch.load(tmp_path / "out.pt", weights_only=True)["model"], strict=True)
    assert all(
        torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_json_report(fixtures_dir: Path, tmp_path: Path) -> None:
    code, out, _ = run("convert", fixtures_dir / "ddp.pt", tmp_path / "s.pt", "--json")
    report = json.loads(out)
    assert code == 0 and report["fast"] is True and report["renamed"] == 9
    assert (report["prefix_before"], report["prefix_after"]) == ("module.", "")


@pytest.mark.parametrize(
    "args,code,message",
    [
        (["ddp.pt", "{tmp}/out.zzz"], 2, "unknown output suffix '.zzz'"),
        (["ddp.pt", "{fx}/plain.pt"], 2, "exists; pass --force"),
        (["ddp.pt", "{fx}/ddp.pt", "--force"], 2, "is the source file"),
        (["nope.pt", "{tmp}/o.pt"], 1, "no such file"),
        (["needs_trust.pt", "{tmp}/o.pt"], 1, "argparse.Namespace"),
        (["train_ckpt.pt", "{tmp}/o.safetensors"], 2, "pass --model-only"),
        (["ddp.pt", "{tmp}/missing/o.pt"], 1, "does not exist; create the folder first"),
        (["train_ckpt.pt", "{tmp}/o.pt", "--key", "ema"], 1, "no entry 'ema'"),
    ],
)
def test_convert_errors_are_one_line_without_traceback(
    fixtures_dir: Path, tmp_path: Path, args: list[str], code: int, message: str
) -> None:
    resolved = [
        a.format(tmp=tmp_path, fx=fixtures_dir) if "{" in a else str(fixtures_dir / a) if i == 0 else a
        for i, a in enumerate(args)
    ]
    before = sorted(p.name for p in fixtures_dir.iterdir())
    got, out, err = run("convert", *resolved)
    assert got == code, err
    assert out == ""
    assert err.startswith("ckptkit: error: ") and message in err
    assert "Traceback" not in err
    assert sorted(p.name for p in fixtures_dir.iterdir()) == before  # nothing written next to the sources
    assert no_temps(tmp_path) and not (tmp_path / "o.pt").exists()


@pytest.mark.parametrize("how", ["fifo", "dev zero"])
def test_a_fifo_or_device_given_as_the_checkpoint_is_refused_not_read(tmp_path: Path, how: str) -> None:
    """Detection read a FIFO's first bytes with a plain open, which blocks until a writer comes."""
    victim = tmp_path / "model.pt"
    victim.write_bytes(b"")
    not_regular.replace(victim, how)
    not_regular.assert_refused_everywhere(victim, victim, how, tmp_path / "out.safetensors")


def test_force_replaces_atomically(fixtures_dir: Path, tmp_path: Path) -> None:
    dst = tmp_path / "o.pt"
    dst.write_bytes(b"old")
    assert run("convert", fixtures_dir / "ddp.pt", dst, "--force")[0] == 0
    assert list(torch.load(dst, weights_only=True))[0] == "fc1.weight"


def test_truncated_source_leaves_no_output(fixtures_dir: Path, tmp_path: Path) -> None:
    src = tmp_path / "cut.pt"
    src.write_bytes((fixtures_dir / "ddp.pt").read_bytes()[:3000])
    code, _, err = run("convert", src, tmp_path / "o.pt")
    assert code == 1 and "cut.pt" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.pt"]


def test_code_payload_never_runs_through_any_command(tmp_path: Path) -> None:
    from tests.ops.test_load import _Payload

    marker = tmp_path / "PAYLOAD_RAN"
    evil = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "x": _Payload(marker)}, evil)
    for args in (["convert", evil, tmp_path / "o.pt"], ["inspect", evil], ["verify", evil], ["diff", evil, evil]):
        code, _, _ = run(*args)
        assert code == (2 if args[0] == "diff" else 1), args  # diff: 2 for trouble, as GNU diff
    assert not marker.exists()
    assert run("inspect", evil, "--trust")[0] == 0  # trusting it does run the payload: the check can fail
    assert marker.exists()


def test_fast_convert_and_inspect_never_import_torch(fixtures_dir: Path, tmp_path: Path) -> None:
    proc, imported = run_torch_free(
        ["convert", fixtures_dir / "train_ckpt.pt", tmp_path / "a.pt"],
        ["convert", fixtures_dir / "ddp.pt", tmp_path / "b.safetensors"],
        ["convert", tmp_path / "b.safetensors", tmp_path / "c.pt"],
        ["inspect", fixtures_dir / "train_ckpt.pt"],
        ["verify", tmp_path / "c.pt"],
    )
    assert proc.returncode == 0, proc.stderr
    assert not imported


def test_inspect_text_and_json(fixtures_dir: Path) -> None:
    code, out, _ = run("inspect", fixtures_dir / "train_ckpt.pt")
    assert code == 0
    assert "Weights at 'model': 9 tensors, 277 elements" in out
    assert "Wrapper prefixes: module." in out and "module.fc1.weight" in out
    code, out, _ = run("inspect", fixtures_dir / "compiled_of_ddp.pt", "--json")
    data = json.loads(out)
    assert data["prefixes"]["leading"] == ["_orig_mod.", "module."]
    assert data["tensor_count"] == 9 and data["bytes_by_dtype"] == {"float32": 276 * 4, "int64": 8}
    code, out, _ = run("inspect", fixtures_dir / "cuda0_ddp.pt", "--json")
    assert json.loads(out)["devices"] == {"cuda:0": 9}


def test_inspect_folds_layer_indices(tmp_path: Path) -> None:
    sd = {f"layers.{i}.w": torch.zeros(2, 2) for i in range(12)} | {"head.w": torch.zeros(3)}
    torch.save(sd, tmp_path / "deep.pt")
    code, out, _ = run("inspect", tmp_path / "deep.pt")
    assert code == 0
    line = next(line for line in out.splitlines() if line.strip().startswith("layers.*.w"))
    assert line.split()[1:4] == ["12", "0-11", "[2,"]


def test_diff_equal_across_formats_and_prefixes(fixtures_dir: Path, tmp_path: Path) -> None:
    run("convert", fixtures_dir / "compiled_of_ddp.pt", tmp_path / "s.safetensors")
    code, out, _ = run("diff", fixtures_dir / "ddp.pt", tmp_path / "s.safetensors")
    assert code == 0 and out.startswith("same weights: 9 tensors compared")


def test_diff_reports_values_shapes_and_missing(tmp_path: Path) -> None:
    a = {"w": torch.zeros(3), "b": torch.ones(2), "gone": torch.ones(1)}
    b = {"module.w": torch.tensor([0.0, 0.5, 0.0]), "module.b": torch.ones(3), "module.new": torch.ones(1)}
    torch.save(a, tmp_path / "a.pt")
    torch.save(b, tmp_path / "b.pt")
    code, out, _ = run("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--json")
    report = json.loads(out)
    assert code == 1 and report["equal"] is False
    assert (report["only_in_a"], report["only_in_b"]) == (["gone"], ["new"])
    by_name = {d["name"]: d for d in report["differences"]}
    assert by_name["w"]["max_abs_diff"] == 0.5 and by_name["b"]["reason"] == "shape"
    assert run("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--atol", "0.6")[0] == 1  # shape/missing still differ


def test_diff_tolerance(tmp_path: Path) -> None:
    torch.save({"w": torch.tensor([1.0, 2.0])}, tmp_path / "a.pt")
    torch.save({"w": torch.tensor([1.0, 2.001])}, tmp_path / "b.pt")
    assert run("diff", tmp_path / "a.pt", tmp_path / "b.pt")[0] == 1
    code, out, _ = run("diff", tmp_path / "a.pt", tmp_path / "b.pt", "--atol", "0.01")
    assert code == 0 and "within atol=0.01" in out


def test_verify_detects_a_flipped_payload_bit(fixtures_dir: Path, tmp_path: Path) -> None:
    data = bytearray((fixtures_dir / "ddp.pt").read_bytes())
    from ckptkit.formats.torchzip.container import TorchZip

    z = TorchZip(fixtures_dir / "ddp.pt")
    rec = z.storage("0")
    data[rec.data_offset + 5] ^= 0x10
    (tmp_path / "flipped.pt").write_bytes(bytes(data))
    assert run("verify", fixtures_dir / "ddp.pt")[0] == 0
    code, out, _ = run("verify", tmp_path / "flipped.pt")
    assert code == 1 and "FAIL CRC-32 of every record: damaged:" in out and "data/0" in out


@pytest.mark.parametrize("name", ALL_FIXTURES + ["tied.safetensors", "tied_ddp.pt"])
def test_verify_passes_every_fixture(fixtures_dir: Path, name: str) -> None:
    code, out, _ = run("verify", fixtures_dir / name, "--json")
    assert code == 0, out
    assert json.loads(out)["ok"] is True


def test_verify_dcp_missing_shard(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(tmp_path / "d"), **SAVE_ALONE)
    assert run("verify", tmp_path / "d")[0] == 0
    for shard in (tmp_path / "d").glob("*.distcp"):
        shard.unlink()
    code, out, _ = run("verify", tmp_path / "d")
    assert code == 1 and "missing" in out


def test_help_is_fast_to_import() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, ckptkit.cli; print('torch' in sys.modules, 'rich' in sys.modules)"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.stdout.strip() == "False False"


def test_usage_errors_exit_2() -> None:
    assert run("convert")[0] == 2
    assert run("convert", "a.pt", "b.pt", "--to", "sideways")[0] == 2


@pytest.mark.parametrize("extra", [["--key", "student.", "--model-only"], ["--strip", "student."]])
@pytest.mark.parametrize("crcs", [False, True], ids=["plain", "ckptkit-crcs"])
def test_a_selection_from_safetensors_writes_only_what_it_selects(tmp_path: Path, extra: list[str], crcs: bool) -> None:
    """Issue 24, defect 1: the header named the selection but the whole data section was copied,
    and the broken file was published (with --force, over a good one)."""
    from safetensors.torch import load_file, save_file

    both = {"teacher.w": torch.arange(1000.0), "student.w": torch.arange(1010.0) * 2}
    src = tmp_path / "both.safetensors"
    if crcs:
        ckptkit.write_checkpoint(both, src)
    else:
        save_file(both, src)
    dst = tmp_path / "s.safetensors"
    ckptkit.write_checkpoint({"w": torch.ones(2)}, dst)
    code, _, err = run("convert", src, dst, "--force", *extra)
    assert code == 0, err
    got = load_file(dst)
    expected = (
        {"w": both["student.w"]} if "--key" in extra else {"teacher.w": both["teacher.w"], "w": both["student.w"]}
    )
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    assert ckptkit.verify_checkpoint(dst).ok and no_temps(tmp_path)


@pytest.mark.parametrize("nested", [False, True], ids=["safetensors", "pt-under-model"])
def test_a_selection_counts_the_prefix_it_removes_as_renames(tmp_path: Path, nested: bool) -> None:
    """Issue 26: ``--key student. --model-only`` said "0 renamed (no prefix -> no prefix)" while
    every key written had lost ``student.``: renames are counted as names written vs read."""
    from safetensors.torch import save_file

    both = {"teacher.fc.w": torch.ones(3), "student.fc.w": torch.ones(2), "student.fc.b": torch.ones(2)}
    if nested:
        src, key = tmp_path / "both.pt", "model/student."
        torch.save({"model": both, "epoch": 3}, src)
    else:
        src, key = tmp_path / "both.safetensors", "student."
        save_file(both, src)
    code, out, err = run("convert", src, tmp_path / "s.safetensors", "--key", key, "--model-only")
    assert code == 0, err
    assert "2 tensors (weights at " in out and "2 renamed (student. -> no prefix)" in out, out
    report = ckptkit.convert_checkpoint(src, tmp_path / "s.pt", key=key, model_only=True, to="ddp")
    assert (report.renamed, report.prefix_before, report.prefix_after) == (2, "student.", "module.")


def test_an_output_that_fails_its_own_check_is_never_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24: a writer that loses the last bytes of its data (as defect 1's header over the
    wrong data section did): the writer's check refuses the file, and --force leaves the old
    DST as it was."""
    from safetensors.torch import save_file

    import ckptkit.formats.safetensors.format as fp

    save_file({"teacher.w": torch.arange(1000.0), "student.w": torch.arange(1010.0)}, tmp_path / "both.safetensors")
    dst = tmp_path / "s.safetensors"
    ckptkit.write_checkpoint({"w": torch.ones(2)}, dst)
    good = dst.read_bytes()
    real = fp.write_safetensors

    def short(f: Any, *args: Any, **kwargs: Any) -> int:
        n = real(f, *args, **kwargs)
        f.truncate(f.tell() - 8)
        return n

    monkeypatch.setattr(fp, "write_safetensors", short)
    code, _, err = run("convert", tmp_path / "both.safetensors", dst, "--force", "--key", "student.", "--model-only")
    assert code == 1 and "fails its own check" in err and len(err.strip().splitlines()) == 1, err
    assert dst.read_bytes() == good and no_temps(tmp_path)


def test_a_save_that_fails_its_own_check_keeps_the_old_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ckptkit.formats.safetensors.torch as sttorch

    dst = tmp_path / "m.safetensors"
    ckptkit.write_checkpoint({"w": torch.ones(2)}, dst)
    good = dst.read_bytes()
    header = b'{"w":{"dtype":"F32","shape":[9],"data_offsets":[0,36]}}'  # 36 bytes of data, none written
    monkeypatch.setattr(
        sttorch, "save_tensors", lambda f, obj, **_: f.write(len(header).to_bytes(8, "little") + header)
    )
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="fails its own check"):
        ckptkit.write_checkpoint({"w": torch.ones(2)}, dst)
    assert dst.read_bytes() == good and no_temps(tmp_path)


def test_a_torch_zip_whose_pickle_was_damaged_in_writing_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check reads data.pkl's CRC-32 whatever the stand-ins make of the pickle."""
    import ckptkit.formats.torchzip.torch as write

    real = write.write

    def damaging(f: Any, *args: Any, **kwargs: Any) -> None:
        real(f, *args, **kwargs)
        f.flush()
        with open(os.readlink(f"/proc/self/fd/{f.fileno()}"), "r+b") as g:  # the temp file, readable
            head = g.read(30)  # the first record, data.pkl: its local header
            at = 30 + int.from_bytes(head[26:28], "little") + int.from_bytes(head[28:30], "little") + 3
            g.seek(at)
            byte = g.read(1)[0]
            g.seek(at)
            g.write(bytes([byte ^ 0xFF]))

    monkeypatch.setattr(write, "write", damaging)
    dst = tmp_path / "m.pt"
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="fails its own check"):
        ckptkit.write_checkpoint({"w": torch.ones(2), "ns": collections.defaultdict(list)}, dst)
    assert not dst.exists() and no_temps(tmp_path)


def test_the_allow_global_advice_for_numpy_values_works_when_followed(tmp_path: Path) -> None:
    """mmengine-style metadata (numpy scalars, arrays, dtypes): the advice must also name the
    numpy.dtypes classes numpy.dtype(code) builds, which the pickle never names (issue 25,
    finding 4); torch's own get_unsafe_globals_in_checkpoint misses them too."""
    import re

    import numpy as np

    meta = {
        "lr": np.float64(0.1),
        "iter": np.int64(3),
        "hist": np.arange(3, dtype=np.float32),
        "dt": np.dtype("float32"),
    }
    torch.save({"state_dict": TinyNet().state_dict(), "meta": meta}, tmp_path / "mm.pth")
    code, out, err = run("inspect", tmp_path / "mm.pth")
    said = " ".join((out + err).split())  # rich wraps long lines
    assert "--allow-global" in said, said
    names = re.findall(r"--allow-global (\S+?)(?=,| |$)", said)
    assert "numpy.dtypes.Float64DType" in names and "numpy.dtypes.Int64DType" in names
    code, out, err = run("inspect", tmp_path / "mm.pth", *[a for n in names for a in ("--allow-global", n)])
    assert code == 0, err
    got = ckptkit.load_for_rank(tmp_path / "mm.pth", allow_globals=names)
    assert got["meta"]["iter"] == 3 and got["meta"]["dt"] == np.dtype("float32")
