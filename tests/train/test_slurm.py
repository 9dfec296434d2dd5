"""The trainer under SLURM: srun's ranks, and requeue on the requeue signal, against a real
single-node SLURM (tests/train/slurm_cluster.py) running examples/slurm/train.sbatch as written.

The slow tests signal the batch script themselves (``scancel --signal=USR1 --batch``, what
``#SBATCH --signal=B:USR1@90`` does), except the one about the time limit.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from ckptkit.errors import DistributedError
from ckptkit.train.slurm import Outcome, expand_nodelist, port_for_job, requeue, restarts, torch_env
from tests.conftest import ROOT
from tests.train.slurm_cluster import SlurmCluster
from tests.train.test_trainer import assert_same_final, last_checkpoint, records

SCRIPT = ROOT / "examples" / "slurm" / "train.sbatch"
# 512 samples, batch 32: 8 steps an epoch on 2 tasks; long enough that a signal lands mid-run.
TRAIN = [
    "--data",
    "tests.train_data:small",
    "--batch-size",
    "32",
    "--save-every",
    "5",
    "--log-every",
    "2",
    "--warmup-steps",
    "4",
]


# -- the pure parts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("vm", ["vm"]),
        ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("rack[1-2]-n[1-2]", ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]),
        ("gpu5,x[3]-ib", ["gpu5", "x3-ib"]),
    ],
)
def test_expand_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_nodelist(nodelist) == hosts


def test_expand_nodelist_refuses_a_range_it_cannot_read() -> None:
    with pytest.raises(ValueError, match=r"node list 'n\[a-b\]': \[a-b\] holds 'a-b', expected N or N-M"):
        expand_nodelist("n[a-b]")


@pytest.mark.parametrize(("job", "port"), [("1", 20001), ("12", 20012), ("4321987", 21987), ("20000", 20000)])
def test_port_for_job(job: str, port: int) -> None:
    assert port_for_job(job) == port


TASK = {
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_JOB_NODELIST": "node[01-03,07],gpu5",
    "SLURM_JOB_ID": "12",
}


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        (TASK, {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "node01", "MASTER_PORT": "20012"}),
        (
            {**TASK, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
            {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"},
        ),
        ({**TASK, "WORLD_SIZE": "16", "RANK": "5"}, {}),  # sbatch + torchrun per node: torchrun's wins
        ({**TASK, "RANK": "5"}, {}),
        ({k: v for k, v in TASK.items() if k != "SLURM_STEP_ID"}, {}),  # the batch script itself, not an srun task
        ({**TASK, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, {}),  # one task: no process group
        ({}, {}),
    ],
)
def test_torch_env_maps_srun_tasks_to_ranks(environ: dict[str, str], expected: dict[str, str]) -> None:
    assert torch_env(environ, hostnames=expand_nodelist) == expected


def test_torch_env_takes_the_first_host_from_scontrol_or_its_own_parser() -> None:
    assert torch_env(TASK)["MASTER_ADDR"] == "node01"


def test_torch_env_names_what_it_could_not_read() -> None:
    with pytest.raises(DistributedError, match=r"srun task: cannot tell its rank from .*'SLURM_NTASKS': 'eight'"):
        torch_env({**TASK, "SLURM_NTASKS": "eight"}, hostnames=expand_nodelist)


@pytest.mark.parametrize(
    ("environ", "count"),
    [({}, 0), ({"SLURM_RESTART_COUNT": ""}, 0), ({"SLURM_RESTART_COUNT": "0"}, 0), ({"SLURM_RESTART_COUNT": "2"}, 2)],
)
def test_restart_count_is_zero_until_slurm_sets_it(environ: dict[str, str], count: int) -> None:
    assert restarts(environ) == count


@pytest.fixture
def fake_scontrol(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An ``scontrol`` on PATH that prints $FAKE_SHOW for ``show job``, exits $FAKE_RC for
    ``requeue`` and logs every call."""
    (tmp_path / "scontrol").write_text(
        '#!/bin/sh\necho "$@" >> "$FAKE_LOG"\n'
        'case "$1" in show) echo "$FAKE_SHOW";; requeue) echo "$FAKE_ERR" >&2; exit "$FAKE_RC";; esac\n'
    )
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_LOG", str(tmp_path / "calls"))
    monkeypatch.setenv("FAKE_SHOW", "JobId=12 Requeue=1 Restarts=0")
    monkeypatch.setenv("FAKE_RC", "0")
    monkeypatch.setenv("FAKE_ERR", "")
    return tmp_path / "calls"


