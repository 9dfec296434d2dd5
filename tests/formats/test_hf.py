"""Hugging Face sharded checkpoints in and out (issue 12, part 1).

In: the fixtures in fixtures/hf/ were written by huggingface_hub's save_torch_state_dict (see
fixtures/make_hf_fixtures.py); their folder or index opens as one checkpoint everywhere. Out:
what ckptkit writes is compared with what huggingface_hub writes for the same state dict, and
read back by huggingface_hub and safetensors themselves.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from huggingface_hub import load_torch_model, save_torch_state_dict
from safetensors import safe_open

import ckptkit
from ckptkit.cli import main
from fixtures.make_hf_fixtures import MAX_SHARD_SIZE, hf_state_dict
from fixtures.models import TiedLM, TinyNet
from tests import not_regular

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
HF = FIXTURES / "hf"
TMP_SUFFIX = ".ckptkit-tmp"
INDEX = {"safetensors": "model.safetensors.index.json", "bin": "pytorch_model.bin.index.json"}


def run(*args: object) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, [str(a) for a in args])
    return result.exit_code, result.stdout, result.stderr


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


def shapes() -> list[tuple[str, Path]]:
    return [(kind, p) for kind in ("safetensors", "bin") for p in (HF / kind, HF / kind / INDEX[kind])]


# -- in: the folder or the index is one checkpoint ---------------------------------------------


@pytest.mark.parametrize(("kind", "path"), shapes(), ids=lambda v: v if isinstance(v, str) else v.name)
def test_folder_or_index_reads_as_one_state_dict(kind: str, path: Path) -> None:
    assert_same(dict(ckptkit.read_checkpoint(path, map_location="cpu")), hf_state_dict())
    model = TinyNet()
    ckptkit.load_for_rank(path, model=model, map_location="cpu")
    assert_same(model.state_dict(), hf_state_dict())
    assert ckptkit.verify_checkpoint(path).ok
    summary = ckptkit.inspect_checkpoint(path)
    assert summary.format == "hf-sharded" and [t.name for t in summary.tensors] == list(hf_state_dict())


@pytest.mark.parametrize(("kind", "path"), shapes(), ids=lambda v: v if isinstance(v, str) else v.name)
@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_cli_converts_inspects_verifies_and_diffs_the_whole_model(
    tmp_path: Path, kind: str, path: Path, suffix: str
) -> None:
    out = tmp_path / f"model{suffix}"
    code, stdout, stderr = run("convert", path, out)
    assert code == 0, stderr
    assert stdout.startswith(f"{out}: 9 tensors")
    assert_same(dict(ckptkit.read_checkpoint(out, map_location="cpu")), hf_state_dict())
    assert run("diff", path, out)[0] == 0
    code, stdout, _ = run("verify", path)
    assert code == 0 and "index matches the shards" in stdout
    code, stdout, _ = run("inspect", path, "--json")
    assert code == 0 and json.loads(stdout)["tensor_count"] == 9


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_one_shard_gets_a_note_naming_its_index(tmp_path: Path, kind: str) -> None:
    shard = sorted((HF / kind).glob("*-00002-of-00003.*"))[0]
    code, stdout, stderr = run("convert", shard, tmp_path / "one.pt")
    assert code == 0, stderr
    assert f"note: {shard.name} is shard 2 of 3" in stderr and str(HF / kind / INDEX[kind]) in stderr
    code, stdout, _ = run("convert", shard, tmp_path / "two.pt", "--json")
    assert code == 0 and "holds 6 of the 9 tensors" in json.loads(stdout)["notes"][0]
    for command in (["inspect", shard], ["verify", shard], ["diff", shard, tmp_path / "one.pt"]):
        assert str(HF / kind / INDEX[kind]) in run(*command)[2]
        assert str(HF / kind / INDEX[kind]) in json.loads(run(*command, "--json")[1])["notes"][0]
    assert not run("inspect", HF / kind)[2]  # the whole checkpoint: no note


# Was: a diffusers folder (each pipeline model's, e.g. transformer/) was refused with "give a file",
# and one of its shards converted as if it were the model (30 of 144 tensors, exit 0, no note).
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_diffusers_folder_reads_whole_and_its_shard_says_what_it_is(tmp_path: Path, kind: str) -> None:
    state = {f"blocks.{i}.attn.weight": torch.full((16, 4), float(i)) for i in range(6)}
    folder = tmp_path / "transformer"
    folder.mkdir()
    # The call diffusers' save_pretrained makes, with its file names.
    save_torch_state_dict(
        state,
        folder,
        filename_pattern="diffusion_pytorch_model{suffix}." + kind,
        max_shard_size=600,
        safe_serialization=kind == "safetensors",
    )
    index = folder / f"diffusion_pytorch_model.{kind}.index.json"
    assert index.is_file()
    for source in (folder, index):
        got = ckptkit.read_checkpoint(source)
        assert list(got) == list(state) and all(torch.equal(got[k], v) for k, v in state.items())
    shard = sorted(folder.glob(f"diffusion_pytorch_model-00001-of-*.{kind}"))[0]
    code, _, stderr = run("convert", shard, tmp_path / "one.safetensors")
    assert code == 0 and f"note: {shard.name} is shard 1 of " in stderr and str(index) in stderr, stderr


# Was: the note knew transformers' two index names only; a shard of another set converted as the model.
def test_a_shard_of_an_index_of_any_name_gets_the_note_and_its_advice_reads_the_whole(tmp_path: Path) -> None:
    state = {f"layer.{i}.weight": torch.full((16, 4), float(i)) for i in range(4)}
    save_torch_state_dict(state, tmp_path, filename_pattern="ema{suffix}.safetensors", max_shard_size=300)
    index, shard = tmp_path / "ema.safetensors.index.json", tmp_path / "ema-00001-of-00004.safetensors"
    code, _, stderr = run("convert", shard, tmp_path / "one.pt")
    said = " ".join(stderr.split())
    assert (
        code == 0
        and f"note: {shard.name} is shard 1 of 4" in said
        and f"its index {index} lists; give that index for the whole model" in said
    )
    got = ckptkit.read_checkpoint(index)  # the advice, followed
    assert list(got) == list(state) and all(torch.equal(got[k], v) for k, v in state.items())


ST = FIXTURES / "frameworks" / "sentence_transformers" / "model"  # written by sentence-transformers


# Was: convert exited 0 with the transformer's 23 tensors, the Dense head in 2_Dense/ dropped without a note.
def test_a_sentence_transformers_folder_with_a_dense_head_is_refused_naming_each_modules_file(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    files = [ST / "model.safetensors", ST / "2_Dense" / "model.safetensors"]
    for args in (["convert", ST, tmp_path / "out.safetensors"], ["inspect", ST], ["verify", ST]):
        code, out, err = run(*args)
        said = " ".join((out + err).split())
        assert code == 1 and "2 module folders (., 2_Dense)" in said and all(str(f) in said for f in files), said
    assert not (tmp_path / "out.safetensors").exists()
    with pytest.raises(ckptkit.errors.PartialCheckpointError, match=r"weights are in 2 module folders"):
        ckptkit.read_checkpoint(ST)
    for f in files:  # the advice, followed: each module's weights, as sentence-transformers loads them
        ckptkit.convert_checkpoint(f, tmp_path / "one.safetensors", force=True)
        got, want = load_file(tmp_path / "one.safetensors"), load_file(f)
        assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)


def _copy(kind: str, tmp_path: Path) -> Path:
    folder = tmp_path / kind
    shutil.copytree(HF / kind, folder)
    return folder


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda wm: wm.pop("bn.bias"), "extra key bn.bias in {shard}: the index does not list it"),
        (
            lambda wm: wm.update({"fc3.weight": wm["fc1.weight"]}),
            "missing key fc3.weight: the index puts it in {first}, which does not hold it",
        ),
        (
            lambda wm: wm.update({"fc1.bias": wm["fc2.weight"]}),
            "missing key fc1.bias: the index puts it in {last}, which does not hold it (it is in {shard})",
        ),
    ],
)
def test_a_weight_map_that_disagrees_with_the_shards_names_the_key(
    tmp_path: Path, kind: str, edit, message: str
) -> None:
    folder = _copy(kind, tmp_path)
    index = json.loads((folder / INDEX[kind]).read_text())
    files = sorted(set(index["weight_map"].values()))
    edit(index["weight_map"])
    (folder / INDEX[kind]).write_text(json.dumps(index))
    expected = message.format(shard=files[1], first=files[0], last=files[2])
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="disagree") as e:
        ckptkit.read_checkpoint(folder, map_location="cpu")
    assert expected in str(e.value)
    code, _, stderr = run("convert", folder, tmp_path / "out.pt")
    assert code == 1 and expected in stderr
    report = ckptkit.verify_checkpoint(folder)
    assert not report.ok and any(expected in c.detail for c in report.checks if not c.ok)
    assert not (tmp_path / "out.pt").exists()


def test_a_missing_shard_is_named(tmp_path: Path) -> None:
    folder = _copy("safetensors", tmp_path)
    (folder / "model-00003-of-00003.safetensors").unlink()
    code, _, stderr = run("inspect", folder)
    assert code == 1 and "missing" in stderr and "model-00003-of-00003.safetensors" in stderr


@pytest.mark.parametrize("how", list(not_regular.FOUND))
@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_a_shard_that_is_not_a_regular_file_is_refused_in_one_line(tmp_path: Path, kind: str, how: str) -> None:
    """Not called missing: the message says what is there (a FIFO would block a reader that opened it)."""
    folder = _copy(kind, tmp_path)
    victim = sorted(folder.glob("*-00002-of-00003.*"))[0]
    not_regular.replace(victim, how)
    not_regular.assert_refused_everywhere(folder, victim, how, tmp_path / "out.safetensors")


# -- out: what huggingface_hub writes -----------------------------------------------------------


def _layout(folder: Path) -> tuple[list[str], dict[str, list[str]], dict]:
    """File names, each shard's tensor names (read by safetensors) and the parsed index."""
    shards = {}
    for p in sorted(folder.glob("*.safetensors")):
        with safe_open(p, framework="pt") as f:
            shards[p.name] = sorted(f.keys())
            assert f.metadata()["format"] == "pt"
    index = folder / "model.safetensors.index.json"
    return sorted(p.name for p in folder.iterdir()), shards, json.loads(index.read_text()) if index.exists() else {}


