"""Saving and loading a state dict that lives on the GPU, against torch's own ways, in one run.

    python benchmarks/bench_gpu.py                        # 1 and 4 GiB, 3 interleaved rounds, under /tmp
    python benchmarks/bench_gpu.py --gib 1 --runs 5 --dir /mnt/nvme --json out.json

The state dict is 32 MiB fp32 weights plus small biases on ``cuda:0``. Three groups, each timed
in interleaved rounds (the order reversed every other round), min / median / max shown, and
ckptkit's median over each peer's median:

- durable saves: ``save_on_master`` (fsyncs itself) against ``torch.save`` followed by an fsync
  of the file, and ``dcp.save`` (its writer fsyncs); and, as the A/B of its one speed device,
  ``save_on_master`` with each storage's copy to the host not overlapped with writing the ones
  before it;
- blocking time of a background save, until the training thread may change the weights again:
  ``AsyncSaver.save`` against ``dcp.async_save`` with a new ``FileSystemWriter`` each time, and
  with one kept writer that caches its pinned staging copy (``cache_staged_state_dict=True``).
  Each is then waited for, untimed, and each has an untimed warm-up save first, since both
  keep pinned buffers between saves;
- loads onto the GPU of the file ``save_on_master`` wrote, its pages read first (untimed):
  ``load_for_rank(map_location="cuda:0")`` against ``torch.load(map_location="cuda:0")``, plain
  and with ``mmap=True``, each ended by a device synchronize. Every loader's result is compared
  with the source once.

Needs CUDA: without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_save import clear, fsync_tree, read_all  # noqa: E402


def make_state(gib: float, device: str) -> dict[str, torch.Tensor]:
    """About ``gib`` GiB of fp32 weights, as 32 MiB tensors with small biases, drawn on ``device``."""
    g = torch.Generator(device=device).manual_seed(0)
    n = max(1, round(gib * 2**30 / (32 << 20)))
    state: dict[str, torch.Tensor] = {}
    for i in range(n):
        state[f"layer{i}.weight"] = torch.randn(4096, 2048, generator=g, device=device)
        state[f"layer{i}.bias"] = torch.randn(4096, generator=g, device=device)
    return state


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(torch.equal(a[k], b[k].to(a[k].device)) for k in a)


def savers(sd: dict[str, torch.Tensor], out: Path) -> dict[str, Callable[[], tuple[float, Path]]]:
    """name -> a durable save returning (seconds, what it wrote)."""
    import torch.distributed.checkpoint as dcp

    import ckptkit

    def ck() -> tuple[float, Path]:
        p, t0 = out / "ckptkit.pt", time.perf_counter()
        ckptkit.save_on_master(sd, p)
        return time.perf_counter() - t0, p

    def ck_in_turn() -> tuple[float, Path]:  # the A/B: each storage copied to the host, then written
        import ckptkit.formats.torchzip.torch as tz

        tz.OVERLAP = False
        try:
            p, t0 = out / "ckptkit-in-turn.pt", time.perf_counter()
            ckptkit.save_on_master(sd, p)
            return time.perf_counter() - t0, p
        finally:
            tz.OVERLAP = True

    def ts() -> tuple[float, Path]:
        p, t0 = out / "torch.pt", time.perf_counter()
        torch.save(sd, p)
        fsync_tree(p)
        return time.perf_counter() - t0, p

    def dc() -> tuple[float, Path]:
        p, t0 = out / "dcp", time.perf_counter()
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(p), no_dist=True)
        return time.perf_counter() - t0, p

    return {
        "ckptkit save_on_master": ck,
        "ckptkit save_on_master, copies not overlapped (A/B)": ck_in_turn,
        "torch.save + fsync": ts,
        "dcp.save": dc,
    }


def async_savers(sd: dict[str, torch.Tensor], out: Path) -> dict[str, Callable[[], tuple[float, Path]]]:
    """name -> a background save returning (seconds the caller was blocked, what it wrote); each
    waits for its write to finish after the clock stops."""
    import torch.distributed.checkpoint as dcp

    import ckptkit

    saver = ckptkit.AsyncSaver()
    kept = dcp.FileSystemWriter(out / "dcp-kept", cache_staged_state_dict=True)

    def ck() -> tuple[float, Path]:
        p, t0 = out / "async.pt", time.perf_counter()
        saver.save(sd, p)
        blocked = time.perf_counter() - t0
        saver.wait()
        return blocked, p

    def dcp_async(writer: Any, p: Path) -> tuple[float, Path]:
        t0 = time.perf_counter()
        pending = dcp.async_save(sd, storage_writer=writer, no_dist=True)
        staged = getattr(pending, "staging_completion", None)  # newer torch: staging may go on after return
        if staged is not None:
            staged.result()
        blocked = time.perf_counter() - t0
        getattr(pending, "upload_completion", pending).result()
        return blocked, p

    return {
        "ckptkit AsyncSaver.save": ck,
        "dcp.async_save, new writer": lambda: dcp_async(dcp.FileSystemWriter(out / "dcp-new"), out / "dcp-new"),
        "dcp.async_save, kept writer (cache_staged_state_dict)": lambda: dcp_async(kept, out / "dcp-kept"),
    }


def loaders(path: Path, device: str) -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    import ckptkit

    return {
        "ckptkit load_for_rank(map_location=cuda)": lambda: ckptkit.load_for_rank(path, map_location=device),
        "torch.load(map_location=cuda)": lambda: torch.load(path, map_location=device, weights_only=True),
        "torch.load(map_location=cuda, mmap=True)": lambda: torch.load(
            path, map_location=device, weights_only=True, mmap=True
        ),
    }


def _then_clear(save: Callable[[], tuple[float, Path]]) -> float:
    """One timed save; what it wrote is removed (untimed) so the next starts on an empty folder."""
    seconds, written = save()
    clear(written)
    return seconds


def _rounds(names: list[str], runs: int, once: Callable[[str], float]) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(runs):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(once(name))
    return times


def _table(title: str, times: dict[str, list[float]], nbytes: int, ours: str) -> list[str]:
    base = statistics.median(times[ours])
    lines = [
        f"### {title}",
        "",
        "| | s (min / median / max) | GB/s (median) | ckptkit / this (median) |",
        "|---|---|---:|---:|",
    ]
    for name, xs in times.items():
        med = statistics.median(xs)
        lines.append(
            f"| {name} | {min(xs):.3f} / {med:.3f} / {max(xs):.3f} | {nbytes / 1e9 / med:.2f} | {base / med:.2f} |"
        )
    return lines + [""]


def bench(gib: float, runs: int, folder: Path, device: str) -> tuple[list[str], dict[str, Any]]:
    sd = make_state(gib, device)
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    out = Path(tempfile.mkdtemp(dir=folder, prefix="bench-gpu-"))
    report: dict[str, Any] = {"gib": gib, "bytes": nbytes, "tensors": len(sd)}
    lines = [f"## {nbytes / 2**30:.2f} GiB state dict on {device}, {len(sd)} tensors, {runs} interleaved rounds", ""]
    try:
        save = savers(sd, out)
        times = _rounds(list(save), runs, lambda name: _then_clear(save[name]))
        report["save"] = times
        lines += _table("Durable save from the GPU", times, nbytes, "ckptkit save_on_master")

        bg = async_savers(sd, out)
        for name in bg:  # warm-up: both sides keep pinned host buffers between saves
            clear(bg[name]()[1])
        times = _rounds(list(bg), runs, lambda name: _then_clear(bg[name]))
        report["async_blocking"] = times
        lines += _table(
            "Background save: time the training thread is blocked", times, nbytes, "ckptkit AsyncSaver.save"
        )

        _, path = save["ckptkit save_on_master"]()
        load = loaders(path, device)
        for name, fn in load.items():  # once, untimed: every loader gives the source's values
            assert _same(sd, fn()), f"{name} did not give back the saved values"

        def one_load(name: str) -> float:
            read_all(path)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            got = load[name]()
            torch.cuda.synchronize()
            seconds = time.perf_counter() - t0
            del got
            torch.cuda.empty_cache()
            return seconds

        times = _rounds(list(load), runs, one_load)
        report["load"] = times
        lines += _table(
            "Load onto the GPU (pages read first)", times, nbytes, "ckptkit load_for_rank(map_location=cuda)"
        )
    finally:
        shutil.rmtree(out, ignore_errors=True)
        del sd
        torch.cuda.empty_cache()
    return lines, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, nargs="+", default=[1.0, 4.0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--json", type=Path, default=None, help="also write every time here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA GPU here; nothing measured", file=sys.stderr)
        return 0
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(args.dir)], capture_output=True, text=True).stdout.strip()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, files in {args.dir} ({fs})\n")
    reports = []
    for gib in args.gib:
        lines, report = bench(gib, args.runs, args.dir, "cuda:0")
        print("\n".join(lines), flush=True)
        reports.append(report)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "device": torch.cuda.get_device_name(0),
                    "torch": torch.__version__,
                    "filesystem": fs,
                    "runs": reports,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