USR1, TERM = (signal.SIGUSR1,), (signal.SIGTERM,)


@pytest.mark.parametrize(
    ("stopped_by", "environ", "max_requeues", "fake", "expected", "calls"),
    [
        (
            USR1,
            {"SLURM_JOB_ID": "12"},
            3,
            {},
            Outcome(True, "12", 1, "requeued job 12 (requeue 1 of 3)"),
            ["show job 12", "requeue 12"],
        ),
        (
            (signal.SIGUSR1, signal.SIGTERM),
            {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "2"},
            -1,
            {},
            Outcome(True, "12", 3, "requeued job 12 (requeue 3)"),
            ["show job 12", "requeue 12"],
        ),
        (
            USR1,
            {"SLURM_JOB_ID": "12", "SLURM_RESTART_COUNT": "3"},
            3,
            {},
            Outcome(
                False,
                "12",
                3,
                "not requeued: job 12 was requeued 3 time(s) already (--max-requeues 3); submit it again "
                "to train on from here",
            ),
            [],
        ),
        (
            USR1,
            {"SLURM_JOB_ID": "12"},
            0,
            {},
            Outcome(
                False,
                "12",
                0,
                "not requeued: job 12 was requeued 0 time(s) already (--max-requeues 0); submit it again "
                "to train on from here",
            ),
            [],
        ),
        (
            USR1,
            {"SLURM_JOB_ID": "12"},
            -1,
            {"FAKE_SHOW": "JobId=12 Requeue=0 Restarts=0"},
            Outcome(
                False,
                "12",
                0,
                "not requeued: job 12 was submitted without --requeue (scontrol show job 12: Requeue=0); "
                "submit it with sbatch --requeue, or submit it again to train on from here",
            ),
            ["show job 12"],
        ),
        (
            USR1,
            {"SLURM_JOB_ID": "12"},
            -1,
            {"FAKE_RC": "1", "FAKE_ERR": "Only batch jobs are accepted or processed for job 12"},
            Outcome(
                False,
                "12",
                0,
                "not requeued: scontrol requeue 12 failed: Only batch jobs are accepted or processed for job 12; "
                "submit it again to train on from here",
            ),
            ["show job 12", "requeue 12"],
        ),
        (
            TERM,
            {"SLURM_JOB_ID": "12"},
            -1,
            {},
            Outcome(
                False,
                "12",
                0,
                "not requeued: SIGTERM stopped job 12, not SIGUSR1 (--requeue-signal): it ends here "
                "(scancel, or the time limit without #SBATCH --signal)",
            ),
            [],
        ),
        (
            USR1,
            {},
            -1,
            {},
            Outcome(
                False,
                None,
                0,
                "not requeued: SIGUSR1 stopped the run, but this is no SLURM job (SLURM_JOB_ID is unset)",
            ),
            [],
        ),
        (TERM, {}, -1, {}, None, []),
    ],
)
def test_requeue_decides_from_the_signal_the_count_and_the_job(
    fake_scontrol: Path,
    monkeypatch: pytest.MonkeyPatch,
    stopped_by: tuple[int, ...],
    environ: dict[str, str],
    max_requeues: int,
    fake: dict[str, str],
    expected: Outcome | None,
    calls: list[str],
) -> None:
    for k, v in fake.items():
        monkeypatch.setenv(k, v)
    assert requeue(stopped_by, signal_name="USR1", max_requeues=max_requeues, environ=environ) == expected
    assert (fake_scontrol.read_text().splitlines() if fake_scontrol.exists() else []) == calls


def test_requeue_signal_term_requeues_on_sigterm(fake_scontrol: Path) -> None:
    assert requeue(TERM, signal_name="TERM", max_requeues=-1, environ={"SLURM_JOB_ID": "7"}) == Outcome(
        True, "7", 1, "requeued job 7 (requeue 1)"
    )