def _tied_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return TiedLM().state_dict()


@pytest.mark.parametrize("size", [100, MAX_SHARD_SIZE, 700, "1KB", "5GB"])
@pytest.mark.parametrize("make", [hf_state_dict, _tied_state], ids=["plain", "tied"])
@pytest.mark.parametrize("source", [".pt", ".safetensors", "legacy"])
def test_the_split_and_index_are_huggingface_hubs(tmp_path: Path, size: int | str, make, source: str) -> None:
    state = make()
    (tmp_path / "hf").mkdir()
    save_torch_state_dict(
        dict(state), tmp_path / "hf", max_shard_size=size
    )  # it drops tied names from what it is given
    src = tmp_path / f"src{source if source != 'legacy' else '.pt'}"
    if source == "legacy":  # read with torch: the torch-side writer
        torch.save({f"module.{k}": v for k, v in state.items()}, src, _use_new_zipfile_serialization=False)
    else:
        ckptkit.write_checkpoint({f"module.{k}": v for k, v in state.items()}, src)
    report = ckptkit.convert_checkpoint(src, tmp_path / "ours", max_shard_size=size)
    assert report.fast == (source != "legacy") and report.destination_format == "hf-sharded"
    assert _layout(tmp_path / "ours") == _layout(tmp_path / "hf")
    if len(list((tmp_path / "hf").iterdir())) > 1:  # the index, byte for byte where the order is fixed
        assert (tmp_path / "ours" / "model.safetensors.index.json").read_text() == (
            tmp_path / "hf" / "model.safetensors.index.json"
        ).read_text()
    model = TiedLM() if make is _tied_state else TinyNet()
    if make is _tied_state:  # huggingface_hub's strict check misses the name it dropped, for its own save too
        for folder in ("hf", "ours"):
            assert load_torch_model(TiedLM(), tmp_path / folder).missing_keys == ["head.weight"]
    load_torch_model(model, tmp_path / "ours", strict=make is not _tied_state)
    for k, v in state.items():
        assert torch.equal(model.state_dict()[k], v), k
    back = ckptkit.read_checkpoint(tmp_path / "ours", map_location="cpu")
    assert_same(dict(sorted(back.items())), dict(sorted(state.items())))  # the index's order: shards, then within each
    if make is _tied_state:
        assert back["head.weight"] is back["embed.weight"]  # re-tied from the index metadata


