"""Training time lost to checkpointing (sync vs async) and 1 vs 2 process throughput.

    python benchmarks/bench_train.py              # 200 steps each, save every 50 (the default)

Runs the reference trainer as whole processes on the built-in data with a wider MLP (about
8.5M parameters; with AdamW state a checkpoint is ~100 MB) and reads its metrics.jsonl:
``blocking_s`` of each save is the time the training loop waited for it. "Lost" is the sum
of those waits over the training time of the run (the first save's group set-up included).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wide_model() -> object:
    import torch.nn as nn

    return nn.Sequential(
        nn.Linear(32, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 2048),
        nn.ReLU(),
        nn.Linear(2048, 10),
    )


def run(out: Path, nproc: int, *extra: str) -> list[dict]:
    args = [
        "-m",
        "ckptkit.train",
        "--out",
        str(out),
        "--model",
        "benchmarks.bench_train:wide_model",
        "--max-steps",
        "200",
        "--epochs",
        "10",
        "--save-every",
        "50",
        "--log-every",
        "10",
        *extra,
    ]
    launcher = (
        [sys.executable]
        if nproc == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(max(1, os.cpu_count() // nproc))}
    started = time.perf_counter()
    subprocess.run(
        [*launcher, *args], cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    records.append({"event": "wall", "seconds": time.perf_counter() - started})
    return records


def summarize(records: list[dict]) -> dict[str, float]:
    saves = [r for r in records if r.get("event") == "save"]
    interval_saves = [r for r in saves if r["reason"] == "interval"]
    times = [r["time"] for r in records if "loss" in r]
    train_s = times[-1] - [r["time"] for r in records if r.get("event") == "start"][0]
    rates = [r["samples_per_s"] for r in records if "samples_per_s" in r][2:]  # skip warm-up
    lost = sum(r["blocking_s"] for r in interval_saves)
    return {
        "saves": len(interval_saves),
        "median_block_s": statistics.median(r["blocking_s"] for r in interval_saves) if interval_saves else 0.0,
        "lost_s": lost,
        "train_s": train_s,
        "lost_frac": lost / train_s,
        "samples_per_s": statistics.median(rates),
        "ckpt_mb": 0.0,
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ckptkit-bench-train-") as tmp:
        rows = []
        for name, nproc, extra in [
            ("1 process, sync save", 1, []),
            ("1 process, async save", 1, ["--async-save"]),
            ("2 processes, sync save", 2, []),
            ("2 processes, async save", 2, ["--async-save"]),
        ]:
            out = Path(tmp) / name.replace(" ", "_").replace(",", "")
            s = summarize(run(out, nproc, *extra))
            s["ckpt_mb"] = max(p.stat().st_size for p in (out / "checkpoints").glob("step_*.pt")) / 1e6
            rows.append((name, s))
    print(
        f"\n200 optimizer steps, batch 64 per process, a save every 50 steps, checkpoint {rows[0][1]['ckpt_mb']:.0f} MB\n"
    )
    print("| run | saves | median wait per save s | time lost to saving | of training time | samples/s |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, s in rows:
        print(
            f"| {name} | {s['saves']} | {s['median_block_s']:.3f} | {s['lost_s']:.2f} s | {100 * s['lost_frac']:.1f}% | {s['samples_per_s']:.0f} |"
        )
    one = rows[0][1]["samples_per_s"]
    two = rows[2][1]["samples_per_s"]
    print(f"\n2 vs 1 process throughput (sync runs): {two / one:.2f}x on {os.cpu_count()} cores")
    return 0


if __name__ == "__main__":
    sys.exit(main())
