"""s3:// wherever a path goes, against a local S3 server (moto): round trips exact to the bit,
commits that are one PUT or a completed multipart upload, and failures that leave nothing.

Needs moto and s3fs (``pip install 'ckptkit[s3]' moto``); skipped without them.
"""

from __future__ import annotations

import io
import json
import os
import platform
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptkit
from ckptkit.io import records, remote
from tests.cli.test_exits import lines, run
from tests.conftest import ROOT

moto_server = pytest.importorskip("moto.server", reason="moto is not installed: the tests need a local S3 server")
s3fs = pytest.importorskip("s3fs", reason="s3fs is not installed: pip install 'ckptkit[s3]'")
boto3 = pytest.importorskip("boto3", reason="boto3 (moto's dependency) is not installed")
from tests import s3stores  # noqa: E402 - moto first, or skip

BUCKET = "ckptkit-test"
ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


# Whether each endpoint's store checks and echoes checksums (:mod:`tests.s3stores`).
_CHECKS: dict[str, bool] = {}


@pytest.fixture(scope="session", params=[True, False], ids=["moto", "moto-without-checksums"])
def s3_endpoint(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each S3 test runs against both stores: one that checks the CRC-32 a commit declares, one
    that ignores it (then ckptkit reads the object back)."""
    server, endpoint = s3stores.start(checksums=request.param)
    _CHECKS[endpoint] = request.param
    s3fs.S3FileSystem.clear_instance_cache()  # one made for the other store would keep its endpoint
    # botocore reads AWS_ENDPOINT_URL itself, so the CLI's subprocesses find the server too
    saved = {k: os.environ.get(k) for k in [*ENV, "AWS_ENDPOINT_URL"]}
    os.environ.update(ENV, AWS_ENDPOINT_URL=endpoint)
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def prefix(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A fresh s3:// prefix; parts of 5 MiB (S3's least) so a 12 MiB tensor takes three parts."""
    monkeypatch.setattr(remote, "PART_SIZE", 5 << 20)
    monkeypatch.setenv("CKPTKIT_STAGING", str(tmp_path / "staging"))
    (tmp_path / "staging").mkdir()
    return f"s3://{BUCKET}/{uuid.uuid4().hex}"


@pytest.fixture
def checked_by(s3_endpoint: str) -> str:
    """How this store's commits are checked, as the report says it."""
    return "the store's CRC-32 of the whole object" if _CHECKS[s3_endpoint] else "reading the object back"


def _fs() -> Any:
    fs = s3fs.S3FileSystem()
    fs.invalidate_cache()
    return fs


def _client(endpoint: str) -> Any:
    return boto3.client("s3", endpoint_url=endpoint)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "module.fc.weight": torch.randn(3 << 20, generator=g),
        "module.fc.bias": torch.randn(7, generator=g),
        "module.steps": torch.arange(5),
    }


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _unfinished_uploads(endpoint: str, key_prefix: str) -> list[str]:
    found = _client(endpoint).list_multipart_uploads(Bucket=BUCKET, Prefix=key_prefix)
    return [u["Key"] for u in found.get("Uploads", [])]


def _key(url: str) -> str:
    return url.removeprefix(f"s3://{BUCKET}/")


# -- round trips ---------------------------------------------------------------------------


def test_convert_s3_to_local_and_local_to_s3_is_exact(prefix: str, tmp_path: Path) -> None:
    state = _state()
    torch.save(state, tmp_path / "ddp.pt")
    _fs().put_file(str(tmp_path / "ddp.pt"), f"{prefix}/ddp.pt")  # uploaded by another tool: no ckptkit CRC
    code, out, err = run("convert", f"{prefix}/ddp.pt", tmp_path / "single.pt")
    assert code == 0, err
    single = torch.load(tmp_path / "single.pt", weights_only=True)
    assert _equal(single, {k.removeprefix("module."): v for k, v in state.items()})
    code, out, err = run("convert", tmp_path / "single.pt", f"{prefix}/back.pt", "--to", "ddp")
    assert code == 0, err
    assert out.startswith(f"{prefix}/back.pt: 3 tensors")
    info = _fs().info(f"{prefix}/back.pt")
    assert info["ETag"].endswith('-3"')  # a multipart upload, three 5 MiB parts
    _fs().get_file(f"{prefix}/back.pt", str(tmp_path / "back.pt"))
    assert _equal(torch.load(tmp_path / "back.pt", weights_only=True), state)
    assert not list((tmp_path / "staging").iterdir())  # staging files removed
    code, _, err = run("convert", tmp_path / "single.pt", f"{prefix}/back.pt")
    assert code == 2 and lines(err) == [f"ckptkit: error: {prefix}/back.pt exists; pass --force to replace it"]


def test_inspect_verify_and_diff_read_urls(prefix: str, tmp_path: Path) -> None:
    state = _state()
    ckptkit.save_on_master(state, f"{prefix}/a.pt")
    ckptkit.save_on_master({k.removeprefix("module."): v for k, v in state.items()}, tmp_path / "b.pt")
    code, out, err = run("inspect", f"{prefix}/a.pt", "--json")
    assert code == 0, err
    assert f'"path": "{prefix}/a.pt"' in out and '"module."' in out
    code, out, err = run("verify", f"{prefix}/a.pt")
    assert code == 0, out + err
    assert ckptkit.verify_checkpoint(f"{prefix}/a.pt").ok
    assert run("diff", f"{prefix}/a.pt", tmp_path / "b.pt")[0] == 0
    ckptkit.save_on_master(_state(1), f"{prefix}/c.pt")
    assert run("diff", f"{prefix}/a.pt", f"{prefix}/c.pt")[0] == 1
    for command, code_wanted in (("inspect", 1), ("verify", 1), ("diff", 2)):
        args = [f"{prefix}/missing.pt"] + ([tmp_path / "b.pt"] if command == "diff" else [])
        code, out, err = run(command, *args)
        assert code == code_wanted, (command, out, err)
        assert "Traceback" not in err and f"{prefix}/missing.pt: no such object" in out + err
    report = ckptkit.verify_checkpoint(f"{prefix}/missing.pt")
    assert isinstance(report.error, ckptkit.errors.CheckpointNotFoundError) and report.path == f"{prefix}/missing.pt"


def test_save_on_master_and_load_for_rank_round_trip(prefix: str, tmp_path: Path) -> None:
    model = torch.nn.Linear(4, 3)
    ckptkit.save_on_master({"model": model.state_dict(), "step": 7}, f"{prefix}/ckpt.pt")
    assert int(_fs().metadata(f"{prefix}/ckpt.pt")[remote.CRC_KEY], 16) == remote.crc32(
        _fs().cat_file(f"{prefix}/ckpt.pt")
    )
    fresh = torch.nn.Linear(4, 3)
    obj = ckptkit.load_for_rank(f"{prefix}/ckpt.pt", model=fresh, map_location="cpu", verify=True)
    assert obj["step"] == 7 and _equal(fresh.state_dict(), model.state_dict())
    with pytest.raises(ckptkit.errors.StateDictMismatchError, match=f"{prefix}/ckpt.pt") as info:
        ckptkit.load_for_rank(f"{prefix}/ckpt.pt", model=torch.nn.Linear(5, 3))
    assert "ckptkit-stage" not in str(info.value)
    assert not list((tmp_path / "staging").iterdir())


def test_a_damaged_object_fails_its_recorded_crc(prefix: str, s3_endpoint: str) -> None:
    url = f"{prefix}/ckpt.pt"
    ckptkit.save_on_master(_state(), url)
    good = _fs().cat_file(url)
    data = bytearray(good)
    data[len(data) // 2] ^= 1
    # Bit rot in the store: the bytes change, what was recorded of them does not. A PUT makes
    # moto compute its checksum anew, so the record goes back as ckptkit's own metadata.
    meta = {remote.CRC_KEY: f"{zlib.crc32(good):08x}"}
    _client(s3_endpoint).put_object(Bucket=BUCKET, Key=_key(url), Body=bytes(data), Metadata=meta)
    with pytest.raises(
        ckptkit.errors.CheckpointFormatError, match=f"{url}: its bytes have CRC-32 .* but ckptkit recorded"
    ):
        ckptkit.read_checkpoint(url)
    assert not ckptkit.verify_checkpoint(url).ok


def test_checkpoint_folder_on_a_url_commits_points_and_prunes(prefix: str) -> None:
    folder = ckptkit.CheckpointFolder(f"{prefix}/run", keep=2)
    for step in (1, 2, 3):
        path = folder.path_for(step)
        ckptkit.save_on_master({"w": torch.full((4,), float(step))}, path)
        folder.commit(path)
    assert folder.checkpoints() == [f"{prefix}/run/step_000000002.pt", f"{prefix}/run/step_000000003.pt"]
    assert folder.latest() == f"{prefix}/run/step_000000003.pt"
    assert _fs().cat_file(f"{prefix}/run/latest") == b"step_000000003.pt\n"
    assert torch.equal(ckptkit.read_checkpoint(folder.latest(full=True))["w"], torch.full((4,), 3.0))
    with pytest.raises(ckptkit.errors.CheckpointNotFoundError, match="does not exist"):
        folder.commit(folder.path_for(9))
    with pytest.raises(ckptkit.errors.ArgumentError, match="is not in"):
        folder.commit(f"{prefix}/elsewhere/step_000000004.pt")


def test_a_url_without_fsspec_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "fsspec", None)  # import fsspec now raises ImportError
    with pytest.raises(ckptkit.errors.ArgumentError, match=r"pip install 'ckptkit\[s3\]'"):
        ckptkit.read_checkpoint("s3://bucket/ckpt.pt")
    assert "pip install 'ckptkit[s3]'" in str(ckptkit.verify_checkpoint("s3://bucket/ckpt.pt").error)
    code, out, err = run("verify", "s3://bucket/ckpt.pt")  # rich must print "[s3]" as text, not read it as markup
    assert (
        code == 1 and "URLs need fsspec (and s3fs for s3://), which is not installed; pip install 'ckptkit[s3]'" in out
    )
    assert "Traceback" not in out + err
    code, _, err = run("inspect", "s3://bucket/ckpt.pt")
    assert code == 2 and len(lines(err)) == 1 and "pip install 'ckptkit[s3]'" in err


# -- faults: nothing partial is ever visible -------------------------------------------------


