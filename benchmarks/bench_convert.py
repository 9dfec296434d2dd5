"""Speed and memory of ``ckptkit convert`` / ``inspect`` against ``cp`` and the naive script.

    python benchmarks/bench_convert.py                 # ~1 GiB checkpoint, median of 5
    python benchmarks/bench_convert.py --gib 4 --runs 1 --only-memory

Every figure is a whole process, timed in this run, with the page cache warm (each input is
re-read, untimed, right before each timed run: a daemon here evicts idle page cache within
seconds), the commands interleaved, min/median/max reported. Memory is the peak of ``RssAnon`` from /proc/PID/status sampled
every 2 ms: private memory only, because the file pages of a memory map are reclaimable
and ``ru_maxrss`` would count them. ckptkit fsyncs what it writes (durability); ``cp`` does
not, so the table also shows ``cp`` followed by ``sync FILE`` for comparison.
"""

from __future__ import annotations

import argparse
import compileall
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import ckptkit  # torch-free: the package's own module, to find its files

T = TypeVar("T")

NAIVE_PT = """
import sys, torch
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
sd = {k.removeprefix("module."): v for k, v in sd.items()}
torch.save(sd, sys.argv[2])
"""
NAIVE_ST = """
import sys, torch
from safetensors.torch import save_file
sd = torch.load(sys.argv[1], map_location="cpu", weights_only=True)
save_file({k.removeprefix("module."): v.contiguous() for k, v in sd.items()}, sys.argv[2])
"""
NAIVE_ST_ST = """
import sys
from safetensors.torch import load_file, save_file
sd = load_file(sys.argv[1])
save_file({k.removeprefix("module."): v for k, v in sd.items()}, sys.argv[2])
"""


def gpt_dims(gib: float) -> tuple[int, int, int, int]:
    """``(d, vocab, ff, layers)`` of the GPT-like model whose fp32 weights are about ``gib`` GiB."""
    d, vocab, ff = 1024, 32000, 4096
    per_layer = 4 * d * d + 2 * d * ff + 4 * d + ff + 5 * d
    return d, vocab, ff, max(1, round((gib * 2**30 / 4 - 2 * vocab * d) / per_layer))


def make_checkpoint(folder: Path, gib: float) -> tuple[Path, Path]:
    """A GPT-like DDP state dict (module. keys, fp32) of about ``gib`` GiB, as .pt and .safetensors."""
    import torch
    from safetensors.torch import save_file

    d, vocab, ff, layers = gpt_dims(gib)
    g = torch.Generator().manual_seed(0)
    sd: dict[str, torch.Tensor] = {"module.embed.weight": torch.randn(vocab, d, generator=g)}
    for i in range(layers):
        p = f"module.layers.{i}."
        sd |= {
            p + "ln1.weight": torch.ones(d),
            p + "ln1.bias": torch.zeros(d),
            p + "attn.qkv.weight": torch.randn(3 * d, d, generator=g),
            p + "attn.qkv.bias": torch.zeros(3 * d),
            p + "attn.proj.weight": torch.randn(d, d, generator=g),
            p + "attn.proj.bias": torch.zeros(d),
            p + "ln2.weight": torch.ones(d),
            p + "ln2.bias": torch.zeros(d),
            p + "mlp.up.weight": torch.randn(ff, d, generator=g),
            p + "mlp.up.bias": torch.zeros(ff),
            p + "mlp.down.weight": torch.randn(d, ff, generator=g),
            p + "mlp.down.bias": torch.zeros(d),
        }
    sd |= {"module.ln_f.weight": torch.ones(d), "module.head.weight": torch.randn(vocab, d, generator=g)}
    pt, st = folder / "ddp.pt", folder / "ddp.safetensors"
    torch.save(sd, pt)
    save_file(sd, st)
    return pt, st