@pytest.mark.parametrize("open_at_most", [64, 2])
def test_the_shards_are_made_durable_after_all_are_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, open_at_most: int
) -> None:
    """An fsync waits for the disk; syncing each shard before writing the next left the copy
    waiting at every shard. Each file is still synced, before the folder is put in place, and
    through the descriptor that wrote it: a reopened one may miss a failed writeback."""
    from ckptkit.formats.hf import write as hfwrite

    src = tmp_path / "ddp.pt"
    ckptkit.write_checkpoint({f"module.{k}": v for k, v in hf_state_dict().items()}, src)
    events: list[tuple[str, str]] = []
    writers: list[Any] = []

    def open_(path: Path, mode: str) -> object:
        events.append(("write", Path(path).name))
        writers.append(open(path, mode))
        return writers[-1]

    def fsync(fd: int) -> None:
        writer = [Path(f.name).name for f in writers if not f.closed and f.fileno() == fd]
        if writer:
            assert not (tmp_path / "out").exists()  # synced inside the temp folder, before it is renamed
            events.append(("fsync", writer[0]))
        real_fsync(fd)

    real_fsync = os.fsync
    monkeypatch.setattr(hfwrite, "open", open_, raising=False)
    monkeypatch.setattr(hfwrite, "_OPEN_AT_MOST", open_at_most)
    monkeypatch.setattr(os, "fsync", fsync)
    ckptkit.convert_checkpoint(src, tmp_path / "out", max_shard_size=300)
    written = [name for kind, name in events if kind == "write"]
    assert len(written) > 3 and sorted(written) == sorted(p.name for p in (tmp_path / "out").iterdir())
    expected: list[tuple[str, str]] = []
    for i, name in enumerate(written):  # past open_at_most files open, the oldest is synced (and closed)
        expected += [("write", name)] + ([("fsync", written[i - open_at_most])] if i >= open_at_most else [])
    expected += [("fsync", n) for n in written[max(0, len(written) - open_at_most) :]]
    assert events == expected
    assert all(f.closed for f in writers)


