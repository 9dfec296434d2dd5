"""convert and load_for_rank at their edges: a file-size limit, suffixes in any case, folders as
DST, TorchScript, classes whose module is gone, CUDA map locations, and what trust lists.

Each test pins one defect found where two parts of ckptkit met (the CLI and the library,
torch's loader and ckptkit's errors, the save paths and the suffix rules, ...).
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import struct
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from tests.torchcompat import SAVE_ALONE

TMP_SUFFIX = ".ckptkit-tmp"
REPO = Path(ckptkit.__file__).resolve().parents[1]  # the checkout under test, for subprocesses


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def run_subprocess(cwd: Path, *args: object, preexec_fn=None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", *(str(a) for a in args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


def no_temps(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX)]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def is_safetensors(path: Path) -> bool:
    head = path.read_bytes()[:9]
    (n,) = struct.unpack("<Q", head[:8])
    return len(head) == 9 and 0 < n < path.stat().st_size and head[8:9] == b"{"


# -- output too large for the file-size limit; suffix rules that disagree -------------------


def _small_fsize_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


# Was: a legacy file converted past RLIMIT_FSIZE leaks torch's "unexpected pos" traceback.
def test_convert_past_the_file_size_limit_is_one_error_line(tmp_path: Path) -> None:
    torch.save({"w": torch.randn(256, 1024)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    assert (tmp_path / "legacy.pt").stat().st_size > 1_000_000
    r = run_subprocess(tmp_path, "convert", "legacy.pt", "out.pt", preexec_fn=_small_fsize_limit)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckptkit: error:"), r.stderr
    assert "too large" in lines[0]
    assert not (tmp_path / "out.pt").exists()
    assert no_temps(tmp_path)


# Was: save_on_master and convert_checkpoint read an upper-case suffix differently.
def test_upper_case_safetensors_suffix_writes_safetensors(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    sd = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    torch.save(sd, tmp_path / "src.pt")
    converted, saved = tmp_path / "x.SAFETENSORS", tmp_path / "w.SAFETENSORS"
    ckptkit.convert_checkpoint(tmp_path / "src.pt", converted)  # a guard: safetensors today
    ckptkit.save_on_master(sd, saved)
    for path in (converted, saved):
        assert is_safetensors(path), path.name
        got = load_file(str(path))
        assert set(got) == set(sd) and all(torch.equal(got[k], v) for k, v in sd.items())


# -- a DCP folder with trust=True and verify=True ------------------------------------------


def _dcp_folder(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(4.0), "ns": argparse.Namespace(a=1)}, checkpoint_id=str(folder), **SAVE_ALONE)
    return folder


# Was: load_for_rank(trust=True, verify=True) on a DCP folder still says it "needs --trust".
def test_trusted_verified_dcp_folder_loads(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path)
    with pytest.raises(ckptkit.errors.UnsafeCheckpointError):  # a guard: without trust it is refused
        ckptkit.load_for_rank(folder)
    got = ckptkit.load_for_rank(folder, trust=True, verify=True)
    assert isinstance(got["ns"], argparse.Namespace) and got["ns"].a == 1
    assert torch.equal(got["w"], torch.arange(4.0))


# -- a pickled class whose module is gone ---------------------------------------------------


def _gone_module_file(tmp_path: Path) -> tuple[Path, str]:
    mod = f"gone_mod_{uuid.uuid4().hex[:12]}"
    src = tmp_path / "mods"
    src.mkdir()
    (src / f"{mod}.py").write_text("class Thing:\n    def __init__(self):\n        self.x = 3\n")
    path = tmp_path / "gone.pt"
    code = f"import sys, torch; sys.path.insert(0, {str(src)!r}); import {mod}; torch.save({{'w': torch.ones(2), 'obj': {mod}.Thing()}}, {str(path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=60)
    return path, mod


# Was: a class whose module cannot be imported surfaces as a bare ModuleNotFoundError.
def test_missing_module_of_a_pickled_class_is_a_ckptkit_error(tmp_path: Path) -> None:
    path, mod = _gone_module_file(tmp_path)
    assert mod not in sys.modules
    with pytest.raises(ckptkit.CkptkitError) as info:
        ckptkit.load_for_rank(path, trust=True)
    assert mod in str(info.value)
    assert "damaged" not in str(info.value)
    r = run_subprocess(tmp_path, "inspect", path, "--trust")
    assert r.returncode == 1
    assert "Traceback" not in r.stderr
    lines = error_lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckptkit: error:"), r.stderr


# -- TorchScript archives -------------------------------------------------------------------


# Was: a TorchScript file prints torch's UserWarning and is called "damaged or truncated".
def test_convert_torchscript_says_torchscript(tmp_path: Path) -> None:
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(tmp_path / "scripted.pt"))
    r = run_subprocess(tmp_path, "convert", "scripted.pt", "out.pt")
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].strip(), r.stderr
    assert "TorchScript" in lines[0]
    for word in ("damaged", "Warning", "Traceback"):
        assert word not in lines[0], r.stderr
    assert not (tmp_path / "out.pt").exists()


# -- torch.load failures that are not damage ------------------------------------------------


# Was: every error from inside torch.load is worded "damaged or truncated", even a CUDA one.
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_map_location_on_a_cpu_machine_is_not_damage(fixtures_dir: Path) -> None:
    with pytest.raises(ckptkit.CkptkitError) as info:
        ckptkit.load_for_rank(fixtures_dir / "ddp.pt", map_location="cuda:0")
    assert "damaged" not in str(info.value)
    assert "CUDA" in str(info.value)


# -- the protocol-2 spelling of builtins ----------------------------------------------------


# Was: the "needs trust" error lists __builtin__.set, which torch's weights-only loader accepts.
def test_needs_trust_lists_only_the_globals_torch_refuses(tmp_path: Path) -> None:
    path = tmp_path / "set_ns.pt"
    torch.save({"w": torch.zeros(2), "s": {1, 2}, "ns": argparse.Namespace(a=1)}, path)
    with pytest.raises(ckptkit.errors.UnsafeCheckpointError) as info:
        ckptkit.load_for_rank(path)
    assert info.value.globals == ("argparse.Namespace",)
    assert "__builtin__" not in str(info.value)
    got = ckptkit.load_for_rank(path, allow_globals=[argparse.Namespace])
    assert got["s"] == {1, 2}
    assert got["ns"].a == 1 and torch.equal(got["w"], torch.zeros(2))


# -- prefix summaries for --add / --strip --------------------------------------------------


# Was: the convert summary says "no prefix -> no prefix" for --add/--strip model.
@pytest.mark.parametrize(
    ("name", "option", "before", "after", "summary"),
    [
        ("plain.pt", "add", "", "model.", "(no prefix -> model.)"),
        ("lightning.ckpt", "strip", "model.", "", "(model. -> no prefix)"),
    ],
)
def test_convert_summary_names_the_prefixes(
    fixtures_dir: Path, tmp_path: Path, name: str, option: str, before: str, after: str, summary: str
) -> None:
    code, out, err = run("convert", fixtures_dir / "ddp.pt", tmp_path / "ddp_guard.pt")
    assert code == 0 and "(module. -> no prefix)" in out, err  # a guard: right today
    code, out, err = run("convert", fixtures_dir / name, tmp_path / "cli.pt", f"--{option}", "model.")
    assert code == 0, err
    assert summary in out
    report = ckptkit.convert_checkpoint(fixtures_dir / name, tmp_path / "api.pt", **{option: ["model."]})
    assert (report.prefix_before, report.prefix_after) == (before, after)


# -- an existing folder as DST -------------------------------------------------------------


# Was: an existing folder as DST is called an "unknown output suffix" or asks for --force.
# Since issue 12 an existing folder receives Hugging Face shards; one holding other files is
# refused as a folder, never as a suffix.
@pytest.mark.parametrize("name", ["errs", "x.pt"])
def test_convert_to_an_existing_folder_says_folder(fixtures_dir: Path, tmp_path: Path, name: str) -> None:
    dst = tmp_path / name
    dst.mkdir()
    assert run("convert", fixtures_dir / "plain.pt", dst)[0] == 0
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors"]
    (dst / "notes.txt").write_text("mine")
    code, _, err = run("convert", fixtures_dir / "plain.pt", dst, "--force")
    assert code == 2, err
    lines = error_lines(err)
    assert len(lines) == 1 and lines[0].startswith("ckptkit: error:"), err
    assert "folder" in lines[0] and "notes.txt" in lines[0]
    assert "suffix" not in lines[0]
    assert sorted(p.name for p in dst.iterdir()) == ["model.safetensors", "notes.txt"]


def test_a_model_only_copy_says_which_records_it_never_read(tmp_path: Path) -> None:
    """Records a model-only copy leaves behind are not read, so not checked: a damaged one is not
    published, and the report names them and the command that checks them."""
    model = torch.nn.Linear(3, 4)
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    src = tmp_path / "train.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    with zipfile.ZipFile(src) as z:
        exp_avg = next(i for i in z.infolist() if i.filename.endswith("/data/2"))
    data = bytearray(src.read_bytes())
    name_len, extra_len = struct.unpack_from("<HH", data, exp_avg.header_offset + 26)  # the local header's
    data[exp_avg.header_offset + 30 + name_len + extra_len] ^= 0x01  # a bit of the optimizer's exp_avg
    src.write_bytes(bytes(data))
    assert not ckptkit.verify_checkpoint(src).ok
    report = ckptkit.convert_checkpoint(src, tmp_path / "model.safetensors", model_only=True)
    assert report.unread == [f"train/data/{k}" for k in range(2, 8)]
    assert any("not read, so not checked" in n and f"verify_checkpoint('{src}')" in n for n in report.notes)
    code, _, err = run("convert", src, tmp_path / "all.pt")  # everything written: everything read
    assert code == 1 and "train/data/2" in err and not (tmp_path / "all.pt").exists()
