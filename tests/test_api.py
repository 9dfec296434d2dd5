"""The public API is coherent: every reader takes trust and allow_globals, messages speak the
caller's spelling, errors are typed by what happened, and the top level stays small."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import ckptkit
import ckptkit.errors
import ckptkit.prefix
from ckptkit.cli import main
from fixtures.models import TinyNet
from tests.ops.test_convert import _dcp_folder

REPO = Path(ckptkit.__file__).resolve().parents[1]


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def _namespace_training_state(path: Path) -> None:
    model = TinyNet()
    ckptkit.save_training_state(path, model=model, step=3, extra={"args": argparse.Namespace(lr=0.1)})


# -- allow_globals everywhere, as objects or names --------------------------------------------


@pytest.mark.parametrize("allow", [[argparse.Namespace], ["argparse.Namespace"]])
def test_every_reader_takes_allow_globals(fixtures_dir: Path, tmp_path: Path, allow: list[object]) -> None:
    src = fixtures_dir / "needs_trust.pt"
    assert ckptkit.read_checkpoint(src, allow_globals=allow)["args"].lr == 0.01
    assert ckptkit.load_for_rank(src, model=TinyNet(), allow_globals=allow, verify=True)["args"].epochs == 3
    report = ckptkit.convert_checkpoint(src, tmp_path / "out.pt", allow_globals=allow)
    assert report.renamed == 0 and not report.fast
    assert ckptkit.inspect_checkpoint(src, allow_globals=allow).weights_at == "model"
    assert ckptkit.diff_checkpoints(src, fixtures_dir / "plain.pt", allow_globals=allow).equal
    _namespace_training_state(tmp_path / "state.pt")
    state = ckptkit.load_training_state(tmp_path / "state.pt", model=TinyNet(), allow_globals=allow)
    assert state.extra["args"].lr == 0.1 and state.step == 3


def test_readers_refuse_without_allow_globals(fixtures_dir: Path, tmp_path: Path) -> None:
    src = fixtures_dir / "needs_trust.pt"
    _namespace_training_state(tmp_path / "state.pt")
    calls = [
        lambda: ckptkit.read_checkpoint(src),
        lambda: ckptkit.load_for_rank(src, verify=True),
        lambda: ckptkit.convert_checkpoint(src, tmp_path / "out.pt"),
        lambda: ckptkit.diff_checkpoints(src, src),
        lambda: ckptkit.load_training_state(tmp_path / "state.pt", model=TinyNet()),
    ]
    for call in calls:
        with pytest.raises(ckptkit.errors.UnsafeCheckpointError) as info:
            call()
        assert info.value.globals == ("argparse.Namespace",)
    assert ckptkit.inspect_checkpoint(src).needs_trust == ["argparse.Namespace"]


@pytest.mark.parametrize("command", ["convert", "inspect", "diff"])
def test_cli_allow_global(fixtures_dir: Path, tmp_path: Path, command: str) -> None:
    src = fixtures_dir / "needs_trust.pt"
    args = {"convert": [src, tmp_path / "o.pt"], "inspect": [src], "diff": [src, fixtures_dir / "plain.pt"]}[command]
    code, out, err = run(command, *args)
    assert code == (2 if command == "diff" else 1) and "--allow-global argparse.Namespace" in " ".join(
        (out + err).split()
    )
    code, out, err = run(command, *args, "--allow-global", "argparse.Namespace")
    assert code == 0, err


def test_cli_allow_global_that_cannot_be_imported_is_a_usage_error(fixtures_dir: Path, tmp_path: Path) -> None:
    code, _, err = run("convert", fixtures_dir / "needs_trust.pt", tmp_path / "o.pt", "--allow-global", "argparse.Nope")
    assert code == 2
    assert err.startswith("ckptkit: error: --allow-global argparse.Nope: cannot import") and len(err.splitlines()) == 1
    with pytest.raises(ckptkit.errors.ArgumentError, match=r"allow_globals=\['argparse.Nope'\]"):
        ckptkit.read_checkpoint(fixtures_dir / "needs_trust.pt", allow_globals=["argparse.Nope"])


# -- messages in the caller's spelling ---------------------------------------------------------


def test_messages_name_keywords_in_python_and_flags_on_the_command_line(fixtures_dir: Path, tmp_path: Path) -> None:
    src = fixtures_dir / "needs_trust.pt"
    with pytest.raises(ckptkit.errors.UnsafeCheckpointError) as info:
        ckptkit.convert_checkpoint(src, tmp_path / "o.pt")
    assert "trust=True" in str(info.value) and "allow_globals=[argparse.Namespace]" in str(info.value)
    assert "--" not in str(info.value)
    code, _, err = run("convert", src, tmp_path / "o.pt")
    assert "--trust" in err and "--allow-global argparse.Namespace" in err
    assert "trust=True" not in err and "allow_globals" not in err
    (tmp_path / "taken.pt").write_bytes(b"x")
    with pytest.raises(ckptkit.errors.ArgumentError, match=r"pass force=True to replace it"):
        ckptkit.convert_checkpoint(fixtures_dir / "plain.pt", tmp_path / "taken.pt")
    assert "pass --force to replace it" in run("convert", fixtures_dir / "plain.pt", tmp_path / "taken.pt")[2]
    with pytest.raises(ckptkit.errors.ArgumentError, match=r"pass model_only=True"):
        ckptkit.convert_checkpoint(fixtures_dir / "train_ckpt.pt", tmp_path / "o.safetensors")


# -- model_only: the one spelling (torch's weights_only means something else) ----------------


def test_model_only_is_the_one_spelling(fixtures_dir: Path, tmp_path: Path) -> None:
    src = fixtures_dir / "train_ckpt.pt"
    new = ckptkit.convert_checkpoint(src, tmp_path / "a.safetensors", model_only=True)
    assert new.dropped == ["optimizer", "scheduler", "epoch", "step", "best_loss"]
    with pytest.raises(TypeError, match="weights_only"):
        ckptkit.convert_checkpoint(src, tmp_path / "b.safetensors", weights_only=True)  # type: ignore[call-arg]
    code, _, err = run("convert", src, tmp_path / "c.safetensors", "--model-only")
    assert code == 0, err
    assert (tmp_path / "c.safetensors").read_bytes() == (tmp_path / "a.safetensors").read_bytes()
    code, _, err = run("convert", src, tmp_path / "d.safetensors", "--weights-only")
    assert code == 2 and "No such option '--weights-only'" in err and "--model-only" in err
    assert not (tmp_path / "b.safetensors").exists() and not (tmp_path / "d.safetensors").exists()


def test_to_is_checked(fixtures_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ckptkit.errors.ArgumentError, match="to must be 'single', 'ddp' or 'keep'"):
        ckptkit.convert_checkpoint(fixtures_dir / "ddp.pt", tmp_path / "o.pt", to="plain")  # type: ignore[arg-type]
    assert not (tmp_path / "o.pt").exists()


# -- one suffix table -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "is_zip"), [("a.tar", True), ("b.Pt", True), ("c.weights", True), ("d.SafeTensors", False)]
)
def test_write_checkpoint_follows_the_suffix_table(tmp_path: Path, name: str, is_zip: bool) -> None:
    ckptkit.write_checkpoint({"w": torch.ones(2)}, tmp_path / name)
    assert (
        (tmp_path / name).read_bytes()[:4] == b"PK\x03\x04" if is_zip else (tmp_path / name).read_bytes()[8:9] == b"{"
    )
    assert torch.equal(ckptkit.read_checkpoint(tmp_path / name)["w"], torch.ones(2))


def test_convert_refuses_an_unknown_suffix_and_reads_tar(fixtures_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ckptkit.errors.ArgumentError, match="unknown output suffix '.weights'"):
        ckptkit.convert_checkpoint(fixtures_dir / "ddp.pt", tmp_path / "o.weights")
    ckptkit.convert_checkpoint(fixtures_dir / "ddp.pt", tmp_path / "model_best.pth.tar")
    assert list(ckptkit.read_checkpoint(tmp_path / "model_best.pth.tar"))[0] == "fc1.weight"


# -- DCP folders: allow_globals and map_location ----------------------------------------------


def test_dcp_honours_allow_globals_and_map_location(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path)  # {"w": arange(4.0), "ns": Namespace(a=1)}
    got = ckptkit.read_checkpoint(folder, allow_globals=[argparse.Namespace], map_location="meta")
    assert got["ns"].a == 1 and got["w"].device.type == "meta" and got["w"].shape == (4,)
    assert ckptkit.load_for_rank(folder, allow_globals=["argparse.Namespace"], verify=True)["ns"].a == 1
    with pytest.raises(ckptkit.errors.ArgumentError, match="takes a device as map_location"):
        ckptkit.read_checkpoint(folder, trust=True, map_location={"cuda:0": "cpu"})


# -- errors typed by what happened ------------------------------------------------------------


def test_torch_export_archive_is_unsupported_not_damaged(tmp_path: Path) -> None:
    class M(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.export.save(torch.export.export(M(), (torch.randn(1, 2),)), str(tmp_path / "m.pt2"))
    for call in (ckptkit.read_checkpoint, ckptkit.inspect_checkpoint, lambda p: ckptkit.load_for_rank(p, verify=True)):
        with pytest.raises(ckptkit.errors.UnsupportedCheckpointError, match=r"torch\.export archive") as info:
            call(tmp_path / "m.pt2")
        assert "damaged" not in str(info.value) and "torch.export.load" in str(info.value)
    report = ckptkit.verify_checkpoint(tmp_path / "m.pt2")
    assert not report.ok and "torch.export" in report.checks[0].detail


@pytest.mark.parametrize("legacy", [False, True])
def test_a_pickled_ddp_module_needs_no_process_group_and_is_not_damaged(tmp_path: Path, legacy: bool) -> None:
    path = tmp_path / "ddp_module.pt"
    code = (
        "import os, sys, torch, torch.distributed as dist\n"
        f"dist.init_process_group('gloo', init_method='file://{tmp_path}/store', rank=0, world_size=1)\n"
        "m = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))\n"
        f"torch.save(m, {str(path)!r}, _use_new_zipfile_serialization={not legacy})\n"
        f"torch.save(m.state_dict(), {str(tmp_path / 'expected.pt')!r})\n"
        "dist.destroy_process_group()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    if legacy:  # torch's legacy loader, trusted, runs DDP.__setstate__: told as what it is
        with pytest.raises(ckptkit.errors.DistributedError, match="needs a torch.distributed process group") as info:
            ckptkit.load_for_rank(path, trust=True)
        assert "damaged" not in str(info.value)
        return
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    for trust in (False, True):  # a zip's pickled module is read as its state_dict(), __setstate__ never runs
        got = ckptkit.load_for_rank(path, trust=trust, map_location="cpu")
        assert list(got) == list(expected) == ["module.weight", "module.bias"]
        assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_class_not_found_is_an_import_error(tmp_path: Path) -> None:
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "vanishing_mod_x1.py").write_text("class Thing:\n    pass\n")
    code = f"import sys, torch; sys.path.insert(0, {str(mods)!r}); import vanishing_mod_x1 as m; torch.save({{'t': m.Thing()}}, {str(tmp_path / 'p.pt')!r})"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    with pytest.raises(ImportError) as info:
        ckptkit.read_checkpoint(tmp_path / "p.pt", trust=True)
    assert isinstance(info.value, ckptkit.errors.ClassNotFoundError) and "PYTHONPATH" in str(info.value)


def test_a_truncated_legacy_file_is_not_called_damaged_with_certainty(fixtures_dir: Path, tmp_path: Path) -> None:
    data = (fixtures_dir / "legacy_ddp.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) - 100])
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="holds no checksums"):
        ckptkit.read_checkpoint(tmp_path / "cut.pt")


def test_verify_reports_typed_checks(fixtures_dir: Path) -> None:
    report = ckptkit.verify_checkpoint(fixtures_dir / "needs_trust.pt")
    kinds = {c.name: c.kind for c in report.checks}
    assert kinds["CRC-32 of every record"] == "integrity" and kinds["safe to load"] == "safety"
    assert report.intact and not report.ok
    safety = next(c for c in report.checks if c.kind == "safety")
    assert safety.needs == ("argparse.Namespace",)
    assert {c["kind"] for c in report.to_dict()["checks"]} == {"integrity", "safety"}
    report.gate(trust=True)
    report.gate(allow_globals=[argparse.Namespace])
    with pytest.raises(ckptkit.errors.UnsafeCheckpointError):
        report.gate()


def test_commit_outside_the_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    ckptkit.save_on_master({"w": torch.ones(1)}, tmp_path / "elsewhere.pt")
    with pytest.raises(ckptkit.errors.ArgumentError, match="is not in"):
        ckptkit.CheckpointFolder(tmp_path / "c").commit(tmp_path / "elsewhere.pt")
    assert not (tmp_path / "c" / "latest").exists()


# -- a small top level, errors and prefix tools as submodules ---------------------------------


def test_the_top_level_is_small_and_resolves() -> None:
    assert len(ckptkit.__all__) <= 28
    for name in ckptkit.__all__:
        assert getattr(ckptkit, name) is not None
    for name in ckptkit.errors.__all__:
        cls = getattr(ckptkit.errors, name)
        if not isinstance(cls, type):
            continue  # spell, cli_spelling: how messages name options
        assert issubclass(cls, ckptkit.CkptkitError)
        assert cls is ckptkit.CkptkitError or any(
            b.__module__ == "builtins" and b is not Exception for b in cls.__mro__[1:-2]
        )
    assert ckptkit.prefix.strip_prefix is ckptkit.strip_prefix
    # no release came before this one: every other name lives in its one home only
    for name in ("UnsafeCheckpointError", "detect_prefixes", "find_model_state", "TensorInfo"):
        assert not hasattr(ckptkit, name), name
    # what the operations return is public, so callers can type against it
    for name in ("ConvertReport", "VerifyReport", "DiffReport", "CheckpointSummary", "AdapterReport"):
        assert name in ckptkit.__all__ and isinstance(getattr(ckptkit, name), type), name
    assert ckptkit.errors.UnsafeCheckpointError.__module__ == "ckptkit.errors"
    assert "detect_prefixes" in ckptkit.prefix.__all__


def test_a_missing_key_gets_no_prefix_hint(tmp_path: Path) -> None:
    state = TinyNet().state_dict()
    del state["fc2.bias"]
    ckptkit.save_on_master(state, tmp_path / "short.pt")
    with pytest.raises(ckptkit.errors.StateDictMismatchError) as info:
        ckptkit.load_for_rank(tmp_path / "short.pt", model=TinyNet())
    assert "1 missing key(s) (fc2.bias)" in str(info.value)
    assert "start with" not in str(info.value) and "strict=False" in str(info.value)


def test_diff_names_its_own_key_options(fixtures_dir: Path, tmp_path: Path) -> None:
    both = {"a": TinyNet().state_dict(), "b": TinyNet().state_dict()}
    ckptkit.save_on_master(both, tmp_path / "two.pt")
    with pytest.raises(ckptkit.errors.LayoutError, match="say which with key_a="):
        ckptkit.diff_checkpoints(tmp_path / "two.pt", fixtures_dir / "plain.pt")
    code, _, err = run("diff", tmp_path / "two.pt", fixtures_dir / "plain.pt")
    assert code == 2 and "say which with --key-a" in err
    assert ckptkit.diff_checkpoints(tmp_path / "two.pt", tmp_path / "two.pt", key_a="a", key_b="a").equal


def test_a_zip_torch_cannot_read_is_unsupported_not_damaged(fixtures_dir: Path, tmp_path: Path) -> None:
    import zipfile

    with (
        zipfile.ZipFile(fixtures_dir / "plain.pt") as zin,
        zipfile.ZipFile(tmp_path / "bz.pt", "w", zipfile.ZIP_BZIP2) as zout,
    ):
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    with pytest.raises(ckptkit.errors.UnsupportedCheckpointError, match="compression method 12") as info:
        ckptkit.read_checkpoint(tmp_path / "bz.pt")
    assert "damaged" not in str(info.value)
    with pytest.raises(ckptkit.errors.UnsupportedCheckpointError):
        ckptkit.load_for_rank(tmp_path / "bz.pt", verify=True)


def test_latest_full_skips_a_checkpoint_with_a_flipped_bit(tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(tmp_path, keep=None)
    for step in (1, 2):
        ckptkit.save_on_master({"w": torch.full((64,), float(step))}, folder.path_for(step))
        folder.commit(folder.path_for(step))
    data = bytearray(folder.path_for(2).read_bytes())
    from ckptkit.formats.torchzip.container import TorchZip

    with TorchZip(folder.path_for(2)) as z:
        data[z.storage("0").data_offset + 3] ^= 0x01
    folder.path_for(2).write_bytes(bytes(data))
    assert folder.latest() == folder.path_for(2)  # structure intact: the quick check picks it
    assert folder.latest(full=True) == folder.path_for(1)  # every CRC checked: the one before
    (tmp_path / "latest").write_bytes(b"\xff\xfe not text")  # a damaged pointer is not an error
    assert folder.latest() == folder.path_for(2)


def test_verify_of_a_dcp_folder_with_malformed_metadata_reports_it(tmp_path: Path) -> None:
    import pickle

    folder = _dcp_folder(tmp_path)
    with open(folder / ".metadata", "rb") as f:
        meta = pickle.load(f)  # our own folder: DCP's metadata classes
    meta.storage_data = {"not an index": "not storage info"}  # the right classes holding the wrong things
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(meta, f)
    code, out, err = run("verify", folder)
    assert code == 1 and "Traceback" not in out + err
    assert "FAIL metadata: .metadata is malformed" in out