@pytest.mark.parametrize("dst", ["out/", "existing", "out"])
def test_which_destinations_are_folders(tmp_path: Path, dst: str) -> None:
    (tmp_path / "existing").mkdir()
    extra = () if dst != "out" else ("--max-shard-size", "300")
    code, stdout, stderr = run("convert", FIXTURES / "ddp.pt", f"{tmp_path}/{dst}", *extra)
    assert code == 0, stderr
    folder = tmp_path / dst.rstrip("/")
    assert folder.is_dir() and run("diff", folder, FIXTURES / "ddp.pt")[0] == 0
    assert ("4 shards" in stdout) == (dst == "out") and (folder / "model.safetensors").is_file() == (dst != "out")


def test_convert_writes_hf_shards_from_hf_shards(tmp_path: Path) -> None:
    code, stdout, stderr = run(
        "convert", HF / "bin", tmp_path / "st", "--max-shard-size", str(MAX_SHARD_SIZE), "--to", "ddp"
    )
    assert code == 0, stderr
    back = ckptkit.read_checkpoint(tmp_path / "st", map_location="cpu")
    assert_same(dict(back), {f"module.{k}": v for k, v in hf_state_dict().items()})
    assert ckptkit.verify_checkpoint(tmp_path / "st").ok


@pytest.mark.parametrize("size", ["5XB", "0", "-3MB", "MB"])
def test_a_bad_size_is_a_usage_error(tmp_path: Path, size: str) -> None:
    code, _, stderr = run("convert", FIXTURES / "ddp.pt", tmp_path / "out", "--max-shard-size", size)
    assert code == 2 and "--max-shard-size 5GB" in stderr and not (tmp_path / "out").exists()
    with pytest.raises(ckptkit.errors.ArgumentError, match="max_shard_size='5GB'"):
        ckptkit.convert_checkpoint(FIXTURES / "ddp.pt", tmp_path / "out", max_shard_size=size)


