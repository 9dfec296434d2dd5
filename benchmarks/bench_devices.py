"""Does each speed device in convert pay for itself? An A/B of each, in one run (issue 24).

    python benchmarks/bench_devices.py                 # 1 GiB inputs, 5 interleaved rounds
    python benchmarks/bench_devices.py --gib 0.25 --runs 3 --dir /tmp/bench

The devices, each switched off in this process by replacing the one function that decides it:

- **padding**: a zip record's extra field, and the start of a safetensors data section, keep
  long copies at their source's offset within a page (``page_pad``, ``page_residue``); off,
  records are padded to the 64-byte alignment only and safetensors data starts where the header
  ends.
- **find-ahead**: while the kernel copies a DCP chunk, a helper thread reads the next chunks'
  zip headers (``DcpSource.ahead``); off, each chunk is found when its turn comes.

Two more were measured here and removed for not paying (BENCHMARKS.md): a ``splice`` pipe for
ranges off their page offset, and a safetensors rewrite that copied the data section whole.

Each workload converts a ~1 GiB input (written once, by torch, safetensors and DCP) with every
device on, and with each device that concerns it off, in interleaved rounds (order reversed
every other round); the input is read untimed before each run. ``cp`` + fsync of the same
input, in-process, is the floor. The table gives min / median / max and each variant's median
over the all-on median (above 1: slower without the device).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.bench_save import fsync_tree, make_model, read_all  # noqa: E402


@contextlib.contextmanager
def off(device: str) -> Iterator[None]:
    """``device`` switched off for the block."""
    from ckptkit.formats.dcp import stream
    from ckptkit.formats.safetensors import codec as safetensors
    from ckptkit.formats.torchzip import writer as zipwrite

    saved: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    if device == "padding":
        patch(zipwrite, "page_pad", lambda at, like, length, *, alignment: -at % alignment)
        patch(safetensors, "page_residue", lambda spans: None)
    elif device == "find-ahead":
        opened = stream.open_dcp

        def open_without(*args: object, **kwargs: object) -> stream.DcpSource:
            src = opened(*args, **kwargs)  # type: ignore[arg-type]
            src.ahead.clear()  # nothing to find on the side: each chunk is found at its turn
            return src

        patch(stream, "open_dcp", open_without)
    elif device != "none":
        raise ValueError(device)
    try:
        yield
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def make_inputs(gib: float, folder: Path) -> dict[str, Path]:
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    sd = {f"module.{k}": v for k, v in make_model(gib).state_dict().items()}
    torch.save(sd, folder / "ddp.pt")
    save_file(sd, folder / "ddp.safetensors")
    dcp.save(sd, checkpoint_id=folder / "ddp.dcp", no_dist=True)
    return {"pt": folder / "ddp.pt", "st": folder / "ddp.safetensors", "dcp": folder / "ddp.dcp"}


# workload -> (input, output name, devices to switch off one at a time)
WORKLOADS = {
    "ddp.pt -> single.pt": ("pt", "single.pt", ["padding"]),
    "ddp.pt -> single.safetensors": ("pt", "single.safetensors", ["padding"]),
    "ddp.safetensors -> single.safetensors": ("st", "single.safetensors", ["padding"]),
    "ddp.dcp/ -> single.pt": ("dcp", "single.pt", ["find-ahead"]),
    "ddp.pt -> shards/ (200MB)": ("pt", "shards/", []),
}


def durable_copy(src: Path, dst: Path) -> None:
    if src.is_dir():
        shutil.copytree(src, dst)
    else:
        shutil.copyfile(src, dst)
    fsync_tree(dst)


def main() -> int:
    import ckptkit

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-devices-", dir=args.dir))
    try:
        inputs = make_inputs(args.gib, folder)
        cases: list[tuple[str, str, Callable[[], None]]] = []  # (workload, variant, run)
        for work, (key, out, devices) in WORKLOADS.items():
            src = inputs[key]
            dst = folder / "out" / out.rstrip("/")

            def run(src: Path = src, out: str = out, device: str = "none") -> None:
                (folder / "out").mkdir(exist_ok=True)
                with off(device):
                    extra = {"max_shard_size": "200MB"} if out.endswith("/") else {}
                    ckptkit.convert_checkpoint(src, folder / "out" / out, **extra)  # type: ignore[arg-type]

            cases.append((work, "cp + fsync (the floor)", lambda src=src, dst=dst: durable_copy(src, dst)))
            cases.append((work, "all devices on", run))
            for device in devices:
                cases.append((work, f"{device} off", lambda run=run, device=device: run(device=device)))
        times: dict[tuple[str, str], list[float]] = {(w, v): [] for w, v, _ in cases}
        for r in range(args.runs):
            for work, variant, fn in cases if r % 2 == 0 else cases[::-1]:
                shutil.rmtree(folder / "out", ignore_errors=True)
                (folder / "out").mkdir()
                read_all(inputs[WORKLOADS[work][0]])
                t0 = time.perf_counter()
                fn()
                times[(work, variant)].append(time.perf_counter() - t0)
        fs = os.popen(f"stat -f -c %T {folder}").read().strip()
        print(f"{args.gib:g} GiB inputs, {args.runs} interleaved rounds, in {folder.parent} ({fs})\n")
        print("| workload | variant | s (min / median / max) | median / all on |")
        print("|---|---|---|---:|")
        for work in WORKLOADS:
            base = statistics.median(times[(work, "all devices on")])
            for (w, variant), xs in times.items():
                if w == work:
                    med = statistics.median(xs)
                    print(f"| {work} | {variant} | {min(xs):.2f} / {med:.2f} / {max(xs):.2f} | {med / base:.2f} |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