def _on_call(monkeypatch: pytest.MonkeyPatch, before: Any) -> None:
    """``before(method, kwargs)`` runs before each S3 call s3fs makes (it may raise, or stop the server)."""
    call = s3fs.core.S3FileSystem._call_s3

    async def patched(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        before(method, kwargs)
        return await call(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", patched)


def _fail_part(monkeypatch: pytest.MonkeyPatch, at: int) -> None:
    """The upload's part ``at`` fails, as a dropped connection would."""

    def failing(method: str, kwargs: dict[str, Any]) -> None:
        if method == "upload_part" and kwargs.get("PartNumber", 0) >= at:
            raise OSError("injected: connection reset during upload_part")

    _on_call(monkeypatch, failing)


def test_an_upload_failing_midway_leaves_no_object_and_latest_unchanged(
    prefix: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = ckptkit.CheckpointFolder(f"{prefix}/run", keep=2)
    ckptkit.save_on_master(_state(1), folder.path_for(1))
    folder.commit(folder.path_for(1))
    _fail_part(monkeypatch, 2)
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match=f"cannot write {folder.path_for(2)}: .*injected"):
        ckptkit.save_on_master(_state(2), folder.path_for(2))
    assert not _fs().exists(folder.path_for(2))
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []  # aborted, not left open (nor completed)
    assert folder.checkpoints() == [folder.path_for(1)] and folder.latest() == folder.path_for(1)
    assert _fs().cat_file(f"{prefix}/run/latest") == b"step_000000001.pt\n"


def test_convert_force_with_a_failed_upload_keeps_the_old_object(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckptkit.save_on_master(_state(1), f"{prefix}/out.pt")
    before = _fs().cat_file(f"{prefix}/out.pt")
    torch.save(_state(2), tmp_path / "new.pt")
    _fail_part(monkeypatch, 2)
    code, out, err = run("convert", tmp_path / "new.pt", f"{prefix}/out.pt", "--force")
    assert code == 1 and len(lines(err)) == 1 and "Traceback" not in err
    assert f"cannot write {prefix}/out.pt" in err and "untouched" in err
    assert _fs().cat_file(f"{prefix}/out.pt") == before


def test_an_upload_never_completed_is_no_checkpoint(prefix: str, s3_endpoint: str) -> None:
    folder = ckptkit.CheckpointFolder(f"{prefix}/run")
    ckptkit.save_on_master(_state(1), folder.path_for(1))
    folder.commit(folder.path_for(1))
    client, key = _client(s3_endpoint), _key(str(folder.path_for(5)))
    mpu = client.create_multipart_upload(Bucket=BUCKET, Key=key)
    client.upload_part(Bucket=BUCKET, Key=key, UploadId=mpu["UploadId"], PartNumber=1, Body=b"\0" * (5 << 20))
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == [key]
    assert folder.checkpoints() == [folder.path_for(1)]
    assert folder.latest() == folder.path_for(1)
    with pytest.raises(ckptkit.errors.CheckpointNotFoundError):
        folder.commit(folder.path_for(5))
    assert _fs().cat_file(f"{prefix}/run/latest") == b"step_000000001.pt\n"


_KILLED_CHILD = """
import pathlib, sys, time
import s3fs, torch
import ckptkit
from ckptkit.io import remote
remote.PART_SIZE = 5 << 20
ready, url = pathlib.Path(sys.argv[1]), sys.argv[2]
call = s3fs.core.S3FileSystem._call_s3
async def blocking(self, method, *args, **kwargs):
    if method == "upload_part" and kwargs["PartNumber"] == 2:
        ready.write_text("part 2")  # the upload is under way
        time.sleep(600)  # blocks s3fs's event loop: no other part completes either
    return await call(self, method, *args, **kwargs)
s3fs.core.S3FileSystem._call_s3 = blocking
ckptkit.save_on_master({"w": torch.ones(3 << 20)}, url)
"""


@pytest.mark.slow
def test_a_writer_killed_mid_upload_leaves_nothing(prefix: str, s3_endpoint: str, tmp_path: Path) -> None:
    folder = ckptkit.CheckpointFolder(f"{prefix}/run")
    ckptkit.save_on_master(_state(1), folder.path_for(1))
    folder.commit(folder.path_for(1))
    ready = tmp_path / "ready"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_CHILD), str(ready), str(folder.path_for(2))],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == [_key(str(folder.path_for(2)))]  # killed mid-upload
    assert not _fs().exists(folder.path_for(2))
    assert folder.checkpoints() == [folder.path_for(1)] and folder.latest() == folder.path_for(1)
    assert _fs().cat_file(f"{prefix}/run/latest") == b"step_000000001.pt\n"


# -- the trainer: checkpoints in the store, the log in a local folder -------------------------


def _train(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    cmd = [
        sys.executable,
        "-m",
        "ckptkit.cli",
        "train",
        "--nproc",
        "2",
        "--data",
        "tests.train_data:small",
        "--batch-size",
        "16",
        "--save-every",
        "3",
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # three 2-process trainer runs
def test_the_trainer_saves_to_and_resumes_from_a_url_exactly(prefix: str, tmp_path: Path) -> None:
    """ckptkit train --out s3://...: checkpoints, latest and model.safetensors in the store; a stopped run
    resumes from there and ends with the weights of a run that never stopped."""
    whole = _train(tmp_path, "--out", "whole", "--max-steps", "9")
    assert whole.returncode == 0, whole.stderr
    first = _train(tmp_path, "--out", f"{prefix}/run", "--log-dir", "log", "--max-steps", "6")
    assert first.returncode == 0, first.stderr
    again = _train(tmp_path, "--out", f"{prefix}/run", "--log-dir", "log", "--max-steps", "9")
    assert again.returncode == 0, again.stderr
    assert f"resumed from step 6 (checkpoint {prefix}/run/checkpoints/step_000000006.pt)" in again.stdout
    assert _fs().cat_file(f"{prefix}/run/checkpoints/latest") == b"step_000000009.pt\n"
    assert not (tmp_path / "s3:").exists() and (tmp_path / "log" / "metrics.jsonl").is_file()
    from safetensors.torch import load_file

    with remote.staged_read(f"{prefix}/run/model.safetensors") as local:
        resumed = load_file(local)
    assert _equal(resumed, load_file(tmp_path / "whole" / "model.safetensors"))


def test_a_url_out_without_a_log_dir_is_one_usage_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = run("train", "--out", "s3://bucket/runs/demo")
    assert code == 2 and lines(err) == [
        "ckptkit: error: argument --out s3://bucket/runs/demo: an object store cannot append to "
        "metrics.jsonl; also pass a local folder for the log, e.g. --log-dir runs/demo"
    ], err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", ["inspect", "verify", "convert"])
def test_a_store_without_credentials_is_one_line_naming_them(s3_endpoint: str, tmp_path: Path, command: str) -> None:
    """botocore's NoCredentialsError is no OSError: it reached the user as a traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(
        AWS_ENDPOINT_URL=s3_endpoint,
        AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
        AWS_CONFIG_FILE=str(tmp_path / "none"),
        PYTHONPATH=str(ROOT / "src"),
        AWS_EC2_METADATA_DISABLED="true",
    )
    args = [command, f"s3://{BUCKET}/x.pt"] + (["out.pt"] if command == "convert" else [])
    proc = subprocess.run(
        [sys.executable, "-m", "ckptkit.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    said = f"s3://{BUCKET}/x.pt: the store refused to describe it (Unable to locate credentials); check the URL, credentials and network"
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert said in (proc.stdout if command == "verify" else proc.stderr)
    assert not (tmp_path / "out.pt").exists()


# Was: refused ("ckptkit writes single objects to URLs, not folders").
@pytest.mark.parametrize(
    ("options", "published"),
    [({"max_shard_size": "5MB"}, "model.safetensors.index.json"), ({"format": "dcp"}, ".metadata")],
    ids=["hf_shards", "dcp"],
)
def test_a_folder_output_round_trips_through_a_prefix_its_index_last(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, str], published: str
) -> None:
    torch.save(_state(), tmp_path / "ddp.pt")
    made = _calls(monkeypatch)
    report = ckptkit.convert_checkpoint(tmp_path / "ddp.pt", f"{prefix}/out/", **options)
    names = (
        ckptkit.io.remote.list_names(f"{prefix}/out")
        if False
        else sorted(n.rsplit("/", 1)[-1] for n in _fs().ls(f"{prefix}/out"))
    )
    assert published in names and len(names) >= 2, names
    keys = [k["Key"].rsplit("/", 1)[-1] for m, k in made if m in ("put_object", "create_multipart_upload")]
    assert keys[-1] == published and sorted(keys) == names, keys  # every file once, the index last
    said = [n for n in report.notes if n.startswith(f"{prefix}/out/: ")]
    assert sum(int(n.split(": ")[1].split(" ")[0]) for n in said) == len(names), report.notes  # each file, by its check
    want = {k.removeprefix("module."): v for k, v in _state().items()}
    assert _equal(ckptkit.read_checkpoint(f"{prefix}/out"), want)  # a prefix reads as its folder
    code, out, err = run("convert", f"{prefix}/out", tmp_path / "back.safetensors")
    assert code == 0, err
    assert _equal(ckptkit.read_checkpoint(tmp_path / "back.safetensors"), want)
    code, _, err = run("convert", tmp_path / "ddp.pt", f"{prefix}/out/", "--max-shard-size", "5MB")
    assert code == 2 and lines(err) == [f"ckptkit: error: {prefix}/out/ holds objects; pass --force to replace it"]


def test_a_folder_whose_shard_fails_to_upload_publishes_no_index(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(_state(), tmp_path / "ddp.pt")
    ckptkit.convert_checkpoint(tmp_path / "ddp.pt", f"{prefix}/out/", max_shard_size="5MB")
    _fail_part(monkeypatch, 2)  # the first shard of more than one part fails
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="injected.*the folder is unpublished"):
        ckptkit.convert_checkpoint(tmp_path / "ddp.pt", f"{prefix}/out/", max_shard_size="5MB", to="ddp", force=True)
    names = [n.rsplit("/", 1)[-1] for n in _fs().ls(f"{prefix}/out")]
    assert "model.safetensors.index.json" not in names, names  # the old one went first; no new one was written
    with pytest.raises(ckptkit.errors.CkptkitError):
        ckptkit.read_checkpoint(f"{prefix}/out")


# Found in review: --force over a prefix left the earlier folder's files, and a later read returned them.
@pytest.mark.parametrize("first", ["dcp", "more_shards"])
def test_force_over_a_folder_prefix_leaves_only_the_new_folder(prefix: str, tmp_path: Path, first: str) -> None:
    torch.save(_state(0), tmp_path / "old.pt")
    torch.save(_state(1), tmp_path / "new.pt")
    url = f"{prefix}/out/"
    if first == "dcp":
        ckptkit.convert_checkpoint(tmp_path / "old.pt", url, format="dcp")
    else:
        ckptkit.convert_checkpoint(tmp_path / "old.pt", url, max_shard_size="4MB")
    _fs().pipe_file(f"{prefix}/out/notes.txt", b"mine")  # not a checkpoint file: left alone
    before = {n.rsplit("/", 1)[-1] for n in _fs().ls(url)}
    ckptkit.convert_checkpoint(tmp_path / "new.pt", url, max_shard_size="12MB", force=True)
    after = {n.rsplit("/", 1)[-1] for n in _fs().ls(url)}
    want = {k.removeprefix("module."): v for k, v in _state(1).items()}
    assert _equal(ckptkit.read_checkpoint(f"{prefix}/out"), want)
    assert "notes.txt" in after and ".metadata" not in after, after
    assert not [n for n in after - before if not n.endswith((".safetensors", ".json"))], (before, after)
    assert len([n for n in after if n.endswith(".safetensors")]) == 2, after  # the earlier shards removed


# Found in review: a reader copying a prefix while a writer replaced its files could mix two folders.
def test_a_prefix_that_changes_while_it_is_read_is_refused(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.save(_state(), tmp_path / "ddp.pt")
    ckptkit.convert_checkpoint(tmp_path / "ddp.pt", f"{prefix}/out/", max_shard_size="5MB")
    done: list[str] = []

    def writer(method: str, kwargs: dict[str, Any]) -> None:
        if method == "get_object" and not done:  # a writer replaces a file while the reader copies
            _client(s3_endpoint).put_object(
                Bucket=BUCKET, Key=f"{_key(prefix)}/out/model.safetensors.index.json", Body=b"{}"
            )
            done.append(method)

    _on_call(monkeypatch, writer)
    with pytest.raises(ckptkit.errors.StorageError, match="changed while they were read"):
        ckptkit.read_checkpoint(f"{prefix}/out")


def test_an_unknown_folder_format_is_a_usage_error_not_a_key_error(tmp_path: Path) -> None:
    torch.save(_state(), tmp_path / "m.pt")
    with pytest.raises(ckptkit.errors.ArgumentError, match="format must be"):
        ckptkit.convert_checkpoint(tmp_path / "m.pt", f"{tmp_path}/out/", format="DCP")  # type: ignore[arg-type]


# -- one writer per folder in a store: conditional PUTs on the writer record --------------------


def test_the_writer_record_is_written_only_on_its_condition(prefix: str) -> None:
    """If-None-Match: * creates, If-Match: <ETag> replaces; the store refuses either once another wrote."""
    url = f"{prefix}/run/.ckptkit-writer"
    first = records.put_record(url, b"a", if_match=None)
    assert first is not None and records.put_record(url, b"b", if_match=None) is None
    second = records.put_record(url, b"c", if_match=first)
    assert second is not None and second != first
    assert records.put_record(url, b"d", if_match=first) is None  # a writer holding a stale view loses
    assert records.read_record(url) == (b"c", second)
    records.delete_record(url, first)  # not the version there: left alone
    assert records.read_record(url) == (b"c", second)
    records.delete_record(url, second)
    assert records.read_record(url) is None


def test_a_url_folder_refuses_a_second_writer_and_takes_over_a_killed_one(prefix: str) -> None:
    from tests.ops.test_folder import _ask, _writer

    url = f"{prefix}/run"
    killed = _writer(url)
    try:
        assert _ask(killed, 1) == "committed 1"
        folder = ckptkit.CheckpointFolder(url, keep=1)
        with pytest.raises(ckptkit.errors.CheckpointWriteError) as info:
            folder.path_for(2)
        assert (
            f"cannot write to {url}: another writer holds it (host {platform.node()}, pid {killed.pid}, since "
            in str(info.value)
        )
    finally:
        killed.send_signal(signal.SIGKILL)
        killed.wait()
    assert json.loads(_fs().cat_file(f"{url}/.ckptkit-writer"))["pid"] == killed.pid  # kill -9 cleans nothing
    ckptkit.save_on_master({"step": torch.tensor(2)}, folder.path_for(2))
    folder.commit(folder.path_for(2))
    assert json.loads(_fs().cat_file(f"{url}/.ckptkit-writer"))["pid"] == os.getpid()
    assert folder.checkpoints() == [f"{url}/step_000000002.pt"]


def test_a_url_folder_of_a_writer_on_another_host_is_held_until_its_lease_runs_out(prefix: str) -> None:
    url = f"{prefix}/run"

    def record(expires: float) -> None:
        holder = dict(host="other-node", tag="other-node", pid=1, since="2026-01-02T03:04:05+00:00", expires=expires)
        _fs().pipe_file(f"{url}/.ckptkit-writer", json.dumps({**holder, "token": "feedface"}).encode())

    record(time.time() + 600)
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match=r"another writer holds it \(host other-node, pid 1,"):
        ckptkit.CheckpointFolder(url).path_for(1)
    record(time.time() - 1)
    folder = ckptkit.CheckpointFolder(url)
    ckptkit.save_on_master({"w": torch.ones(2)}, folder.path_for(1))
    folder.commit(folder.path_for(1))
    assert json.loads(_fs().cat_file(f"{url}/.ckptkit-writer"))["host"] == platform.node()
    with folder.open_latest() as local:  # a staging copy of its own: the writer's pruning cannot pull it away
        assert local is not None and local.name == "step_000000001.pt"
        assert torch.equal(ckptkit.read_checkpoint(local)["w"], torch.ones(2))


# -- killed writers leave nothing that grows ---------------------------------------------------


# Was: each kill -9 left its staging folder (no host or pid in its name, never cleaned) and an
# open multipart upload, stored and billed.
@pytest.mark.slow  # a writer process, killed
def test_the_next_write_cleans_what_a_killed_uploader_left(prefix: str, s3_endpoint: str, tmp_path: Path) -> None:
    url = f"{prefix}/run/step_000000002.pt"
    ready = tmp_path / "ready"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED_CHILD), str(ready), url],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    while not ready.exists():
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    left = list((tmp_path / "staging").iterdir())
    assert len(left) == 1 and f"-{proc.pid}-" in left[0].name  # tagged by host and pid
    assert _unfinished_uploads(s3_endpoint, _key(url)) == [_key(url)]
    ckptkit.save_on_master(_state(2), url)  # the next write to that key
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []
    assert not list((tmp_path / "staging").iterdir())
    assert _equal(ckptkit.read_checkpoint(url), _state(2))


# -- the endpoint lost mid-upload -----------------------------------------------------------------


@pytest.fixture
def lost_endpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, str]]:
    """A server of its own, for a test that stops it; s3fs's cached filesystems forgotten around it."""
    server, endpoint = s3stores.start()
    monkeypatch.setattr(remote, "PART_SIZE", 5 << 20)
    monkeypatch.setenv("CKPTKIT_STAGING", str(tmp_path))
    with monkeypatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", endpoint)
        m.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries of a refused connection would take seconds
        for k, v in ENV.items():
            m.setenv(k, v)
        s3fs.S3FileSystem.clear_instance_cache()
        _client(endpoint).create_bucket(Bucket=BUCKET)
        try:
            yield server, f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt.pt"
        finally:
            server.stop()
    s3fs.S3FileSystem.clear_instance_cache()


# Was: 166 lines ending in botocore's EndpointConnectionError, which is not an OSError.
def test_losing_the_endpoint_mid_upload_is_one_line_naming_the_url(
    lost_endpoint: tuple[Any, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server, url = lost_endpoint
    torch.save(_state(), tmp_path / "ddp.pt")

    def losing(method: str, kwargs: dict[str, Any]) -> None:
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            server.stop()  # the store goes away between two parts: a real refused connection follows

    _on_call(monkeypatch, losing)
    code, out, err = run("convert", tmp_path / "ddp.pt", url)
    assert code == 1 and "Traceback" not in err and len(lines(err)) == 1, err
    assert lines(err)[0].startswith(f"ckptkit: error: cannot write {url}: Could not connect to the endpoint URL")
    assert "untouched" in err


# Was: botocore's legacy retry mode: a refused connection was retried 4 times with growing waits,
# and an unreachable endpoint took about 12 s to name.
@pytest.mark.parametrize(
    ("env", "profile", "mode"),
    [
        ({}, "", "standard"),  # the AWS CLI v2's mode: 3 attempts
        ({"AWS_RETRY_MODE": "legacy"}, "", None),  # what the user set wins: nothing passed
        ({"AWS_MAX_ATTEMPTS": "7"}, "", None),
        ({}, "retry_mode = adaptive\n", None),
    ],
)
def test_the_retry_mode_is_the_aws_clis_unless_the_user_set_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], profile: str, mode: str | None
) -> None:
    (tmp_path / "config").write_text("[default]\n" + profile)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "config"))
    for k in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s3fs.S3FileSystem.clear_instance_cache()
    fs, _ = remote.filesystem(f"s3://{BUCKET}/k")
    assert fs.config_kwargs.get("retries", {}).get("mode") == mode
    s3fs.S3FileSystem.clear_instance_cache()


# -- the commit check: the store's CRC-32 of the object, else a read-back -------------------------


def _calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    made: list[tuple[str, dict[str, Any]]] = []
    _on_call(monkeypatch, lambda method, kwargs: made.append((method, dict(kwargs))))
    return made


# Was: every upload was read back whole after its commit (about one get_file more per write).
def test_a_multipart_upload_is_checked_by_the_stores_crc_else_read_back(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked_by: str
) -> None:
    torch.save(_state(), tmp_path / "ddp.pt")
    made = _calls(monkeypatch)
    report = ckptkit.convert_checkpoint(tmp_path / "ddp.pt", f"{prefix}/out.pt")
    assert f"{prefix}/out.pt: uploaded and committed, checked by {checked_by}" in report.notes
    methods = [m for m, _ in made]
    read_back = checked_by == "reading the object back"  # the store without checksums: it echoed none
    assert methods.count("upload_part") == 3 and ("get_object" in methods) == read_back, methods
    parts = [k for m, k in made if m == "upload_part"]
    assert all("ChecksumCRC32" in k for k in parts)  # each part checked by the store on arrival
    _fs().get_file(f"{prefix}/out.pt", str(tmp_path / "back.pt"))
    want = {k.removeprefix("module."): v for k, v in _state().items()}
    assert _equal(torch.load(tmp_path / "back.pt", weights_only=True), want)


def test_a_part_corrupted_on_the_way_fails_the_write_and_leaves_no_object(
    prefix: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch, checked_by: str
) -> None:
    folder = ckptkit.CheckpointFolder(f"{prefix}/run")
    ckptkit.save_on_master(_state(1), folder.path_for(1))
    folder.commit(folder.path_for(1))

    def corrupting(method: str, kwargs: dict[str, Any]) -> None:
        if method == "upload_part" and kwargs["PartNumber"] == 2:
            sent = kwargs["Body"]  # a file over a staged part's bytes, or a streamed part's bytes
            body = bytearray(sent.read() if hasattr(sent, "read") else sent)
            body[1000] ^= 0x10  # one bit, after ckptkit computed the part's CRC-32
            kwargs["Body"] = bytes(body)

    _on_call(monkeypatch, corrupting)
    # S3 itself refuses the part (its CRC-32 differs) or the completion; moto stores it, and the CRC-32
    # it computes over the object then differs from the one sent; a store without checksums takes
    # it all, and the read-back finds the CRC-32 differs. Either way the object is removed.
    found = "the store computed CRC-32" if checked_by.startswith("the store") else "read back .* bytes, CRC-32"
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match=rf"{found} [0-9a-f]{{8}}.*was removed"):
        ckptkit.save_on_master(_state(2), folder.path_for(2))
    assert not _fs().exists(folder.path_for(2))
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []
    assert folder.checkpoints() == [folder.path_for(1)] and folder.latest() == folder.path_for(1)