def test_force_replaces_only_a_folder_of_weights(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run("convert", HF / "safetensors", out, "--max-shard-size", "400")[0] == 0
    code, _, stderr = run("convert", FIXTURES / "ddp.pt", out, "--max-shard-size", "300")
    assert code == 2 and "--force" in stderr
    assert run("convert", FIXTURES / "ddp.pt", out, "--max-shard-size", "300", "--force")[0] == 0
    assert run("diff", out, FIXTURES / "ddp.pt")[0] == 0 and len(list(out.iterdir())) == 5  # the 3-shard set is gone
    (out / "notes.txt").write_text("mine")
    code, _, stderr = run("convert", FIXTURES / "ddp.pt", out, "--force")
    assert code == 2 and "notes.txt" in stderr and (out / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_flipped_bit_in_the_source_fails_and_leaves_no_folder(tmp_path: Path) -> None:
    src = tmp_path / "ddp.pt"
    shutil.copy(FIXTURES / "ddp.pt", src)
    state = torch.load(src, weights_only=True)
    raw = bytearray(src.read_bytes())
    at = raw.find(state["module.fc2.weight"].numpy().tobytes())
    raw[at + 5] ^= 0x10
    src.write_bytes(bytes(raw))
    code, _, stderr = run("convert", src, f"{tmp_path}/out/", "--max-shard-size", "300")
    assert code == 1 and "damaged" in stderr and "module.fc2.weight" in stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ddp.pt"]  # no folder, no temp folder


def test_a_leftover_temp_folder_of_a_dead_writer_is_removed(tmp_path: Path) -> None:
    from ckptkit.io.atomic import temp_path

    stale = temp_path(tmp_path / "out")
    stale.mkdir()
    (stale / "model-00001-of-00002.safetensors").write_bytes(b"half")
    stale.rename(stale.with_name(stale.name.replace(f"-{os.getpid()}-", "-999999999-")))  # no such pid
    assert run("convert", FIXTURES / "ddp.pt", f"{tmp_path}/out/")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("existing", [False, True])
@pytest.mark.parametrize("stop", [KeyboardInterrupt, OSError])
def test_an_interrupted_folder_write_leaves_the_old_folder_or_nothing(
    tmp_path: Path, existing: bool, stop: type[BaseException]
) -> None:
    from ckptkit.io.atomicdir import atomic_folder

    out = tmp_path / "out"
    if existing:
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"old")
    with pytest.raises(KeyboardInterrupt if stop is KeyboardInterrupt else ckptkit.errors.CheckpointWriteError):
        with atomic_folder(out) as tmp:
            (tmp / "model-00001-of-00002.safetensors").write_bytes(b"half")
            raise stop()
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if existing else [])
    assert not existing or [p.read_bytes() for p in out.iterdir()] == [b"old"]


@pytest.mark.parametrize("kind", ["safetensors", "bin"])
def test_one_shard_in_python_warns_naming_its_index(kind: str) -> None:
    shard = sorted((HF / kind).glob("*-00002-of-00003.*"))[0]
    with pytest.warns(UserWarning, match=r"is shard 2 of 3 of a sharded checkpoint: it holds 6 of the 9 tensors"):
        part = ckptkit.read_checkpoint(shard)
    assert len(part) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the whole checkpoint: no warning
        assert len(ckptkit.read_checkpoint(HF / kind)) == 9


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_an_index_naming_an_index_as_its_shard_is_an_error_not_a_recursion(tmp_path: Path, command: str) -> None:
    folder = tmp_path / "loop"
    folder.mkdir()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {"a": "model.safetensors.index.json"}})
    )
    code, stdout, stderr = run(command, folder, *([tmp_path / "o.pt"] if command == "convert" else []))
    assert code == 1 and "Traceback" not in stderr and "RecursionError" not in stdout + stderr
    said = stdout + stderr
    assert "is not a file of tensors" in said or "is not a shard" in said  # (verify's text shortens long paths)
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="is not a file of tensors"):
        ckptkit.read_checkpoint(folder)