def test_stop_signal_tells_which_signals_stopped_it() -> None:
    import ckptkit

    with ckptkit.StopSignal((signal.SIGTERM, signal.SIGUSR1)) as stop:
        assert (stop.should_stop(), stop.stopped_by) == (False, ())
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert (stop.should_stop(), stop.stopped_by) == (True, (signal.SIGUSR1, signal.SIGTERM))


# -- a real SLURM --------------------------------------------------------------------------------


def submit(slurm: SlurmCluster, out: Path, *sbatch: str, args: tuple[str, ...] = ()) -> str:
    """examples/slurm/train.sbatch, two tasks, as written but for the options given."""
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}",
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }  # the script's `python` is this one
    return slurm.sbatch(
        SCRIPT,
        "--ntasks-per-node=2",
        f"--output={out}/slurm.out",
        "--chdir",
        str(ROOT),
        *sbatch,
        env=env,
        args=("--out", str(out), *TRAIN, *args),
    )


def events(out: Path, name: str) -> list[dict]:
    return [r for r in records(out) if r.get("event") == name]


# SIGNALING: slurmctld is delivering a signal (the time-limit USR1) to a running job.
ALIVE = ("PENDING", "RUNNING", "REQUEUED", "COMPLETING", "CONFIGURING", "SIGNALING")