def test_a_store_without_checksums_is_read_back_and_the_report_says_so(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def stripping(method: str, kwargs: dict[str, Any]) -> None:  # a store that ignores the checksum headers
        for k in [k for k in kwargs if k.startswith("Checksum")]:
            del kwargs[k]

    _on_call(monkeypatch, stripping)
    made = _calls(monkeypatch)
    torch.save(_state(), tmp_path / "ddp.pt")
    report = ckptkit.convert_checkpoint(tmp_path / "ddp.pt", f"{prefix}/out.pt")
    assert f"{prefix}/out.pt: uploaded and committed, checked by reading the object back" in report.notes
    assert [m for m, _ in made].count("get_object") >= 3  # the whole object, part by part


@pytest.mark.parametrize("method", ["upload_part", "get_object"])
def test_parts_go_several_at_once_and_no_more_than_asked(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    import asyncio

    url = f"{prefix}/w.pt"
    if method == "get_object":
        ckptkit.save_on_master(_state(), url)
    monkeypatch.setenv("CKPTKIT_S3_PARTS", "2")
    started: set[int] = set()
    now = [0, 0]  # in flight, most at once
    call = s3fs.core.S3FileSystem._call_s3

    def part(kwargs: dict[str, Any]) -> int | None:  # 1, 2, 3: which part a call moves
        if method == "upload_part":
            return int(kwargs["PartNumber"])
        start = kwargs.get("Range", "").removeprefix("bytes=").partition("-")[0]
        return int(start) // (5 << 20) + 1 if start.isdigit() else None

    async def counting(self: Any, called: str, *args: Any, **kwargs: Any) -> Any:
        n = part(kwargs) if called == method else None
        if n is None:
            return await call(self, called, *args, **kwargs)
        started.add(n)
        now[0] += 1
        now[1] = max(now)
        for _ in range(3000):  # part 1 waits for part 2 to start: it does only if two go at once
            if n != 1 or 2 in started:
                break
            await asyncio.sleep(0.01)
        try:
            return await call(self, called, *args, **kwargs)
        finally:
            now[0] -= 1

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", counting)
    if method == "upload_part":
        ckptkit.save_on_master(_state(), url)
    got = ckptkit.read_checkpoint(url)
    # 3 parts of 5 MiB up; down, one GET per half of the object (each read as a stream)
    assert started == ({1, 2, 3} if method == "upload_part" else {1, 2}) and now[1] == 2, (started, now)
    assert _equal(got, _state())


def test_a_bad_parts_setting_is_one_line(prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CKPTKIT_S3_PARTS", "many")
    torch.save(_state(), tmp_path / "ddp.pt")
    code, _, err = run("convert", tmp_path / "ddp.pt", f"{prefix}/out.pt")
    assert code == 2 and lines(err) == [
        "ckptkit: error: CKPTKIT_S3_PARTS='many': expected a positive integer (parts sent or fetched at once)"
    ], err


# -- a file streamed to the store as it is written: no local copy --------------------------------


def _uploads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The name of each file uploaded whole from staging (not streamed)."""
    from ckptkit.io import upload

    uploaded: list[str] = []
    upload_verified = upload.upload_verified

    def staged(local: Path, url: str) -> str:
        uploaded.append(local.name)
        return upload_verified(local, url)

    monkeypatch.setattr(upload, "upload_verified", staged)
    return uploaded


def _images(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each streamed file's local image, as its stream finishes: its size and the bytes it holds on disk."""
    from ckptkit.io import streamed

    held: list[tuple[int, int]] = []
    finish = streamed.PartStream.finish

    def measured(self: Any) -> None:
        finish(self)
        st = os.stat(self.image_path)
        held.append((st.st_size, st.st_blocks * 512))

    monkeypatch.setattr(streamed.PartStream, "finish", measured)
    return held


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("how", ["save_on_master", "convert"])
def test_a_file_output_streams_to_the_store_keeping_only_its_headers_locally(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, suffix: str, how: str, checked_by: str
) -> None:
    from ckptkit.io import upload

    def staged(local: Path, url: str) -> str:
        raise AssertionError(f"{url} was staged whole in {local}, then uploaded")

    monkeypatch.setattr(upload, "upload_verified", staged)
    held = _images(monkeypatch)
    state = _state(3)
    url = f"{prefix}/out{suffix}"
    if how == "save_on_master":
        ckptkit.save_on_master(state, url)
    else:
        torch.save(state, tmp_path / "ddp.pt")
        report = ckptkit.convert_checkpoint(tmp_path / "ddp.pt", url)
        assert f"{url}: uploaded and committed, checked by {checked_by}" in report.notes
        state = {k.removeprefix("module."): v for k, v in state.items()}
    [(size, on_disk)] = held
    assert size == _fs().size(url) > 12 << 20 and on_disk < 256 << 10, (size, on_disk)  # headers, not 12 MiB
    assert _equal(ckptkit.read_checkpoint(url), state)
    assert not list((tmp_path / "staging").iterdir())


# Was: a folder output was written whole in $CKPTKIT_STAGING, then uploaded file by file.
@pytest.mark.parametrize("source", [".pt", "dcp"])
def test_hf_shards_stream_to_an_empty_prefix_keeping_only_their_headers_locally(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, checked_by: str
) -> None:
    uploaded = _uploads(monkeypatch)
    held = _images(monkeypatch)
    state = {"a.weight": torch.randn(3 << 20), "b.weight": torch.randn(3 << 20), "b.bias": torch.randn(7)}
    if source == "dcp":
        ckptkit.convert_checkpoint(_saved(tmp_path, state), tmp_path / "ckpt.dcp", format="dcp")
        src = tmp_path / "ckpt.dcp"
    else:
        src = _saved(tmp_path, state)
    url = f"{prefix}/out/"
    report = ckptkit.convert_checkpoint(src, url, max_shard_size="13MB")
    names = sorted(n.rsplit("/", 1)[-1] for n in _fs().ls(url))
    shards = [n for n in names if n.endswith(".safetensors")]
    assert len(shards) == 2 and uploaded == ["model.safetensors.index.json"], (
        names,
        uploaded,
    )  # the index alone staged
    assert len(held) == 2 and all(size > 12 << 20 and disk < 256 << 10 for size, disk in held), held
    assert sorted(size for size, _ in held) == sorted(_fs().size(f"{url}{n}") for n in shards)
    said = [n for n in report.notes if n.startswith(f"{prefix}/out/: ")]
    assert sum(int(n.split(": ")[1].split(" ")[0]) for n in said) == 3, report.notes  # each file, by its check
    assert any(n.endswith(f"checked by {checked_by}") for n in said), report.notes
    assert _equal(ckptkit.read_checkpoint(f"{prefix}/out"), state)
    assert not list((tmp_path / "staging").iterdir())


def test_a_dcp_folder_streams_to_an_empty_prefix_its_metadata_last(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked_by: str
) -> None:
    uploaded = _uploads(monkeypatch)
    held = _images(monkeypatch)
    state = {"model": {"a.weight": torch.randn(3 << 20), "b.bias": torch.randn(7)}, "step": 3, "lrs": [0.1, 0.2]}
    report = ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{prefix}/out/", format="dcp")
    names = sorted(n.rsplit("/", 1)[-1] for n in _fs().ls(f"{prefix}/out/"))
    assert names == [".metadata", "__0_0.distcp"] and uploaded == [".metadata"], (
        names,
        uploaded,
    )  # .metadata alone staged
    ((size, disk),) = held
    assert size == _fs().size(f"{prefix}/out/__0_0.distcp") and size > 12 << 20 and disk < 256 << 10, held
    said = [n for n in report.notes if n.startswith(f"{prefix}/out/: ")]
    assert sum(int(n.split(": ")[1].split(" ")[0]) for n in said) == 2 and any(checked_by in n for n in said), (
        report.notes
    )
    back = ckptkit.read_checkpoint(f"{prefix}/out")
    assert back["step"] == 3 and back["lrs"] == [0.1, 0.2] and _equal(back["model"], state["model"])
    assert ckptkit.verify_checkpoint(f"{prefix}/out").ok
    assert not list((tmp_path / "staging").iterdir())


def _saved(tmp_path: Path, state: dict[str, torch.Tensor]) -> Path:
    torch.save(state, tmp_path / "src.pt")
    return tmp_path / "src.pt"


def test_a_streamed_folder_that_fails_midway_publishes_no_index_and_leaves_no_upload_open(
    prefix: str, s3_endpoint: str, tmp_path: Path
) -> None:
    from tests.io.test_crc import flip

    state = {"a.weight": torch.randn(3 << 20), "b.weight": torch.randn(3 << 20)}
    flip(_saved(tmp_path, state), "b.weight")  # found as the second shard is copied
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="b.weight"):
        ckptkit.convert_checkpoint(tmp_path / "src.pt", f"{prefix}/out/", max_shard_size="13MB")
    # Found in review: the shards streamed before the failure stayed, and a retry needed --force.
    assert not _fs().exists(f"{prefix}/out") or _fs().ls(f"{prefix}/out") == [], _fs().ls(f"{prefix}/out")
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []
    assert not list((tmp_path / "staging").iterdir())
    _saved(tmp_path, state)
    ckptkit.convert_checkpoint(tmp_path / "src.pt", f"{prefix}/out/", max_shard_size="13MB")  # no --force needed
    assert _equal(dict(sorted(ckptkit.read_checkpoint(f"{prefix}/out").items())), dict(sorted(state.items())))


def test_replacing_a_folder_that_then_fails_leaves_the_earlier_one_whole(prefix: str, tmp_path: Path) -> None:
    from tests.io.test_crc import flip

    old = {"a.weight": torch.randn(3 << 20), "b.weight": torch.randn(3 << 20)}
    ckptkit.convert_checkpoint(_saved(tmp_path, old), f"{prefix}/out/", max_shard_size="13MB")
    flip(_saved(tmp_path, {k: v + 1 for k, v in old.items()}), "b.weight")
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="b.weight"):
        ckptkit.convert_checkpoint(tmp_path / "src.pt", f"{prefix}/out/", max_shard_size="13MB", force=True)
    assert _equal(ckptkit.read_checkpoint(f"{prefix}/out"), old)  # staged: nothing was sent before the failure


def test_a_streamed_file_that_fails_its_own_check_commits_nothing(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.ops import write

    url = f"{prefix}/out.safetensors"
    ckptkit.save_on_master(_state(1), url)

    def failing(tmp: Path, fmt: str, *, dest: Path) -> None:
        assert tmp.stat().st_size > 12 << 20  # the image of the whole file, holes and all
        raise ckptkit.errors.CheckpointWriteError(f"cannot write {dest}: injected check failure")

    monkeypatch.setattr(write, "check_written", failing)
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match=f"cannot write {url}: injected"):
        ckptkit.save_on_master(_state(2), url)
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []  # its parts went out, and were aborted
    assert _equal(ckptkit.read_checkpoint(url), _state(1))
    assert not list((tmp_path / "staging").iterdir())


def test_a_streamed_object_is_read_against_the_stores_crc(prefix: str, s3_endpoint: str) -> None:
    url = f"{prefix}/out.pt"
    ckptkit.save_on_master(_state(), url)
    fs, key = remote.filesystem(url)
    assert remote.CRC_KEY not in _fs().metadata(url)  # its CRC-32 was not known when the upload began
    found = remote.recorded_crc(fs, key)
    assert found == (zlib.crc32(_fs().cat_file(url)) if _CHECKS[s3_endpoint] else None)


@pytest.mark.parametrize("how", ["save_on_master", "convert"])
def test_a_completion_whose_answer_is_lost_is_found_committed(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str, checked_by: str
) -> None:
    """The store completed the upload, but its answer never came (a read timeout; the retry is
    refused, the upload being gone): the object holds what was sent, so the write succeeded."""
    call = s3fs.core.S3FileSystem._call_s3
    lost: list[str] = []

    async def losing(self: Any, method: str, *args: Any, **kwargs: Any) -> Any:
        result = await call(self, method, *args, **kwargs)
        if method == "complete_multipart_upload" and not lost:
            lost.append(kwargs["Key"])
            raise OSError("injected: the connection dropped before the answer")
        return result

    monkeypatch.setattr(s3fs.core.S3FileSystem, "_call_s3", losing)
    url = f"{prefix}/out.pt"
    if how == "save_on_master":
        ckptkit.save_on_master(_state(4), url)
        want = _state(4)
    else:
        torch.save(_state(4), tmp_path / "ddp.pt")
        report = ckptkit.convert_checkpoint(tmp_path / "ddp.pt", url)
        assert f"{url}: uploaded and committed, checked by {checked_by}" in report.notes
        want = {k.removeprefix("module."): v for k, v in _state(4).items()}
    assert lost == [_key(url)]
    assert _equal(ckptkit.read_checkpoint(url), want)


def test_a_writer_that_begins_again_streams_only_its_second_start(
    prefix: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ckptkit's zip writer hands over to torch.save where it cannot write an object (``FallBack``),
    which starts the file again (``seek(0)``, ``truncate()``): the parts already sent go."""
    from ckptkit.formats.torchzip import torch as zip_half

    def partway(obj: Any, f: Any, **kwargs: Any) -> None:
        f.write(os.urandom(12 << 20))  # parts 2 and 3 go out before the writer gives up
        raise zip_half.FallBack("test: torch.save writes this one")

    monkeypatch.setattr(zip_half, "save_zip", partway)
    url = f"{prefix}/out.pt"
    ckptkit.save_on_master(_state(5), url)
    assert _equal(torch.load(io.BytesIO(_fs().cat_file(url)), weights_only=True), _state(5))
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []


# -- a review of the streamed writes ------------------------------------------------------------


def test_a_failed_part_stops_a_streamed_write_at_once(
    prefix: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    tried: list[int] = []

    def failing(method: str, kwargs: dict[str, Any]) -> None:
        if method == "upload_part":
            tried.append(kwargs["PartNumber"])
            if kwargs["PartNumber"] >= 3:
                raise PermissionError("injected: AccessDenied on UploadPart")

    _on_call(monkeypatch, failing)
    big = {"w": torch.randn(20 << 20)}  # 80 MiB: 16 parts of 5 MiB
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match="injected: AccessDenied"):
        ckptkit.save_on_master(big, f"{prefix}/big.pt")
    assert max(tried) <= 3 + 2 * 4, tried  # stopped within the parts then in flight, not after all 16
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []


def test_a_zip_whose_archive_folder_is_named_data_streams(prefix: str, tmp_path: Path) -> None:
    torch.save(_state(6), tmp_path / "data.pt")  # torch names the archive folder for the file: data/
    url = f"{prefix}/out.pt"
    ckptkit.convert_checkpoint(tmp_path / "data.pt", url)
    assert _equal(ckptkit.read_checkpoint(url), {k.removeprefix("module."): v for k, v in _state(6).items()})


def test_a_download_resumes_a_dropped_stream(prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import aiohttp
    from aiobotocore.response import StreamingBody

    url = f"{prefix}/r.pt"
    ckptkit.save_on_master(_state(7), url)
    read = StreamingBody.read
    dropped: list[int] = []

    async def flaky(self: Any, amt: int | None = None) -> bytes:
        data = await read(self, amt)
        if data and not dropped:
            dropped.append(len(data))
            raise aiohttp.ClientPayloadError("injected: connection reset mid-body")
        return data

    monkeypatch.setattr(StreamingBody, "read", flaky)
    assert _equal(ckptkit.read_checkpoint(url), _state(7))
    assert dropped


def test_a_refused_completion_of_bytes_already_there_leaves_no_upload_open(
    prefix: str, s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{prefix}/same.pt"
    ckptkit.save_on_master(_state(8), url)

    def refusing(method: str, kwargs: dict[str, Any]) -> None:
        if method == "complete_multipart_upload":
            raise OSError("injected: completion refused")

    _on_call(monkeypatch, refusing)
    ckptkit.save_on_master(_state(8), url)  # the same bytes are there: the write holds
    assert _unfinished_uploads(s3_endpoint, _key(prefix)) == []
    assert _equal(ckptkit.read_checkpoint(url), _state(8))


def test_a_full_local_disk_under_a_stream_is_one_error_naming_the_url(
    prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import errno

    from ckptkit.io import streamed

    def full(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(streamed.os, "pwrite", full)  # the local image of the headers
    url = f"{prefix}/out.safetensors"
    with pytest.raises(ckptkit.errors.CheckpointWriteError, match=f"cannot write {url}: no space left"):
        ckptkit.save_on_master(_state(9), url)


# -- reads through ranged GETs, nothing staged -------------------------------------------------


def _fetched(monkeypatch: pytest.MonkeyPatch, key: str) -> list[tuple[int, int]]:
    """The byte ranges each GET of the object ``key`` asks for, as (start, end)."""
    asked: list[tuple[int, int]] = []

    def count(method: str, kwargs: dict[str, Any]) -> None:
        if method == "get_object" and kwargs.get("Key") == key:
            start, end = kwargs["Range"].removeprefix("bytes=").split("-")
            asked.append((int(start), int(end) + 1))

    _on_call(monkeypatch, count)
    return asked


@pytest.fixture
def ranged(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Runs of 1 MiB (a 12 MiB object takes twelve), and staging a URL's object forbidden."""
    from ckptkit.io import ranged

    def staged(url: str, local: Path, **kw: Any) -> int:
        raise AssertionError(f"{url} was staged whole in {local}")

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    monkeypatch.setattr(remote, "download", staged)
    return ranged


def _uploaded(tmp_path: Path, url: str, suffix: str, state: dict[str, torch.Tensor]) -> None:
    """``state`` written by torch or the safetensors package (no CRC-32s of ckptkit's inside), then
    uploaded by ckptkit (which records the object's CRC-32)."""
    from safetensors.torch import save_file

    from ckptkit.io import upload

    local = tmp_path / f"third_party{suffix}"
    if suffix == ".pt":
        torch.save(state, local)
    else:
        save_file(state, local)
    upload.upload_verified(local, url)


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_inspect_and_a_structure_check_of_a_url_read_a_few_ranges(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranged: Any, suffix: str
) -> None:
    url = f"{prefix}/big{suffix}"
    _uploaded(tmp_path, url, suffix, {"w": torch.randn(3 << 20), "b": torch.randn(7)})
    size = _fs().size(url)
    asked = _fetched(monkeypatch, _key(url))
    summary = ckptkit.inspect_checkpoint(url)
    assert summary.path == url and sorted(t.name for t in summary.tensors) == ["b", "w"]
    assert ckptkit.verify_checkpoint(url, full=False).ok
    assert 0 < sum(end - start for start, end in asked) <= size // 3, (asked, size)
    assert not list((tmp_path / "staging").iterdir())


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
@pytest.mark.parametrize("out", [".safetensors", ".pt"])
def test_convert_from_a_url_reads_it_through_ranged_gets_exactly(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranged: Any, suffix: str, out: str
) -> None:
    url = f"{prefix}/src{suffix}"
    state = {"module.a": torch.randn(3 << 20), "module.b": torch.randn(1 << 20), "module.c": torch.arange(5)}
    _uploaded(tmp_path, url, suffix, state)
    size = _fs().size(url)
    asked = _fetched(monkeypatch, _key(url))
    ckptkit.convert_checkpoint(url, tmp_path / f"single{out}")
    got = ckptkit.read_checkpoint(tmp_path / f"single{out}")
    assert _equal(dict(sorted(got.items())), {k.removeprefix("module."): v for k, v in state.items()})
    whole = [(start, end) for start, end in asked if start % (1 << 20) == 0 and end == min(start + (1 << 20), size)]
    runs = [start // (1 << 20) for start, _ in whole]
    looks = [got for got in asked if got not in whole]  # blocks around headers
    assert sorted(set(runs)) == list(range(-(-size // (1 << 20)))), runs  # every byte read, none staged
    # each run once, but the last (a zip's end, read first, let go while the weights pass)
    assert len(runs) <= len(set(runs)) + 1 and len(looks) <= 6, (runs, looks)
    assert ckptkit.verify_checkpoint(url).ok
    assert not list((tmp_path / "staging").iterdir())


def test_a_damaged_object_read_through_ranges_fails_its_recorded_crc(
    prefix: str, s3_endpoint: str, tmp_path: Path, ranged: Any
) -> None:
    url = f"{prefix}/model.safetensors"
    _uploaded(tmp_path, url, ".safetensors", {"w": torch.randn(3 << 20)})
    good = _fs().cat_file(url)
    data = bytearray(good)
    data[len(data) // 2] ^= 1  # inside w: the file records no CRC-32 of its own, the upload did
    meta = {remote.CRC_KEY: f"{zlib.crc32(good):08x}"}
    _client(s3_endpoint).put_object(Bucket=BUCKET, Key=_key(url), Body=bytes(data), Metadata=meta)
    with pytest.raises(
        ckptkit.errors.CheckpointFormatError, match=f"{url}: its bytes have CRC-32 .* but ckptkit recorded"
    ):
        ckptkit.convert_checkpoint(url, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    assert not ckptkit.verify_checkpoint(url).ok


def test_an_object_replaced_while_it_is_read_through_ranges_is_refused(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranged: Any
) -> None:
    url = f"{prefix}/ckpt.pt"
    ckptkit.save_on_master(_state(1), url)
    replaced: list[bool] = []

    def writer(method: str, kwargs: dict[str, Any]) -> None:
        if method == "get_object" and kwargs.get("Key") == _key(url) and "Range" in kwargs and not replaced:
            replaced.append(True)
            client = _client(s3_endpoint)
            body = client.get_object(Bucket=BUCKET, Key=_key(url))["Body"].read()
            client.put_object(Bucket=BUCKET, Key=_key(url), Body=body[:-1] + b"x")

    _on_call(monkeypatch, writer)
    with pytest.raises(ckptkit.errors.StorageError, match=f"{url}: the object was replaced while it was read"):
        ckptkit.convert_checkpoint(url, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_what_torch_reads_of_a_url_is_copied_whole_first(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    url = f"{prefix}/ckpt.pt"
    state = _state(2)
    ckptkit.save_on_master(state, url)
    trusted = ckptkit.inspect_checkpoint(url, trust=True)  # described by what torch builds
    assert trusted.loaded_with_torch and sorted(t.name for t in trusted.tensors) == sorted(state)
    report = ckptkit.convert_checkpoint(url, tmp_path / "out.safetensors", trust=True)
    assert report.destination == str(tmp_path / "out.safetensors")
    assert _equal(
        ckptkit.read_checkpoint(tmp_path / "out.safetensors"), {k.removeprefix("module."): v for k, v in state.items()}
    )
    assert not list((tmp_path / "staging").iterdir())


def test_the_benchmarks_server_answers_ranged_gets_as_moto_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranged: Any
) -> None:
    """The benchmarks' store reads only the range a GET asks for (tests/s3stores.WithS3Ranges);
    what a client gets is moto's answer, byte for byte, refusals included."""
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    plain, plain_endpoint = s3stores.start()
    server, endpoint = s3stores.start(ranges=True)
    try:
        data = bytes(range(256)) * 40_000
        for at in (plain_endpoint, endpoint):
            boto3.client("s3", endpoint_url=at).create_bucket(Bucket="ranges")
            boto3.client("s3", endpoint_url=at).put_object(Bucket="ranges", Key="k", Body=data)
        answers = []
        for at in (plain_endpoint, endpoint):
            client = boto3.client("s3", endpoint_url=at)
            etag = client.head_object(Bucket="ranges", Key="k")["ETag"]
            got = [
                client.get_object(Bucket="ranges", Key="k", Range=r)["Body"].read()
                for r in ("bytes=5-70000", "bytes=9000000-9999999", "bytes=10-5")  # the last: no range at all
            ]
            refused = []
            for asked in ({"IfMatch": '"other"'}, {"Range": "bytes=99999999-"}, {"Key": "missing"}):
                try:
                    client.get_object(**{"Bucket": "ranges", "Key": "k", "Range": "bytes=0-9", **asked})
                except client.exceptions.ClientError as e:
                    refused.append(e.response["Error"]["Code"])
            answers.append(
                (
                    got,
                    refused,
                    client.get_object(Bucket="ranges", Key="k", Range="bytes=1-2", IfMatch=etag)["Body"].read(),
                )
            )
        assert answers[0] == answers[1] and answers[0][0][0] == data[5:70001] and len(answers[0][1]) == 3, answers[1][1]
        monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
        s3fs.S3FileSystem.clear_instance_cache()
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
        state = {"w": torch.randn(3 << 20), "b": torch.randn(7)}
        ckptkit.save_on_master(state, f"s3://{BUCKET}/x.safetensors")
        ckptkit.convert_checkpoint(f"s3://{BUCKET}/x.safetensors", tmp_path / "x.pt")
        assert _equal(dict(sorted(ckptkit.read_checkpoint(tmp_path / "x.pt").items())), dict(sorted(state.items())))
    finally:
        server.stop()
        plain.stop()
        s3fs.S3FileSystem.clear_instance_cache()


# Found in review: the spawned workers opened the placeholder (zeros) where the parent read ranges.
@pytest.mark.slow  # two worker processes
def test_convert_workers_from_a_url(prefix: str, tmp_path: Path) -> None:
    state = {f"l{i}": torch.randn(1 << 18) for i in range(4)}
    ckptkit.save_on_master(state, f"{prefix}/m.safetensors")
    ckptkit.convert_checkpoint(f"{prefix}/m.safetensors", tmp_path / "hf/", max_shard_size="1MB", workers=2)
    assert _equal(dict(sorted(ckptkit.read_checkpoint(tmp_path / "hf").items())), dict(sorted(state.items())))


# Found in review: read through ranges, a TorchScript archive passed for a checkpoint needing globals.
def test_a_torchscript_archive_on_a_url_is_named_as_one(prefix: str, tmp_path: Path) -> None:
    from ckptkit.io import upload

    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "model.pt")
    upload.upload_verified(tmp_path / "model.pt", f"{prefix}/model.pt")
    with pytest.raises(ckptkit.errors.UnsupportedCheckpointError, match="is a TorchScript archive"):
        ckptkit.inspect_checkpoint(f"{prefix}/model.pt")


# Found in review: an index read through ranges had no descriptor to fstat (UnsupportedOperation).
def test_an_index_object_alone_is_reported_not_raised(prefix: str, tmp_path: Path) -> None:
    ckptkit.convert_checkpoint(_saved(tmp_path, _state()), tmp_path / "hf/", max_shard_size="5MB")
    from ckptkit.io import upload

    upload.upload_verified(tmp_path / "hf" / "model.safetensors.index.json", f"{prefix}/model.safetensors.index.json")
    report = ckptkit.verify_checkpoint(f"{prefix}/model.safetensors.index.json")
    assert not report.ok and "missing" in " ".join(c.detail for c in report.checks if not c.ok), report.checks


# Found in review: a failed GET while a compressed record was inflated was reported as its damage.
def test_a_store_failure_while_records_are_checked_is_not_called_damage(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranged: Any
) -> None:
    import zipfile

    from ckptkit.formats import integrity
    from ckptkit.io import upload

    torch.save({f"l{i}": torch.randn(3 << 17) for i in range(4)}, tmp_path / "m.pt")
    with (
        zipfile.ZipFile(tmp_path / "m.pt") as zin,
        zipfile.ZipFile(tmp_path / "c.pt", "w", zipfile.ZIP_DEFLATED) as zout,
    ):
        for info in zin.infolist():
            zout.writestr(info.filename, zin.read(info.filename))
    upload.upload_verified(tmp_path / "c.pt", f"{prefix}/c.pt")
    checking: list[bool] = []
    record_crc = integrity.record_crc

    def marked(*args: Any, **kwargs: Any) -> Any:
        checking.append(True)
        return record_crc(*args, **kwargs)

    def failing(method: str, kwargs: dict[str, Any]) -> None:
        if method == "get_object" and checking:
            raise OSError("injected: connection reset")

    monkeypatch.setattr(integrity, "record_crc", marked)
    _on_call(monkeypatch, failing)
    report = ckptkit.verify_checkpoint(f"{prefix}/c.pt")
    failed = " ".join(c.detail for c in report.checks if not c.ok)
    assert not report.ok and "injected: connection reset" in failed and "damaged" not in failed, report.checks


# Found in review: each local header of a zip fetched a whole run, so inspect read the weights.
def test_inspect_of_a_zip_of_many_tensors_reads_its_headers_not_its_weights(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranged: Any
) -> None:
    from ckptkit.io import upload

    torch.save({f"l{i}": torch.randn(3 << 17) for i in range(30)}, tmp_path / "m.pt")  # 30 x 1.5 MiB
    url = f"{prefix}/m.pt"
    upload.upload_verified(tmp_path / "m.pt", url)
    asked = _fetched(monkeypatch, _key(url))
    assert len(ckptkit.inspect_checkpoint(url).tensors) == 30
    assert sum(end - start for start, end in asked) < (tmp_path / "m.pt").stat().st_size // 8, asked


@pytest.mark.parametrize(("src", "dst"), [(".safetensors", ".pt"), (".pt", ".safetensors")])
def test_convert_from_a_url_to_a_url_reads_ranges_and_streams_parts(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ranged: Any, src: str, dst: str
) -> None:
    from ckptkit.io import upload

    def staged(local: Path, url: str) -> str:
        raise AssertionError(f"{url} was staged whole in {local}, then uploaded")

    state = {"a": torch.randn(3 << 20), "b": torch.arange(7)}
    ckptkit.save_on_master(state, f"{prefix}/in{src}")
    monkeypatch.setattr(upload, "upload_verified", staged)
    held = _images(monkeypatch)
    ckptkit.convert_checkpoint(f"{prefix}/in{src}", f"{prefix}/out{dst}")
    assert len(held) == 1 and held[0][1] < 256 << 10, held  # the output's headers only, locally
    assert not list((tmp_path / "staging").iterdir())
    _fs().get_file(f"{prefix}/out{dst}", str(tmp_path / f"back{dst}"))
    assert _equal(dict(sorted(ckptkit.read_checkpoint(tmp_path / f"back{dst}").items())), state)


def _downloads(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    """Each object copied whole into staging, as (name, size)."""
    copied: list[tuple[str, int]] = []
    download = remote.download

    def recorded(url: str, local: Path, **kw: Any) -> int:
        copied.append((url.rsplit("/", 1)[-1], _fs().size(url)))
        return download(url, local, **kw)

    monkeypatch.setattr(remote, "download", recorded)
    return copied


@pytest.mark.parametrize("layout", ["hf_shards", "dcp"])
def test_a_prefix_is_read_through_ranges_its_small_files_copied(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    state = {"a.weight": torch.randn(3 << 20), "b.weight": torch.randn(3 << 20), "b.bias": torch.randn(7)}
    url = f"{prefix}/out"
    options = {"format": "dcp"} if layout == "dcp" else {"max_shard_size": "13MB"}
    ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{url}/", **options)
    sizes = {n.rsplit("/", 1)[-1]: _fs().size(n) for n in _fs().ls(url)}
    big = {n for n, size in sizes.items() if size > 1 << 20}
    assert big and len(sizes) > len(big), sizes  # weights, and an index or .metadata beside them
    copied = _downloads(monkeypatch)
    asked: list[tuple[int, int]] = []
    for name in big:
        asked += _fetched(monkeypatch, _key(f"{url}/{name}"))
    summary = ckptkit.inspect_checkpoint(url)
    assert sorted(t.name for t in summary.tensors) == sorted(state)
    assert sum(end - start for start, end in asked) <= sum(sizes[n] for n in big) // 3, asked  # headers, not weights
    assert ckptkit.verify_checkpoint(url, full=False).ok
    ckptkit.convert_checkpoint(url, tmp_path / "single.safetensors")
    assert _equal(
        dict(sorted(ckptkit.read_checkpoint(tmp_path / "single.safetensors").items())), dict(sorted(state.items()))
    )
    assert ckptkit.verify_checkpoint(url).ok  # every object against its recorded CRC-32
    assert copied and all(size <= 1 << 20 for _, size in copied), copied  # only the small files copied whole
    assert {n for n, _ in copied} == set(sizes) - big, copied
    assert not list((tmp_path / "staging").iterdir())


def test_a_damaged_object_of_a_prefix_read_through_ranges_fails_its_recorded_crc(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    url = f"{prefix}/out"
    ckptkit.convert_checkpoint(_saved(tmp_path, {"w": torch.randn(3 << 20)}), f"{url}/", format="dcp")
    (shard,) = [n for n in _fs().ls(url) if n.endswith(".distcp")]
    good = _fs().cat_file(shard)
    data = bytearray(good)
    data[len(data) // 2] ^= 1  # inside w's bytes
    meta = {remote.CRC_KEY: f"{zlib.crc32(good):08x}"}
    _client(s3_endpoint).put_object(Bucket=BUCKET, Key=_key(f"s3://{shard}"), Body=bytes(data), Metadata=meta)
    with pytest.raises(ckptkit.errors.CheckpointFormatError, match="its bytes have CRC-32 .* but ckptkit recorded"):
        ckptkit.convert_checkpoint(url, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()
    assert not ckptkit.verify_checkpoint(url).ok


def test_what_torch_reads_of_a_prefix_is_copied_whole_first(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    state = {"a.weight": torch.randn(3 << 20), "step": torch.tensor(3)}
    url = f"{prefix}/out"
    ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{url}/", format="dcp")
    report = ckptkit.convert_checkpoint(url, tmp_path / "back.pt", trust=True)  # torch's DCP reader, by path
    assert report.destination == str(tmp_path / "back.pt")
    assert _equal(dict(sorted(ckptkit.read_checkpoint(tmp_path / "back.pt").items())), dict(sorted(state.items())))
    assert not list((tmp_path / "staging").iterdir())


def test_a_prefixs_objects_share_one_memory_budget(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    monkeypatch.setenv("CKPTKIT_S3_PARTS", "2")  # a budget of 2 x (2 + 2) runs
    state = {f"l{i}.weight": torch.randn(2 << 20) for i in range(5)}  # five shards of eight runs
    url = f"{prefix}/out"
    ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{url}/", max_shard_size="9MB")
    seen: dict[int, Any] = {}
    held: list[int] = []
    threads: list[int] = []
    get = ranged.RangedObject.get

    def counted(self: Any, run: int, *, ahead: int) -> bytearray:
        data = get(self, run, ahead=ahead)
        seen[id(self)] = self
        held.append(sum(len(o._runs) for o in seen.values()))
        threads.append(sum(t.name.startswith("ckptkit-read") for t in threading.enumerate()))
        return data

    monkeypatch.setattr(ranged.RangedObject, "get", counted)
    ckptkit.convert_checkpoint(url, tmp_path / "single.safetensors")
    assert len(seen) == 5 and max(held) <= 8, (len(seen), max(held))  # not each shard's runs kept
    assert max(threads) <= 2, max(threads)  # nor each one's fetching threads
    got = ckptkit.read_checkpoint(tmp_path / "single.safetensors")
    assert _equal(dict(sorted(got.items())), dict(sorted(state.items())))


def test_a_dcp_tensor_split_across_objects_is_read_exactly_from_a_prefix(
    prefix: str, fixtures_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 8192)  # the fixture's .distcp files are 27 kB: placeholders
    monkeypatch.setattr(ranged, "SMALL", 1024)
    copied = _downloads(monkeypatch)
    _fs().put(f"{fixtures_dir / 'fsdp2_dcp_dim1'}/", f"{prefix}/dim1/", recursive=True)
    ckptkit.convert_checkpoint(f"{prefix}/dim1", tmp_path / "out.safetensors")
    got = ckptkit.read_checkpoint(tmp_path / "out.safetensors")
    want = torch.load(fixtures_dir / "fsdp2_dcp_dim1.expected.pt", weights_only=True)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert {n for n, _ in copied} == {".metadata"}, copied  # the chunks' files read through ranges


# Found in review of 08773dc: the listing was held again as the read ended, after the output had
# been committed: an object added under the prefix failed a convert that had already published.
@pytest.mark.parametrize("beside", [False, True], ids=["added_meanwhile", "output_under_the_prefix"])
def test_objects_added_under_a_prefix_while_it_is_read_do_not_fail_the_read(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beside: bool
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    url = f"{prefix}/src"
    state = {f"w{i}": torch.randn(1 << 20) for i in range(2)}
    ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{url}/", max_shard_size="5MB")
    out = f"{url}/consolidated.safetensors" if beside else str(tmp_path / "out.safetensors")
    if not beside:
        ckptkit.convert_checkpoint(_saved(tmp_path, {"previous": torch.zeros(3)}), out)
        done: list[str] = []

        def writer(method: str, kwargs: dict[str, Any]) -> None:
            if method == "get_object" and not done:  # a file added while the reader reads
                done.append(method)
                _client(s3_endpoint).put_object(Bucket=BUCKET, Key=f"{_key(url)}/README.md", Body=b"notes")

        _on_call(monkeypatch, writer)
    ckptkit.convert_checkpoint(url, out, force=True)
    assert _equal(dict(sorted(ckptkit.read_checkpoint(out).items())), state)


# Found in review of 08773dc: an index replaced between the listing and its copy was read with the
# earlier shards, and the mix reported as a damaged checkpoint ("save the model again").
def test_an_index_replaced_before_it_is_copied_is_refused_as_replaced(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    url = f"{prefix}/src"
    state = {f"w{i}": torch.randn(1 << 20) for i in range(2)}
    ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{url}/", max_shard_size="5MB")
    index = f"{url}/model.safetensors.index.json"
    new = _fs().cat_file(index).replace(b'"w1"', b'"renamed"')  # the next save renamed a tensor
    done: list[str] = []

    def writer(method: str, kwargs: dict[str, Any]) -> None:
        if method == "head_object" and kwargs.get("Key") == _key(index) and not done:  # before its copy
            done.append(method)
            _client(s3_endpoint).put_object(Bucket=BUCKET, Key=_key(index), Body=new)

    _on_call(monkeypatch, writer)
    with pytest.raises(ckptkit.errors.StorageError, match=f"{index}: the object was replaced while it was read"):
        ckptkit.convert_checkpoint(url, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


# Found in review: inspect spelled the summary's notes under the URL, not the producer's notes,
# so megatron's note named common.pt in the staging folder.
def test_inspect_of_a_megatron_prefix_names_the_url(prefix: str, fixtures_dir: Path) -> None:
    url = f"{prefix}/torch_dist"
    for f in (fixtures_dir / "frameworks" / "megatron" / "torch_dist").iterdir():
        _fs().put_file(str(f), f"{url}/{f.name}")
    summary = ckptkit.inspect_checkpoint(url)
    assert summary.producer is not None and summary.producer["notes"], summary.producer
    assert ".ckptkit-stage" not in json.dumps(summary.to_dict())
    assert any(f"ckptkit inspect {url}/common.pt" in n for n in summary.producer["notes"]), summary.producer


# Found in review: a listing without ETags (some S3-compatible stores) held against the object's
# ETag called every object replaced.
def test_a_listing_without_etags_is_held_by_size(prefix: str) -> None:
    url = f"{prefix}/ckpt.pt"
    ckptkit.save_on_master(_state(), url)
    fs, key = remote.filesystem(url)
    data = _fs().cat_file(url)
    remote.hold_to_recorded(fs, key, url, zlib.crc32(data), seen={"size": len(data), "ETag": None})
    with pytest.raises(ckptkit.errors.StorageError, match="replaced while it was read"):
        remote.hold_to_recorded(fs, key, url, zlib.crc32(data), seen={"size": len(data) + 1, "ETag": None})


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "damaged"])
def test_convert_workers_read_a_prefix_through_ranges_and_hold_every_object(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damaged: bool
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)  # the workers read in the parent's runs
    from safetensors.torch import save_file

    from ckptkit.io import upload

    state = {f"l{i}.weight": torch.randn(1 << 20) for i in range(4)}
    url = f"{prefix}/src"
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {k: names[i // 2] for i, k in enumerate(state)}
    for name in names:  # by the safetensors package: no CRC-32s inside, only the upload's of each object
        save_file({k: v for k, v in state.items() if weight_map[k] == name}, tmp_path / name)
        upload.upload_verified(tmp_path / name, f"{url}/{name}")
    index = json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
    _fs().pipe_file(f"{url}/model.safetensors.index.json", index)
    shards = [f"{url}/{name}" for name in names]
    if damaged:  # the shard the worker reads (the parent writes the first share): its runs come back
        for shard in shards[1:]:
            good = _fs().cat_file(shard)
            data = bytearray(good)
            data[len(data) // 2] ^= 1
            meta = {remote.CRC_KEY: f"{zlib.crc32(good):08x}"}
            _client(s3_endpoint).put_object(Bucket=BUCKET, Key=_key(shard), Body=bytes(data), Metadata=meta)
    copied = _downloads(monkeypatch)
    received: list[dict[str, dict[int, int]]] = []
    held: list[str] = []
    add_runs, hold = ranged.add_runs, remote.hold_to_recorded

    def merged(runs: dict[str, dict[int, int]]) -> None:
        received.append(runs)
        add_runs(runs)

    def holding(fs: Any, key: str, url: str, *args: Any, **kw: Any) -> None:
        held.append(url)
        hold(fs, key, url, *args, **kw)

    monkeypatch.setattr(ranged, "add_runs", merged)
    monkeypatch.setattr(remote, "hold_to_recorded", holding)
    out = tmp_path / "hf"
    if damaged:
        with pytest.raises(ckptkit.errors.CheckpointFormatError, match="its bytes have CRC-32 .* but ckptkit recorded"):
            ckptkit.convert_checkpoint(url, f"{out}/", max_shard_size="5MB", workers=2)
        assert not out.exists()
        return
    ckptkit.convert_checkpoint(url, f"{out}/", max_shard_size="5MB", workers=2)
    assert _equal(dict(sorted(ckptkit.read_checkpoint(out).items())), dict(sorted(state.items())))
    assert all(size <= 1 << 20 for _, size in copied), copied  # the shards read through ranges, in both processes
    assert any(runs for share in received for runs in share.values()), received  # the worker's runs came back
    assert sorted(u for u in held if u in shards) == shards, held  # each shard held whole once, its runs joined
    assert not list((tmp_path / "staging").iterdir())


# Found in review: a worker's runs were joined by URL, to whichever open read of it came last
# (two converts of one URL in threads): the first read's object was never held whole, and a
# second read of a replaced object was held to the first one's bytes.
def test_a_workers_runs_join_the_read_they_came_from(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged, upload

    monkeypatch.setattr(ranged, "RUN", 256 << 10)
    url = f"{prefix}/m.bin"

    def put(data: bytes) -> None:
        (tmp_path / "f").write_bytes(data)
        upload.upload_verified(tmp_path / "f", url)  # records ckptkit's CRC-32

    put(os.urandom(2 << 18))
    with ranged.ranged_read(url) as a:
        ((path, u, info, run),) = ranged.stand_ins(a)
        with ranged.standing_in([(path, u, info, run)]) as objects:  # what a worker does, here
            objects[path].reader().read()
            runs = {p: obj.run_crcs() for p, obj in objects.items()}
        with ranged.ranged_read(url) as b:  # another read of the same object, open meanwhile
            ranged.add_runs(runs)  # the first read's worker reports back
            first, second = ranged._STANDING[os.path.abspath(a)][0], ranged._STANDING[os.path.abspath(b)][0]
            assert sorted(first.run_crcs()) == [0, 1] and first.run_crcs() == runs[path]
            assert second.run_crcs() == {}


# Found in review: a reader waiting for a run another reader's budget let go got CancelledError.
def test_a_run_let_go_while_a_reader_waits_for_it_is_asked_again(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptkit.io import ranged

    monkeypatch.setattr(ranged, "RUN", 1 << 20)
    monkeypatch.setenv("CKPTKIT_S3_PARTS", "1")
    url = f"{prefix}/m.bin"
    _fs().pipe_file(url, os.urandom(3 << 20))
    fs, key = remote.filesystem(url)
    budget = ranged.Budget(1)  # room for one run: a second reader's run lets the first one's go
    obj = ranged.RangedObject(url, fs, key, remote.object_if_any(fs, key, url), budget)
    held = threading.Event()
    budget.pool.submit(held.wait)  # the one fetching thread is busy: runs asked for stay queued
    got: dict[int, Any] = {}

    def read(run: int) -> None:
        try:
            got[run] = bytes(obj.get(run, ahead=0))
        except BaseException as e:  # noqa: BLE001 - what the reader met, for the assertion
            got[run] = e

    first = threading.Thread(target=read, args=(0,))
    first.start()
    while 0 not in obj._runs:  # the first reader has asked for run 0 and waits for it
        time.sleep(0.001)
    second = threading.Thread(target=read, args=(1,))
    second.start()
    while 1 not in obj._runs:
        time.sleep(0.001)
    threading.Timer(0.2, held.set).start()
    first.join(60)
    second.join(60)
    data = _fs().cat_file(url)
    try:
        assert got == {0: data[: 1 << 20], 1: data[1 << 20 : 2 << 20]}, {k: type(v) for k, v in got.items()}
    finally:
        obj.close()
        budget.close()


def _damage_tensor(path: Path, name: str) -> None:
    """One bit of tensor ``name``'s bytes flipped in the safetensors file at ``path``."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    start, _ = json.loads(data[8 : 8 + length])[name]["data_offsets"]
    data[8 + length + start + 10] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("damaged", [False, True], ids=["intact", "a_workers_second_shard_fails"])
def test_convert_workers_stream_their_shards_to_an_empty_prefix(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checked_by: str, damaged: bool
) -> None:
    from ckptkit.io import upload

    uploaded: list[str] = []  # what this process uploads from a local file
    upload_verified = upload.upload_verified

    def staged(local: Path, url: str) -> str:
        uploaded.append(local.name)
        return upload_verified(local, url)

    monkeypatch.setattr(upload, "upload_verified", staged)
    state = {f"l{i}.weight": torch.randn(3 << 20) for i in range(4)}
    src = tmp_path / "src.safetensors"
    ckptkit.convert_checkpoint(_saved(tmp_path, state), src)  # records each tensor's CRC-32
    url = f"{prefix}/out"
    if damaged:  # the worker writes the second and fourth shards: the second commits, the fourth fails
        _damage_tensor(src, "l3.weight")
        with pytest.raises(ckptkit.errors.CheckpointFormatError, match="worker 1 of 2 .*l3.weight"):
            ckptkit.convert_checkpoint(src, f"{url}/", max_shard_size="13MB", workers=2)
        assert not _fs().exists(url) or not _fs().ls(url), _fs().ls(url)  # every committed shard removed
        assert not _unfinished_uploads(s3_endpoint, _key(url))
        return
    report = ckptkit.convert_checkpoint(src, f"{url}/", max_shard_size="13MB", workers=2)
    names = sorted(n.rsplit("/", 1)[-1] for n in _fs().ls(url))
    assert len([n for n in names if n.endswith(".safetensors")]) == 4, names
    assert uploaded == ["model.safetensors.index.json"], uploaded  # the worker's shards streamed, not uploaded here
    said = [n for n in report.notes if n.startswith(f"{url}/: ")]
    assert sum(int(n.split(": ")[1].split(" ")[0]) for n in said) == 5, report.notes  # each file, by its check
    assert any(n.endswith(f"checked by {checked_by}") for n in said), report.notes
    assert _equal(dict(sorted(ckptkit.read_checkpoint(url).items())), dict(sorted(state.items())))
    assert not list((tmp_path / "staging").iterdir())


@pytest.mark.slow  # worker processes
def test_convert_workers_stream_their_distcp_files_to_an_empty_prefix(
    prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uploaded = _uploads(monkeypatch)
    state = {"model": {f"l{i}.weight": torch.randn(3 << 20) for i in range(3)}, "step": 3}
    ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{prefix}/out/", format="dcp", workers=2, to="keep")
    names = sorted(n.rsplit("/", 1)[-1] for n in _fs().ls(f"{prefix}/out/"))
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp"] and uploaded == [".metadata"], (names, uploaded)
    back = ckptkit.read_checkpoint(f"{prefix}/out")
    assert back["step"] == 3 and _equal(back["model"], state["model"])
    assert ckptkit.verify_checkpoint(f"{prefix}/out").ok
    assert not list((tmp_path / "staging").iterdir())


_SLOW_PARTS = """
import os, time
from ckptkit.io import upload
_send = upload.send_part
def send_part(*a, **k):
    time.sleep(1.5)
    return _send(*a, **k)
upload.send_part = send_part
"""


# Found in review: a worker stopped mid-shard (the parent's own share failed, or the worker was
# killed) left its multipart upload open under the prefix; only its committed objects were removed.
@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("how", ["parent_fails", "worker_killed"])
def test_a_worker_stopped_mid_shard_leaves_no_upload_open(
    prefix: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    import multiprocessing

    from ckptkit.formats.hf import write as hfwrite

    slow = tmp_path / "slowparts"  # loaded by the spawned workers alone: each part waits
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(_SLOW_PARTS)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(slow), os.environ.get("PYTHONPATH")])))
    state = {f"l{i}.weight": torch.randn(8 << 20) for i in range(2)}  # 32 MiB each: a shard each
    url = f"{prefix}/out"
    write_files = hfwrite._write_files

    def parent_share(folder: Path, names: list[str], *a: Any, **k: Any) -> Any:  # in this process only
        if any(n.endswith(".safetensors") for n in names):
            while not _unfinished_uploads(s3_endpoint, _key(url)):  # the worker is streaming its shard
                time.sleep(0.05)
            if how == "parent_fails":
                raise ckptkit.errors.CheckpointWriteError("the parent's own share failed (injected)")
            for child in multiprocessing.active_children():
                if child.name.startswith("ckptkit-worker"):
                    os.kill(child.pid, signal.SIGKILL)
        return write_files(folder, names, *a, **k)

    monkeypatch.setattr(hfwrite, "_write_files", parent_share)
    with pytest.raises(ckptkit.errors.CheckpointWriteError):
        ckptkit.convert_checkpoint(_saved(tmp_path, state), f"{url}/", max_shard_size="40MB", workers=2)
    assert not _fs().exists(url) or not _fs().ls(url), _fs().ls(url)
    assert not _unfinished_uploads(s3_endpoint, _key(url))
