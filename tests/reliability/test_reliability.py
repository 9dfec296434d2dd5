"""Faults, kills and hostile files, many times over; counts go to the session tally.

Default sizes keep CI within minutes; ``--stress N`` multiplies every count. Run
``python tests/reliability/report.py`` to write RELIABILITY.md from one run's tally.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.group import run_group
from tests.reliability import hostile
from tests.reliability import workers as w

pytestmark = pytest.mark.reliability


def campaign(name: str, folder: Path, trials: int, seed: int = 0, timeout: float = 900) -> dict:
    path = os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p)  # a checkout's own src/ kept
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tests.reliability.campaigns",
            name,
            "--trials",
            str(trials),
            "--dir",
            str(folder),
            "--seed",
            str(seed),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ["save", "convert"])
def test_kill_9_during_writes_loses_nothing(tmp_path: Path, stress: int, tally: Counter[str], kind: str) -> None:
    r = campaign(f"kill-{kind}", tmp_path, 100 * stress, seed=stress)
    what = "save_on_master" if kind == "save" else "convert"
    tally[f"kill -9 during {what}: trials"] += r["trials"]
    tally[f"kill -9 during {what}: kills that landed mid-write"] += r["killed_mid_write"]
    lost = r["torn"] + r["unreadable"] + r.get("went_back", 0)
    tally["data lost (torn, unreadable or older checkpoint)"] += lost
    assert lost == 0, r
    assert r["killed_mid_write"] > r["trials"] // 2, r  # the kills really did land during writes
    assert r["max_temps"] <= 1 and r["temps_after"] == 0, r  # debris never accumulates
    if kind == "save":
        assert r["final_loads"] == 1


def test_disk_full_too_large_and_permission_denied(tmp_path: Path, tally: Counter[str]) -> None:
    cases = campaign("disk-faults", tmp_path, 1)["cases"]
    expected = {
        "file too large": "file too large",
        "disk full": "no space left",
        "permission denied": "permission denied",
        "read-only filesystem": "read-only filesystem",
    }
    for case in cases:
        if "skipped" in case:
            tally[f"fault skipped: {case['case']} ({case['skipped']})"] += 1
            continue
        tally[f"fault: {case['case']} during {case['action']}"] += 1
        key = next(k for k in expected if case["case"].startswith(k))
        assert case["error"] and expected[key] in case["error"], case
        assert case["old_intact"] and case["temps"] == 0, case
        tally["data lost (torn, unreadable or older checkpoint)"] += int(not case["old_intact"])


@pytest.mark.dist
@pytest.mark.parametrize("fault", ["file too large", "permission denied"])
def test_fault_on_rank0_raises_on_every_rank(tmp_path: Path, tally: Counter[str], fault: str) -> None:
    if fault == "permission denied" and subprocess.run(["chattr", "-i", str(tmp_path)], capture_output=True).returncode:
        pytest.skip("chattr is not available here")
    (tmp_path / "ckpt.pt").write_bytes(b"previous checkpoint")
    results = run_group(w.save_under_fault, 3, tmp_path, str(tmp_path), fault, timeout=90)
    tally[f"fault on rank 0 of 3: {fault}"] += 1
    hung = sum(r.status == "hung" for r in results)
    tally["hangs"] += hung
    assert hung == 0
    for r in results:
        assert r.status == "ok" and fault in r.value, (r.rank, r.status, r.value, r.message)
    assert (tmp_path / "ckpt.pt").read_bytes() == b"previous checkpoint"


@pytest.mark.dist
@pytest.mark.parametrize("how", ["raises", "dies"])
def test_rank0_failing_mid_save_never_hangs_the_others(
    tmp_path: Path, stress: int, tally: Counter[str], how: str
) -> None:
    for trial in range(2 * stress):
        folder = tmp_path / f"t{trial}"
        folder.mkdir()
        results = run_group(w.rank0_fails, 3, folder, str(folder), how, timeout=90)
        tally[f"rank 0 {how} during a 3-rank save: trials"] += 1
        hung = sum(r.status == "hung" for r in results)
        tally["hangs"] += hung
        assert hung == 0
        expected = "CheckpointWriteError" if how == "raises" else "DistributedError"
        for r in results[1:]:
            assert r.raised(expected), (r.rank, r.status, r.message)


@pytest.mark.slow  # writer processes
def test_a_second_writer_on_one_checkpoint_folder_is_refused_and_nothing_is_lost(
    tmp_path: Path, stress: int, tally: Counter[str]
) -> None:
    r = campaign("concurrent-writers", tmp_path, 3 * stress, seed=stress)
    tally["concurrent writers on one CheckpointFolder: trials"] += r["trials"]
    tally["concurrent writers: the second refused at once"] += r["second writer refused at once"]
    tally["concurrent writers: both wrote"] += r["both writers wrote"]
    tally["concurrent writers: reads of the latest checkpoint beside them"] += r["reads"]
    lost = r["a writer lost its checkpoint or died"] + r["final latest not loadable"]
    tally["data lost (torn, unreadable or older checkpoint)"] += lost
    tally["torn or mixed reads"] += r["latest named a missing file"] + r["reader could not open the latest checkpoint"]
    assert lost == 0 and r["latest named a missing file"] == 0, r
    assert r["reader could not open the latest checkpoint"] == 0, r
    assert r["second writer refused at once"] == r["trials"], r


@pytest.mark.slow  # writer processes and a local S3 server
def test_kill_9_during_s3_uploads_loses_nothing_and_leaves_nothing_growing(
    tmp_path: Path, stress: int, tally: Counter[str]
) -> None:
    pytest.importorskip("moto.server", reason="moto is not installed: the campaign needs a local S3 server")
    pytest.importorskip("s3fs", reason="s3fs is not installed: pip install 'ckptkit[s3]'")
    r = campaign("kill-s3", tmp_path, 8 * stress, seed=stress)
    tally["kill -9 during S3 uploads: trials"] += r["trials"]
    tally["kill -9 during S3 uploads: kills that landed mid-upload"] += r["killed mid-upload"]
    tally["kill -9 during S3 uploads: staging folders left after the next writer"] += r[
        "staging folders left after the next writer"
    ]
    tally["kill -9 during S3 uploads: multipart uploads left after the next writer"] += r[
        "multipart uploads left after the next writer"
    ]
    lost = r["torn"] + r["unreadable"] + r["went_back"]
    tally["data lost (torn, unreadable or older checkpoint)"] += lost
    assert lost == 0, r
    assert r["final writer"] == "done", r
    assert r["staging folders left after the next writer"] == 0, r
    assert r["killed mid-upload"] > 0, r  # the kills really did land during uploads


def test_readers_never_see_a_mix_while_the_file_is_rewritten(tmp_path: Path, stress: int, tally: Counter[str]) -> None:
    r = campaign("read-while-rewriting", tmp_path, 200 * stress)
    tally["reads while the file was being replaced"] += r["reads"]
    tally["converts while the source was being replaced"] += r["converts"]
    tally["torn or mixed reads"] += r["mixed"] + r["unreadable"] + r["mixed_converts"]
    assert r["mixed"] == 0 and r["unreadable"] == 0 and r["mixed_converts"] == 0, r
    assert r["versions_seen"] > 10, r  # the writer really did replace the file under the readers


def test_hostile_inputs_end_in_clean_errors(tmp_path: Path, stress: int, tally: Counter[str]) -> None:
    r = campaign("hostile-inputs", tmp_path, stress, seed=stress)
    tally["hostile inputs"] += r["inputs"]
    for family, n in r["families"].items():
        tally[f"hostile inputs: {family}"] += n
    tally["hostile input x library reader runs"] += r["inputs"] * 6
    tally["hostile input x CLI command runs"] += r["inputs"] * 4
    tally["unexpected exceptions, tracebacks or debris"] += len(r["findings"])
    tally["payload bit flips"] += r["payload_flips"]
    tally["payload bit flips caught by verify"] += r["payload_flips_caught_by_verify"]
    assert r["findings"] == [], "\n".join(r["findings"][:20])
    assert r["payload_flips"] > 0 and r["payload_flips_caught_by_verify"] == r["payload_flips"]


def test_code_payloads_never_run(tmp_path: Path, tally: Counter[str]) -> None:
    r = campaign("code-payloads", tmp_path, 1)
    tally["code payload files"] += r["payload_files"]
    tally["code payload x reader runs"] += r["runs"]
    tally["payloads executed"] += r["executed"]
    assert r["executed"] == 0 and r["findings"] == [], r
    assert r["control_ran_when_trusted"] is True  # the marker check itself works


def test_fuzzer_finds_nothing(tmp_path: Path, stress: int, tally: Counter[str]) -> None:
    r = campaign("fuzz", tmp_path, 150 * stress, seed=0 if stress == 1 else stress)
    tally["fuzz examples (hypothesis)"] += r["examples"]
    tally["unexpected exceptions, tracebacks or debris"] += len(r["findings"])
    assert r["findings"] == [], r["findings"]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "fixtures" / "regressions").glob("*.pt")))
def test_regression_inputs(tmp_path: Path, name: str, tally: Counter[str]) -> None:
    path = ROOT / "fixtures" / "regressions" / name
    problems = hostile.check_library(path, tmp_path / "out.pt") + hostile.check_cli(path, tmp_path / "cli.pt")[0]
    tally["regression inputs"] += 1
    assert problems == []


@pytest.mark.dist
def test_trainer_survives_kill_9_and_worker_death(tmp_path: Path, stress: int, tally: Counter[str]) -> None:
    from tests.train.test_trainer import assert_same_final, finish, kill_tree, launch, records, wait_for_step, worker

    straight = tmp_path / "straight"
    assert finish(launch(straight, 2)) == 0
    rng = random.Random(1000 + stress)
    for trial in range(2 * stress):
        out = tmp_path / f"killed{trial}"
        proc = launch(out, 2)
        wait_for_step(out, rng.randint(4, 28), proc)
        kill_tree(proc.pid, signal.SIGKILL)  # the whole job: torchrun and every worker
        proc.wait()
        assert finish(launch(out, 2)) == 0
        assert_same_final(straight, out)
        tally["kill -9 of a whole torchrun job: trials"] += 1
        tally["kill -9 of a whole torchrun job: resumed bit-identical"] += 1
    out = tmp_path / "restarted"
    proc = launch(out, 2, max_restarts=2)
    wait_for_step(out, rng.randint(6, 24), proc)
    os.kill(worker(proc.pid, 1), signal.SIGKILL)
    assert finish(proc) == 0
    assert [r for r in records(out) if r.get("event") == "resumed"]
    assert_same_final(straight, out)
    tally["kill -9 of one worker under torchrun --max-restarts: trials"] += 1
    tally["kill -9 of one worker under torchrun --max-restarts: recovered bit-identical"] += 1