def wait_for_records(
    slurm: SlurmCluster, job: str, out: Path, ready: Callable[[list[dict]], bool], what: str, *, alive: bool = True
) -> list[dict]:
    """Poll OUT/metrics.jsonl until ``ready(records)``; with ``alive``, fail at once if the job ends first."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        found = records(out)
        if ready(found):
            return found
        state = slurm.job(job).get("JobState")
        assert not alive or state in ALIVE, (
            f"job {job} is {state} before {what}:\n{(out / 'slurm.out').read_text()[-3000:]}"
        )
        time.sleep(0.05)
    raise AssertionError(f"job {job}: {what} not seen in 240 s:\n{(out / 'slurm.out').read_text()[-3000:]}")


def signal_mid_run(slurm: SlurmCluster, job: str, out: Path, run: int, steps: int = 6) -> None:
    """Once run number ``run`` of the job has trained ``steps`` steps, USR1 to its batch script."""

    def ready(found: list[dict]) -> bool:
        starts = [i for i, r in enumerate(found) if r.get("event") == "start"]
        if len(starts) < run:
            return False
        begun = found[starts[run - 1] + 1 :]
        first = next((r["step"] for r in begun if r.get("event") == "resumed"), 0)
        return any("loss" in r and r["step"] >= first + steps for r in begun)

    wait_for_records(slurm, job, out, ready, f"step +{steps} of run {run}")
    slurm.run("scancel", "--signal=USR1", "--batch", job)


def requeue_lines(out: Path) -> list[str]:
    return [r["message"] for r in events(out, "requeue")]


@pytest.mark.slow
def test_preempted_twice_requeued_and_resumed_gives_the_uninterrupted_weights(
    slurm: SlurmCluster, tmp_path: Path
) -> None:
    args = ("--epochs", "12", "--max-requeues", "2")
    straight = tmp_path / "straight"
    assert slurm.wait_until_done(submit(slurm, straight, args=args)) == "COMPLETED"
    out = tmp_path / "requeued"
    job = submit(slurm, out, args=args)
    signal_mid_run(slurm, job, out, run=1)
    signal_mid_run(slurm, job, out, run=2)
    assert slurm.wait_until_done(job) == "COMPLETED"
    assert slurm.job(job)["Restarts"] == "2"
    assert requeue_lines(out) == [f"requeued job {job} (requeue 1 of 2)", f"requeued job {job} (requeue 2 of 2)"]
    ends = [(e["status"], e["step"]) for e in events(out, "end")]
    resumed = [e["step"] for e in events(out, "resumed")]
    assert [s for s, _ in ends] == ["preempted", "preempted", "done"] and resumed == [ends[0][1], ends[1][1]]
    assert_same_final(straight, out)  # weights, optimizer, scheduler, sampler, RNG: bit for bit
    log = (out / "slurm.out").read_text()  # --open-mode=append: all three runs in one file
    assert log.count("[start]") == 3 and f"requeued job {job} (requeue 2 of 2)" in log


@pytest.mark.slow
def test_after_max_requeues_it_saves_and_ends(slurm: SlurmCluster, tmp_path: Path) -> None:
    out = tmp_path / "run"
    job = submit(slurm, out, args=("--epochs", "12", "--max-requeues", "1"))
    signal_mid_run(slurm, job, out, run=1)
    signal_mid_run(slurm, job, out, run=2)
    assert slurm.wait_until_done(job) == "COMPLETED"
    assert slurm.job(job)["Restarts"] == "1"
    assert requeue_lines(out) == [
        f"requeued job {job} (requeue 1 of 1)",
        f"not requeued: job {job} was requeued 1 time(s) "
        "already (--max-requeues 1); submit it again to train on from here",
    ]
    end = events(out, "end")[-1]
    assert end["status"] == "preempted" and last_checkpoint(out).name == f"step_{end['step']:09d}.pt"


@pytest.mark.slow
@pytest.mark.parametrize("how", ["no --requeue", "scancel"])
def test_a_job_that_cannot_requeue_saves_and_ends(slurm: SlurmCluster, tmp_path: Path, how: str) -> None:
    out = tmp_path / "run"
    job = submit(slurm, out, *(["--no-requeue"] if how == "no --requeue" else []), args=("--epochs", "12"))
    if how == "scancel":
        wait_for_records(slurm, job, out, lambda found: any("loss" in r and r["step"] >= 6 for r in found), "step 6")
        slurm.run("scancel", job)  # SIGTERM to every process of the job
        line = (
            f"not requeued: SIGTERM stopped job {job}, not SIGUSR1 (--requeue-signal): it ends here (scancel, or "
            "the time limit without #SBATCH --signal)"
        )
    else:
        signal_mid_run(slurm, job, out, run=1)
        line = (
            f"not requeued: job {job} was submitted without --requeue (scontrol show job {job}: Requeue=0); submit it "
            "with sbatch --requeue, or submit it again to train on from here"
        )
    assert slurm.wait_until_done(job) == ("CANCELLED" if how == "scancel" else "COMPLETED")
    # A cancelled job is CANCELLED at once, while its processes still save and say so.
    found = wait_for_records(
        slurm, job, out, lambda found: any(r.get("event") == "requeue" for r in found), "the line", alive=False
    )
    assert [r["message"] for r in found if r.get("event") == "requeue"] == [line]
    assert slurm.job(job)["Restarts"] == "0"
    end = events(out, "end")[-1]
    assert end["status"] == "preempted" and last_checkpoint(out).name == f"step_{end['step']:09d}.pt"


@pytest.mark.slow
def test_the_time_limit_signal_requeues_before_the_limit(slurm: SlurmCluster, tmp_path: Path) -> None:
    # USR1 15 s before a 1-minute limit. slurmctld checks limits on a timer, so it may come up to
    # one period earlier, never later; enough epochs that the run still trains by then.
    out = tmp_path / "run"
    job = submit(slurm, out, "--time=1", "--signal=B:USR1@15", args=("--epochs", "1000"))
    found = wait_for_records(
        slurm, job, out, lambda found: any(r.get("event") == "resumed" for r in found), "the requeued run"
    )
    slurm.run("scancel", job)
    assert [r["message"] for r in found if r.get("event") == "requeue"] == [f"requeued job {job} (requeue 1)"]
    ends = [(r["status"], r["step"]) for r in found if r.get("event") == "end"]
    assert ends == [("preempted", next(r["step"] for r in found if r.get("event") == "resumed"))]
    assert slurm.wait_until_done(job) == "CANCELLED" and slurm.job(job)["Restarts"] == "1"


def test_the_docs_show_the_sbatch_file_as_it_is() -> None:
    """The README links the file; the trainer page includes it whole, so neither can drift from it."""
    assert "](examples/slurm/train.sbatch)" in (ROOT / "README.md").read_text()
    assert '```bash\n--8<-- "examples/slurm/train.sbatch"\n```' in (ROOT / "docs" / "trainer.md").read_text()