def test_a_single_file_folder_takes_only_alias_entries_from_its_metadata(tmp_path: Path) -> None:
    """huggingface_hub's single file records {"format": "pt"}; a tensor named "pt" made "format" look
    like a tied alias of it."""
    from safetensors.torch import save_file

    folder = tmp_path / "one"
    folder.mkdir()
    save_file({"pt": torch.ones(2), "w": torch.zeros(3)}, folder / "model.safetensors", metadata={"format": "pt"})
    assert list(ckptkit.read_checkpoint(folder)) == ["pt", "w"]
    ckptkit.convert_checkpoint(folder, tmp_path / "o.pt")
    assert list(torch.load(tmp_path / "o.pt", weights_only=True)) == ["pt", "w"]


def test_a_file_output_over_a_source_shard_is_refused(tmp_path: Path) -> None:
    folder = _copy("safetensors", tmp_path)
    shard = folder / "model-00001-of-00003.safetensors"
    before = shard.read_bytes()
    for src in (folder, folder / "model.safetensors.index.json"):
        code, _, stderr = run("convert", src, shard, "--force")
        assert code == 2 and f"{shard} is a file of the source" in stderr
    assert shard.read_bytes() == before


def test_a_symlinked_output_folder_is_refused_and_left_alone(tmp_path: Path) -> None:
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    code, _, stderr = run("convert", FIXTURES / "ddp.pt", link, "--max-shard-size", "2KB")
    assert code == 2 and "is a symbolic link; give the folder it points to" in stderr
    assert (
        link.is_symlink()
        and list(real.iterdir()) == []
        and sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    )


def test_a_key_in_two_shards_is_an_error_not_the_later_one(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    folder = tmp_path / "dup"
    folder.mkdir()
    save_file({"a": torch.ones(1), "b": torch.ones(1)}, folder / "model-00001-of-00002.safetensors")
    save_file({"b": torch.zeros(1)}, folder / "model-00002-of-00002.safetensors")
    index = {
        "metadata": {},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match=r"key b is in 2 shards"):
        ckptkit.read_checkpoint(folder)
    assert run("verify", folder)[0] == 1


def test_pt_to_shards_and_back_never_imports_torch(tmp_path: Path) -> None:
    from tests.torchfree import run_torch_free

    hf = tmp_path / "hf"
    proc, imported_torch = run_torch_free(
        ["convert", FIXTURES / "ddp.pt", f"{hf}/", "--max-shard-size", "1KB"], ["convert", hf, tmp_path / "back.pt"]
    )
    assert proc.returncode == 0, proc.stderr
    assert not imported_torch
    assert len(list(hf.glob("model-*-of-*.safetensors"))) > 1
    assert_same(
        torch.load(tmp_path / "back.pt", weights_only=True), torch.load(FIXTURES / "plain.pt", weights_only=True)
    )


def test_an_index_of_another_name_converts(tmp_path: Path) -> None:
    """diffusers names its index diffusion_pytorch_model.safetensors.index.json: convert reads the
    index it is given, and measures that one."""
    import json

    from safetensors.torch import save_file

    state = {"a.w": torch.arange(6.0), "b.w": torch.ones(2, 2)}
    save_file({"a.w": state["a.w"]}, tmp_path / "part-1.safetensors")
    save_file({"b.w": state["b.w"]}, tmp_path / "part-2.safetensors")
    index = tmp_path / "diffusion_pytorch_model.safetensors.index.json"
    total = sum(t.numel() * t.element_size() for t in state.values())
    weight_map = {"a.w": "part-1.safetensors", "b.w": "part-2.safetensors"}
    index.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    seen: list[int] = []
    report = ckptkit.convert_checkpoint(index, tmp_path / "one.safetensors", progress=lambda n, of: seen.append(of))
    on_disk = index.stat().st_size + sum(p.stat().st_size for p in tmp_path.glob("part-*"))
    assert report.tensors == 2 and set(seen) == {on_disk}
    got = ckptkit.read_checkpoint(tmp_path / "one.safetensors", map_location="cpu")
    assert {k: torch.equal(v, state[k]) for k, v in got.items()} == dict.fromkeys(state, True)


def test_an_index_nested_100000_deep_is_one_error(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"metadata": ' + "[" * 100_000 + "]" * 100_000 + ', "weight_map": {}}'
    )
    report = ckptkit.verify_checkpoint(tmp_path)
    assert not report.ok and "RecursionError" in report.checks[-1].detail
    result = CliRunner().invoke(main, ["inspect", str(tmp_path)])
    assert result.exit_code == 1 and result.stderr.count("\n") == 1 and "must be JSON" in result.stderr, result.output


