"""Regression tests for the seams listed in issue 10.

Each test pins one defect found where two parts of ckptkit meet (the CLI and the library,
torch's loader and ckptkit's errors, the save paths and the suffix rules, ...). Only the
public API (``ckptkit.<name>`` and ``ckptkit.cli.main``) is used, since the internals move.
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
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
from ckptkit.cli import main
from fixtures.models import TiedLM

TMP_SUFFIX = ".ckptkit-tmp"
REPO = Path(ckptkit.__file__).resolve().parents[1]  # the checkout under test, for subprocesses


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def run_subprocess(cwd: Path, *args: object, preexec_fn=None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "ckptkit.cli", *(str(a) for a in args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)  # fmt: skip


def no_temps(folder: Path) -> bool:
    return not [p for p in folder.iterdir() if p.name.endswith(TMP_SUFFIX)]


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def is_safetensors(path: Path) -> bool:
    head = path.read_bytes()[:9]
    (n,) = struct.unpack("<Q", head[:8])
    return len(head) == 9 and 0 < n < path.stat().st_size and head[8:9] == b"{"


# -- 1. output too large for the file-size limit; suffix rules that disagree -------------------


def _small_fsize_limit() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


# Defect 1a: a legacy file converted past RLIMIT_FSIZE leaks torch's "unexpected pos" traceback.
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


# Defect 1b: save_on_master and convert_checkpoint read an upper-case suffix differently.
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


# -- 2. a DCP folder with trust=True and verify=True ------------------------------------------


def _dcp_folder(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "dcp"
    dcp.save({"w": torch.arange(4.0), "ns": argparse.Namespace(a=1)}, checkpoint_id=str(folder), no_dist=True)
    return folder


# Defect 2: load_for_rank(trust=True, verify=True) on a DCP folder still says it "needs --trust".
def test_trusted_verified_dcp_folder_loads(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path)
    with pytest.raises(ckptkit.UnsafeCheckpointError):  # a guard: without trust it is refused
        ckptkit.load_for_rank(folder)
    got = ckptkit.load_for_rank(folder, trust=True, verify=True)
    assert isinstance(got["ns"], argparse.Namespace) and got["ns"].a == 1
    assert torch.equal(got["w"], torch.arange(4.0))


# -- 3. CheckpointFolder with another suffix ---------------------------------------------------


# Defect 3: latest() only opens torch zips, so a committed .safetensors checkpoint is never latest.
def test_safetensors_checkpoint_folder_has_a_latest(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    folder = ckptkit.CheckpointFolder(tmp_path / "c", suffix=".safetensors")
    path = folder.path_for(10)
    ckptkit.save_on_master({"w": torch.ones(3)}, path)
    folder.commit(path)
    assert folder.checkpoints() == [path]
    assert folder.latest() == path


# -- 4. AsyncSaver and tied weights ------------------------------------------------------------


def _tied_pair(obj: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return obj["embed.weight"], obj["head.weight"]


# Defect 4: AsyncSaver's host copy unties tied weights, so its file is bigger than a sync save.
@pytest.mark.parametrize("what", ["save", "save_training_state"])
def test_async_save_keeps_tied_weights_tied(tmp_path: Path, what: str) -> None:
    torch.manual_seed(0)
    model = TiedLM()
    assert model.head.weight is model.embed.weight
    a, b = tmp_path / "async.pt", tmp_path / "sync.pt"
    with ckptkit.AsyncSaver() as saver:
        if what == "save":
            saver.save(model.state_dict(), a)
        else:
            saver.save_training_state(a, model=model, step=1)
    if what == "save":
        ckptkit.save_on_master(model.state_dict(), b)
    else:
        ckptkit.save_training_state(b, model=model, step=1)
    loaded = torch.load(a, weights_only=True)
    state = loaded if what == "save" else loaded["model"]
    t1, t2 = _tied_pair(state)
    assert torch.equal(t1, model.embed.weight.detach()) and torch.equal(t2, model.head.weight.detach())
    tied = t1.untyped_storage().data_ptr() == t2.untyped_storage().data_ptr()
    assert tied, "the tied keys were saved as two storages"
    assert a.stat().st_size == b.stat().st_size


# -- 5. a pickled class whose module is gone ---------------------------------------------------


def _gone_module_file(tmp_path: Path) -> tuple[Path, str]:
    mod = f"gone_mod_{uuid.uuid4().hex[:12]}"
    src = tmp_path / "mods"
    src.mkdir()
    (src / f"{mod}.py").write_text("class Thing:\n    def __init__(self):\n        self.x = 3\n")
    path = tmp_path / "gone.pt"
    code = f"import sys, torch; sys.path.insert(0, {str(src)!r}); import {mod}; torch.save({{'w': torch.ones(2), 'obj': {mod}.Thing()}}, {str(path)!r})"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, timeout=60)
    return path, mod


# Defect 5: a class whose module cannot be imported surfaces as a bare ModuleNotFoundError.
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


# -- 6. TorchScript archives -------------------------------------------------------------------


# Defect 6: a TorchScript file prints torch's UserWarning and is called "damaged or truncated".
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


# -- 7. torch.load failures that are not damage ------------------------------------------------


# Defect 7: every error from inside torch.load is worded "damaged or truncated", even a CUDA one.
@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_map_location_on_a_cpu_machine_is_not_damage(fixtures_dir: Path) -> None:
    with pytest.raises(ckptkit.CkptkitError) as info:
        ckptkit.load_for_rank(fixtures_dir / "ddp.pt", map_location="cuda:0")
    assert "damaged" not in str(info.value)
    assert "CUDA" in str(info.value)


# -- 8. inspect --trust says how it loaded -----------------------------------------------------


# Defect 8: `inspect --trust` claims "(loaded with torch, weights-only)" after weights_only=False.
def test_inspect_trust_does_not_claim_weights_only(fixtures_dir: Path) -> None:
    code, out, err = run("inspect", fixtures_dir / "needs_trust.pt", "--trust")
    assert code == 0, err
    assert "weights-only" not in out
    assert "trust" in out


# -- 9. the protocol-2 spelling of builtins ----------------------------------------------------


# Defect 9: the "needs trust" error lists __builtin__.set, which torch's weights-only loader accepts.
def test_needs_trust_lists_only_the_globals_torch_refuses(tmp_path: Path) -> None:
    path = tmp_path / "set_ns.pt"
    torch.save({"w": torch.zeros(2), "s": {1, 2}, "ns": argparse.Namespace(a=1)}, path)
    with pytest.raises(ckptkit.UnsafeCheckpointError) as info:
        ckptkit.load_for_rank(path)
    assert info.value.globals == ("argparse.Namespace",)
    assert "__builtin__" not in str(info.value)
    got = ckptkit.load_for_rank(path, allow_globals=[argparse.Namespace])
    assert got["s"] == {1, 2}
    assert got["ns"].a == 1 and torch.equal(got["w"], torch.zeros(2))


# -- 10. commit of a path that does not exist --------------------------------------------------


# Defect 10: commit() points `latest` at a file that does not exist.
def test_commit_of_a_missing_file_is_refused(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path)
    with pytest.raises(ckptkit.CkptkitError) as info:
        folder.commit(folder.path_for(10))
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "latest").exists()


# -- 11. prefix summaries for --add / --strip --------------------------------------------------


# Defect 11: the convert summary says "no prefix -> no prefix" for --add/--strip model.
@pytest.mark.parametrize(
    ("name", "option", "before", "after", "summary"),
    [
        ("plain.pt", "add", "", "model.", "(no prefix -> model.)"),
        ("lightning.ckpt", "strip", "model.", "", "(model. -> no prefix)"),
    ],
)  # fmt: skip
def test_convert_summary_names_the_prefixes(fixtures_dir: Path, tmp_path: Path, name: str, option: str,
                                            before: str, after: str, summary: str) -> None:  # fmt: skip
    code, out, err = run("convert", fixtures_dir / "ddp.pt", tmp_path / "ddp_guard.pt")
    assert code == 0 and "(module. -> no prefix)" in out, err  # a guard: right today
    code, out, err = run("convert", fixtures_dir / name, tmp_path / "cli.pt", f"--{option}", "model.")
    assert code == 0, err
    assert summary in out
    report = ckptkit.convert_checkpoint(fixtures_dir / name, tmp_path / "api.pt", **{option: ["model."]})
    assert (report.prefix_before, report.prefix_after) == (before, after)


# -- 12. inspect of a flat state dict; bytes of tied tensors -----------------------------------


# Defect 12a: inspect of a flat state dict lists every key twice.
def test_inspect_flat_state_dict_lists_each_key_once(fixtures_dir: Path) -> None:
    keys = [k for k in torch.load(fixtures_dir / "plain.pt", weights_only=True)
            if not any(part.isdigit() for part in k.split("."))]  # fmt: skip
    assert len(keys) == 9
    code, out, err = run("inspect", fixtures_dir / "plain.pt")
    assert code == 0, err
    for key in keys:
        assert sum(key in line.split() for line in out.splitlines()) == 1, (key, out)


# Defect 12b: bytes_by_dtype counts a tied tensor once per name instead of once per storage.
def test_inspect_counts_tied_storage_once(fixtures_dir: Path) -> None:
    obj = torch.load(fixtures_dir / "tied_ddp.pt", weights_only=True)
    state = ckptkit.find_model_state(obj)[1]
    seen: dict[int, int] = {}
    for t in state.values():
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    assert len(seen) < len(state)  # the fixture does hold a tied pair
    summary = ckptkit.inspect_checkpoint(fixtures_dir / "tied_ddp.pt")
    assert sum(summary.bytes_by_dtype.values()) == sum(seen.values())


# -- 13. an existing folder as DST -------------------------------------------------------------


# Defect 13: an existing folder as DST is called an "unknown output suffix" or asks for --force.
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
