"""A real single-node SLURM for tests: munged, slurmctld and slurmd in the foreground, everything
(state, spool, logs, the munge socket) under one folder, no systemd, no cgroups.

Example:
    >>> cluster = SlurmCluster.start(Path("/tmp/slurm"))  # doctest: +SKIP
    >>> job = cluster.sbatch(Path("job.sh"), "--ntasks=2")  # doctest: +SKIP
    >>> cluster.wait_until_done(job)  # doctest: +SKIP
    'COMPLETED'
    >>> cluster.stop()  # doctest: +SKIP
"""

from __future__ import annotations

import os
import pwd
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

# A requeued job may start again only once the credentials of its last run have expired; the
# default (120 s) would make every requeue in these tests wait two minutes.
CRED_EXPIRE_S = 10
DAEMONS = ("munged", "slurmctld", "slurmd", "scontrol", "sbatch")
FINISHED = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}


def missing_binaries() -> list[str]:
    """The SLURM/munge programs this machine lacks (apt-get install slurm-wlm munge)."""
    return [name for name in DAEMONS if shutil.which(name) is None and not Path("/usr/sbin", name).exists()]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _cpus() -> int:
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    return int(re.search(r"\bCPUs=(\d+)", out).group(1))  # type: ignore[union-attr]


@dataclass
class SlurmCluster:
    """One node, one partition (``debug``), jobs run as the user who started it (root allowed)."""

    root: Path
    env: dict[str, str]
    procs: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def start(cls, root: Path) -> SlurmCluster:
        root.mkdir(parents=True, exist_ok=True)
        for sub in ("state", "spool", "log", "munge"):
            (root / sub).mkdir(exist_ok=True)
        # munged refuses a socket folder others can write to, and clients must reach into it.
        os.chmod(root, 0o755)
        os.chmod(root / "munge", 0o755)
        key = root / "munge" / "munge.key"
        subprocess.run(["mungekey", "--create", "--force", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o400)
        sock = root / "munge" / "munge.socket"
        host = socket.gethostname().split(".")[0]  # slurmd finds its NodeName by `hostname -s`
        conf = root / "slurm.conf"
        conf.write_text(f"""\
ClusterName=ckptkit-test
SlurmctldHost={host}(127.0.0.1)
SlurmUser={pwd.getpwuid(os.getuid()).pw_name}
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={sock},cred_expire={CRED_EXPIRE_S}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
ReturnToService=2
MinJobAge=300
KillWait=30
NodeName={host} NodeAddr=127.0.0.1 CPUs={_cpus()} RealMemory=100 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP
""")
        env = {**os.environ, "SLURM_CONF": str(conf)}
        cluster = cls(root, env)
        try:
            cluster._spawn(
                [
                    "munged",
                    "--foreground",
                    "--force",
                    f"--socket={sock}",
                    f"--key-file={key}",
                    f"--pid-file={root}/munge/munged.pid",
                    f"--log-file={root}/log/munged.log",
                    f"--seed-file={root}/munge/munged.seed",
                ]
            )
            cluster._wait(lambda: sock.exists(), "munged's socket", root / "log" / "munged.log")
            cluster._spawn(["slurmctld", "-D", "-i"])
            cluster._wait(
                lambda: cluster.run("scontrol", "ping", check=False).returncode == 0,
                "slurmctld",
                root / "log" / "slurmctld.log",
            )
            cluster._spawn(["slurmd", "-D"])
            cluster._wait(
                lambda: "idle" in cluster.run("sinfo", "-h", "-o", "%T").stdout,
                "an idle node",
                root / "log" / "slurmd.log",
            )
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _spawn(self, cmd: list[str]) -> None:
        name = Path(cmd[0]).name
        log = open(self.root / "log" / f"{name}.out", "w")
        self.procs.append(
            subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )

    def _wait(self, ready: Callable[[], bool], what: str, log: Path, timeout: float = 60) -> None:
        deadline, dead = time.monotonic() + timeout, []
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.05)
        tail = log.read_text()[-2000:] if log.exists() else "(no log)"
        raise RuntimeError(f"SLURM test cluster: {what} not ready in {timeout:g} s (exited: {dead}); {log}:\n{tail}")

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """A SLURM client command against this cluster."""
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def sbatch(self, script: Path, *options: str, env: dict[str, str] | None = None, args: tuple[str, ...] = ()) -> str:
        """Submit ``script ARGS``; returns the job id. ``env`` is the job's environment (sbatch exports it)."""
        cmd = ["sbatch", "--parsable", *options, str(script), *args]
        done = subprocess.run(
            cmd,
            env={**(env or os.environ), "SLURM_CONF": self.env["SLURM_CONF"]},
            capture_output=True,
            text=True,
            timeout=60,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: exit status {done.returncode}: {done.stderr.strip()}")
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, Restarts, Requeue, ExitCode, ...)."""
        out = self.run("scontrol", "show", "job", "--oneliner", job_id).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_for(
        self, job_id: str, ready: Callable[[dict[str, str]], bool], what: str, timeout: float = 240
    ) -> dict[str, str]:
        """Poll the job until ``ready(job)`` is true; returns that job record."""
        deadline = time.monotonic() + timeout
        job: dict[str, str] = {}
        while time.monotonic() < deadline:
            job = self.job(job_id)
            if ready(job):
                return job
            time.sleep(0.1)
        raise AssertionError(f"job {job_id}: {what} not seen in {timeout:g} s; last state {job.get('JobState')}: {job}")

    def wait_until_done(self, job_id: str, timeout: float = 240) -> str:
        """The job's final state, once it has one (COMPLETED, FAILED, ...)."""
        return self.wait_for(job_id, lambda j: j.get("JobState") in FINISHED, "a final state", timeout)["JobState"]

    def stop(self) -> None:
        """Cancel every job, wait for the queue to empty, then end the daemons (slurmd first)."""
        if self.procs and self.run("scontrol", "ping", check=False).returncode == 0:
            self.run("scancel", "--user", str(os.getuid()), check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).stdout.strip():
                time.sleep(0.2)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.procs.clear()