# torchao's description of its quantized tensors, as transformers' save_pretrained writes it in every
# shard's header: without it, from_pretrained cannot rebuild the Int8Tensor (finding 4 of issue 35).
TORCHAO_META = {
    "format": "pt",
    "tensor_names": '["a.weight", "b.weight"]',
    "a.weight": '{"_type": "Int8Tensor", "_data": {"block_size": [1, 4]}, "_tensor_data_names": ["qdata", "scale"]}',
    "b.weight": '{"_type": "torch.Tensor"}',
}


@pytest.mark.parametrize("out", ["folder", "shards", "file"])
def test_the_shards_safetensors_metadata_travels_to_every_output(tmp_path: Path, out: str) -> None:
    from safetensors.torch import save_file

    src = tmp_path / "src"
    src.mkdir()
    tensors = {"a._weight_qdata": torch.ones(4, 4, dtype=torch.int8), "a._weight_scale": torch.ones(4)}
    save_file(tensors, src / "model-00001-of-00002.safetensors", metadata=TORCHAO_META)
    save_file({"b.weight": torch.zeros(3)}, src / "model-00002-of-00002.safetensors", metadata=TORCHAO_META)
    weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors} | {
        "b.weight": "model-00002-of-00002.safetensors"
    }
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 32}, "weight_map": weight_map})
    )
    given = {"folder": f"{tmp_path}/out/", "shards": f"{tmp_path}/shards", "file": f"{tmp_path}/one.safetensors"}[out]
    report = ckptkit.convert_checkpoint(src, given, max_shard_size=20 if out == "shards" else None)
    dest = Path(given)
    files = sorted(dest.glob("*.safetensors")) if out != "file" else [dest]
    assert len(files) == {"folder": 1, "shards": 3, "file": 1}[out], files
    for f in files:
        with safe_open(f, "pt") as st:
            meta = st.metadata()
        assert {k: meta.get(k) for k in TORCHAO_META} == TORCHAO_META, (f.name, meta)
    assert not [n for n in report.notes if "metadata" in n], report.notes


def test_renamed_weights_say_that_the_metadata_kept_the_source_names(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"module.b.weight": torch.zeros(3)}, src := tmp_path / "m.safetensors", metadata=TORCHAO_META)
    report = ckptkit.convert_checkpoint(src, f"{tmp_path}/out/")
    assert any("safetensors metadata (a.weight, b.weight ... and 1 more)" in n for n in report.notes), report.notes


def test_diffusers_own_sharded_unet_reads_as_diffusers_loads_it(tmp_path: Path) -> None:
    from tests.formats.test_producers import _framework

    unet = Path(__file__).resolve().parents[2] / "fixtures" / "frameworks" / "diffusers" / "unet"
    got = ckptkit.read_checkpoint(unet)
    out = tmp_path / "unet"
    out.mkdir()
    ckptkit.convert_checkpoint(unet, out / "diffusion_pytorch_model.safetensors")  # one file, as diffusers names it
    shutil.copy(unet / "config.json", out)
    shard = unet / "diffusion_pytorch_model-00002-of-00005.safetensors"
    code, _, stderr = run("convert", shard, tmp_path / "one.safetensors")
    assert "shard 2 of 5" in stderr and "diffusion_pytorch_model.safetensors.index.json" in stderr, stderr
    diffusers = _framework("diffusers")
    want = diffusers.UNet2DModel.from_pretrained(unet).state_dict()
    assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    merged = diffusers.UNet2DModel.from_pretrained(out).state_dict()
    assert all(torch.equal(merged[k], v) for k, v in want.items())
