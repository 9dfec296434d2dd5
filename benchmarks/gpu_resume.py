"""``ckptkit train`` on one GPU for about a minute, killed with SIGKILL mid-run and resumed, against
an uninterrupted run of the same command: the final weights and checkpoint must be bit-identical.

    python benchmarks/gpu_resume.py --out /tmp/gpu_resume              # --amp bf16 and --async-save
    python benchmarks/gpu_resume.py --out /tmp/r --device cpu --seconds 20   # the same on the CPU

A short probe first times an epoch of each configuration, so each run lasts about ``--seconds``. For each
configuration, the uninterrupted run and the interrupted one run side by side (the GPU is far
from full); the interrupted one is killed (SIGKILL to the launcher and every worker, nothing
saved at the kill) once it is past ``--kill-at`` of its steps, then the same command runs again
and resumes from the newest intact checkpoint. Exits 1 if any tensor differs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from tests.train.test_trainer import kill_tree, records  # noqa: E402

STEPS_PER_EPOCH = 8192 // 64  # the built-in task, default batch size, one process
CONFIGS = {"bf16": ["--amp", "bf16"], "async": ["--async-save"]}


def command(out: Path, device: str, epochs: int, extra: list[str]) -> list[str]:
    exe = shutil.which("ckptkit")
    head = [exe] if exe else [sys.executable, "-m", "ckptkit.cli"]
    return [*head, "train", "--nproc", "1", "--out", str(out), "--device", device, "--epochs", str(epochs), *extra]


def start(cmd: list[str], out: Path) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"launch-{time.monotonic_ns()}.log", "w")
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def last_step(out: Path) -> int:
    return max((r["step"] for r in records(out) if "loss" in r), default=-1)


def seconds_per_epoch(folder: Path, device: str, configs: list[str]) -> float:
    """Two epochs of every configuration at once, timed: about the load of the runs to come, which
    run two per configuration."""
    procs = {
        name: start(command(folder / f"probe-{name}", device, 2, CONFIGS[name]), folder / f"probe-{name}")
        for name in configs
    }
    per_epoch = []
    for name, proc in procs.items():
        if proc.wait(timeout=300) != 0:
            logs = sorted((folder / f"probe-{name}").glob("launch-*.log"))
            tail = "".join(logs[-1].read_text().splitlines(keepends=True)[-30:]) if logs else ""
            raise RuntimeError(f"the probe run failed ({proc.returncode}): {logs[-1] if logs else folder}\n{tail}")
        evals = [r["time"] for r in records(folder / f"probe-{name}") if "val_acc" in r]  # step 0, each epoch's end
        per_epoch.append((evals[-1] - evals[0]) / (len(evals) - 1))
    return 2 * max(per_epoch)  # twice as many runs at once as in the probe


def flat(obj: Any, where: str = "") -> dict[str, Any]:
    """Every leaf of a nested checkpoint, by path."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in flat(val, f"{where}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in flat(val, f"{where}[{i}]").items()}
    return {where: obj}


def differences(a: Path, b: Path) -> tuple[int, list[str]]:
    """(leaves compared, paths that differ) between two runs' final weights and last checkpoints."""
    from safetensors.torch import load_file

    ckpts = [sorted((d / "checkpoints").glob("step_*.pt"))[-1] for d in (a, b)]
    if ckpts[0].name != ckpts[1].name:
        return 0, [f"last checkpoints differ: {ckpts[0].name} vs {ckpts[1].name}"]
    left = {"weights": load_file(a / "model.safetensors"), "ckpt": torch.load(ckpts[0], weights_only=True)}
    right = {"weights": load_file(b / "model.safetensors"), "ckpt": torch.load(ckpts[1], weights_only=True)}
    fa, fb = flat(left), flat(right)
    if list(fa) != list(fb):
        return 0, [f"different entries: {sorted(set(fa) ^ set(fb))[:5]}"]
    bad = []
    for k, x in fa.items():
        y = fb[k]
        same = torch.equal(x, y) and x.dtype == y.dtype if isinstance(x, torch.Tensor) else x == y
        if not same:
            bad.append(k)
    return len(fa), bad


def run_config(name: str, folder: Path, device: str, epochs: int, kill_at: float) -> dict[str, Any]:
    extra = CONFIGS[name]
    straight, killed = folder / f"{name}-straight", folder / f"{name}-killed"
    total = epochs * STEPS_PER_EPOCH
    t0 = time.monotonic()
    a = start(command(straight, device, epochs, extra), straight)
    b = start(command(killed, device, epochs, extra), killed)
    target = int(total * kill_at)
    while last_step(killed) < target:
        if b.poll() is not None:
            raise RuntimeError(
                f"{name}: the run to be killed ended ({b.returncode}) before step {target}; see {killed}"
            )
        time.sleep(0.005)
    kill_tree(b.pid, signal.SIGKILL)
    b.wait()
    killed_after = last_step(killed)
    saved = sorted(p.name for p in (killed / "checkpoints").glob("step_*.pt"))
    b2 = start(command(killed, device, epochs, extra), killed)
    codes = (a.wait(timeout=900), b2.wait(timeout=900))
    seconds = time.monotonic() - t0
    resumed = [r for r in records(killed) if r.get("event") == "resumed"]
    compared, bad = differences(straight, killed) if codes == (0, 0) else (0, [f"exit codes {codes}"])
    return {
        "config": name,
        "args": " ".join(extra),
        "epochs": epochs,
        "steps": total,
        "wall_s": round(seconds, 1),
        "killed_after_step": killed_after,
        "checkpoints_at_kill": saved[-2:],
        "resumed_from_step": resumed[-1]["step"] if resumed else None,
        "compared": compared,
        "differ": bad[:10],
        "bit_identical": not bad and compared > 0 and bool(resumed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--seconds", type=float, default=60, help="about how long each run trains")
    parser.add_argument("--kill-at", type=float, default=0.45, help="fraction of the steps after which to kill")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_resume: no CUDA GPU here; nothing run", file=sys.stderr)
        return 0
    shutil.rmtree(args.out, ignore_errors=True)
    per_epoch = seconds_per_epoch(args.out, args.device, args.configs)
    epochs = max(2, math.ceil(args.seconds / per_epoch))
    print(
        f"probe: {per_epoch:.2f} s an epoch of {STEPS_PER_EPOCH} steps on {args.device}: {epochs} epochs a run",
        flush=True,
    )
    with ThreadPoolExecutor(len(args.configs)) as pool:  # side by side: each run leaves the GPU mostly idle
        results = list(
            pool.map(lambda name: run_config(name, args.out, args.device, epochs, args.kill_at), args.configs)
        )
    for r in results:
        print(json.dumps(r))
    print(
        "\n| config | steps | wall s (both runs) | killed after step | resumed from step | leaves compared | bit-identical |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(
            f"| `{r['args']}` | {r['steps']} | {r['wall_s']} | {r['killed_after_step']} | {r['resumed_from_step']} |"
            f" {r['compared']} | {'yes' if r['bit_identical'] else 'NO ' + ', '.join(r['differ'])} |"
        )
    return 0 if all(r["bit_identical"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