def _rss_anon_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (``convert --workers`` spawns some)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def run(cmd: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RssAnon (MiB) of one process, with any it starts (summed at each sample)."""
    peak = 0
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def sample() -> None:
        nonlocal peak
        while proc.poll() is None:
            peak = max(peak, sum(_rss_anon_kb(p) for p in _tree(proc.pid)))
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    _, err = proc.communicate()
    elapsed = time.perf_counter() - start
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {err.decode()[-2000:]}")
    return elapsed, peak // 1024


def warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def compile_ckptkit() -> None:
    """Byte-compile ckptkit once, untimed, as ``pip install`` does: each timed process then starts
    as an installed ckptkit does. (This machine sets PYTHONDONTWRITEBYTECODE, so without this every
    process would compile each module it imports, ~45 ms more per command.)"""
    compileall.compile_dir(Path(ckptkit.__file__).parent, quiet=1)


def add_common_args(ap: argparse.ArgumentParser, *, runs: int, only_memory: str) -> None:
    """The options every convert benchmark takes: size, runs, scratch folder, memory-only."""
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=runs)
    ap.add_argument("--dir", type=Path, default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--only-memory", action="store_true", help=only_memory)


def spread(ts: list[float]) -> str:
    """``min / median / max`` seconds, as every table here shows a command's runs."""
    return f"{min(ts):.3f} / {statistics.median(ts):.3f} / {max(ts):.3f}"


def rounds(cases: list[T], runs: int) -> Iterator[T]:
    """Every case once per round, the order reversed every other round: the command before a
    timed one leaves the disk busy writing back, so a fixed order would always slow the same one."""
    for r in range(runs):
        yield from (cases if r % 2 == 0 else cases[::-1])


def paired(name: str, ts: list[float], base_name: str, base: list[float]) -> str:
    """Run-by-run ratios of ``ts`` to ``base`` (run i of each in the same round), which this
    disk's minute-to-minute drift hits alike: the comparison medians of far-apart runs blur."""
    r = [t / b for t, b in zip(ts, base, strict=True)]
    return (
        f"{name} / {base_name}, run by run: median {statistics.median(r):.3f} "
        f"(min {min(r):.3f}, max {max(r):.3f}); faster in {sum(x < 1 for x in r)} of {len(r)} rounds"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, runs=5, only_memory="only the ckptkit converts (for big --gib)")
    args = ap.parse_args()
    compile_ckptkit()
    scratch = Path(tempfile.mkdtemp(dir=args.dir, prefix="ckptkit-bench-"))
    try:
        pt, st = make_checkpoint(scratch, args.gib)
        size = pt.stat().st_size
        for p in (pt, st):
            warm(p)
        ck = [sys.executable, "-m", "ckptkit.cli"]
        o = scratch / "out"
        cases = [
            ("cp ddp.pt", ["cp", str(pt), f"{o}.pt"], f"{o}.pt", "base_pt"),
            ("cp ddp.pt && sync", ["sh", "-c", f"cp {pt} {o}.pt && sync {o}.pt"], f"{o}.pt", None),
            ("ckptkit convert ddp.pt single.pt", [*ck, "convert", str(pt), f"{o}.pt"], f"{o}.pt", "pt"),
            ("naive torch.load/save .pt", [sys.executable, "-c", NAIVE_PT, str(pt), f"{o}.pt"], f"{o}.pt", "naive_pt"),
            ("cp ddp.safetensors", ["cp", str(st), f"{o}.safetensors"], f"{o}.safetensors", "base_st"),
            (
                "cp ddp.safetensors && sync",
                ["sh", "-c", f"cp {st} {o}.safetensors && sync {o}.safetensors"],
                f"{o}.safetensors",
                None,
            ),
            (
                "ckptkit convert ddp.safetensors single.safetensors",
                [*ck, "convert", str(st), f"{o}.safetensors"],
                f"{o}.safetensors",
                "st",
            ),
            (
                "naive safetensors load/save",
                [sys.executable, "-c", NAIVE_ST_ST, str(st), f"{o}.safetensors"],
                f"{o}.safetensors",
                "naive_st",
            ),
            (
                "ckptkit convert ddp.pt single.safetensors",
                [*ck, "convert", str(pt), f"{o}.safetensors"],
                f"{o}.safetensors",
                "pt2st",
            ),
            (
                "naive torch.load -> save_file",
                [sys.executable, "-c", NAIVE_ST, str(pt), f"{o}.safetensors"],
                f"{o}.safetensors",
                "naive_pt2st",
            ),
            ("ckptkit inspect ddp.pt", [*ck, "inspect", str(pt)], None, None),
            ("ckptkit --help", [*ck, "--help"], None, None),
            ("ckptkit verify ddp.pt", [*ck, "verify", str(pt)], None, "verify"),
        ]
        if args.only_memory:
            cases = [c for c in cases if c[3] in ("base_pt", "pt", "st", "pt2st")]
        inputs = {"ddp.pt": pt, "ddp.safetensors": st}
        times: dict[str, list[float]] = {c[0]: [] for c in cases}
        mems: dict[str, int] = {c[0]: 0 for c in cases}
        for name, cmd, out_path, _tag in rounds(cases, args.runs):
            if out_path and Path(out_path).exists():
                Path(out_path).unlink()
            os.sync()  # no dirty pages left over from the previous run to slow this one
            for label, path in inputs.items():  # warm: a daemon here evicts idle page cache
                if label in name:
                    warm(path)
            t, m = run(cmd)
            times[name].append(t)
            mems[name] = max(mems[name], m)
        med = {name: statistics.median(ts) for name, ts in times.items()}
        tags = {c[3]: c[0] for c in cases if c[3]}
        durable = {"base_pt": "cp ddp.pt && sync", "base_st": "cp ddp.safetensors && sync"}
        print(
            f"\ncheckpoint: {size / 2**30:.2f} GiB ({size:,} bytes) in {scratch.parent}, {args.runs} interleaved run(s),"
            " inputs re-read before each run\n"
        )
        print("| command | min / median / max s | x cp | x cp && sync | x naive | peak RssAnon MiB |")
        print("|---|---|---:|---:|---:|---:|")
        base = {
            "pt": "base_pt",
            "naive_pt": "base_pt",
            "st": "base_st",
            "naive_st": "base_st",
            "pt2st": "base_pt",
            "naive_pt2st": "base_pt",
            "verify": "base_pt",
        }
        naive = {"pt": "naive_pt", "st": "naive_st", "pt2st": "naive_pt2st"}
        for name, _cmd, _out, tag in cases:
            ts = times[name]
            xcp = f"{med[name] / med[tags[base[tag]]]:.2f}" if tag in base and base[tag] in tags else ""
            xsync = (
                f"{med[name] / med[durable[base[tag]]]:.2f}" if tag in base and durable.get(base[tag]) in med else ""
            )
            xnaive = f"{med[name] / med[tags[naive[tag]]]:.2f}" if tag in naive and naive[tag] in tags else ""
            print(f"| {name} | {spread(ts)} | {xcp} | {xsync} | {xnaive} | {mems[name]} |")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
