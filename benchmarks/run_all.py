"""Run every benchmark with its documented arguments and rewrite BENCHMARKS.md from their output.

    python benchmarks/run_all.py                      # everything (about an hour; a quiet machine)
    python benchmarks/run_all.py --list               # the sections and their commands
    python benchmarks/run_all.py --only crc train     # just these sections; the others kept as they are
    python benchmarks/run_all.py --dry-run            # print the file it would write, running nothing
    python benchmarks/run_all.py --disk /mnt/scratch  # where the on-disk runs write (default: the temp dir)

BENCHMARKS.md is this script's output: the machine stated once at the top, then one section
per benchmark, each a fixed explanation, the command, and the tables that command printed. The
GPU section is kept as it is: ``bash benchmarks/gpu_check.sh`` writes it on a GPU machine, and
it states its own machine. History stays in git.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "BENCHMARKS.md"
GPU_HEADING = "## GPU"
TOP = "# Benchmarks"
GENERATED = "<!-- Written by `python benchmarks/run_all.py`; edit that script, not the tables. -->"
READING = """\
Every figure comes from the scripts in `benchmarks/`, each run as shown in its section, on the
machine above. Each script measures its baselines in the same run, interleaved with the
commands it compares (the order reversed every other round), so read each ratio against its own
baseline: absolute times move with the machine's load and its disk's writeback. Times are
min / median / max over the runs; ratios are of medians. "peak RssAnon" is private memory,
sampled every 2 ms. ckptkit fsyncs what it writes, `cp` does not: hence also `cp && sync`."""


@dataclass(frozen=True)
class Section:
    name: str  # for --only
    title: str
    about: str  # fixed text: what is measured and how to read it
    commands: tuple[tuple[str, ...], ...]  # each: script, then arguments; {disk} and {shm} filled in


SECTIONS = [
    Section(
        "crc",
        "CRC-32",
        "Every byte ckptkit checks (convert, verify, `load_for_rank(verify=True)`) goes through one CRC-32 "
        "function: ISA-L's where the `isal` wheel exists, `zlib`'s elsewhere, with the same values.",
        (("bench_crc.py",),),
    ),
    Section(
        "convert-disk",
        "`convert`, `inspect`, `verify`: one file on disk",
        "A GPT-like DDP state dict (`module.` keys, fp32, ~1 GiB) in whole processes, each input re-read untimed "
        'before each run. `convert` checks every copied byte against the source\'s CRC-32. "x naive" is the '
        "convert over the few lines users write by hand (`torch.load`, strip, `torch.save` / `save_file`).",
        (("bench_convert.py", "--runs", "5", "--dir", "{disk}"),),
    ),
    Section(
        "convert-tmpfs",
        "`convert`, `inspect`, `verify`: one file on tmpfs",
        "The same commands in memory (tmpfs), where `cp` costs no disk writeback and ckptkit's own work shows.",
        (("bench_convert.py", "--runs", "5", "--dir", "{shm}"),),
    ),
    Section(
        "shards",
        "Hugging Face shards",
        "The ~1 GiB DDP `.pt` converted to one file and to 200MB Hugging Face shards. Each convert is set "
        "against the `cp` of the same output shape: the shards against `cp -r` of the same shard files.",
        (("bench_shards.py", "--runs", "8", "--dir", "{disk}"),),
    ),
    Section(
        "dcp",
        "DCP folders",
        "A GPT-like model saved by FSDP2 (`fully_shard`) on 2 gloo ranks, ~1 GiB in `.distcp` files, converted "
        "to one file and to shards; then the same weights as one `.pt` for the single-file baseline.",
        (("bench_dcp.py", "--gib", "1", "--runs", "6", "--dir", "{disk}"),),
    ),
    Section(
        "dcp-mesh",
        "2-D parallel DCP (a 2x2 mesh)",
        "The same model's weights saved by `dcp.save` of DTensors on a 2x2 gloo mesh (4 ranks), each matrix "
        "sharded along both dims (`Shard(0), Shard(1)` and `Shard(1), Shard(0)`, as column- and row-parallel "
        "layers are), vectors along dim 0: every matrix's chunks interleave row by row, so no chunk is a run of "
        "the output's bytes and each must pass through memory, where FSDP2's copy above stays in the kernel. "
        "ckptkit assembles them in bands of rows, each chunk's rows read straight into their places, into one file, shards, "
        "or (`--format dcp`) a DCP folder of one `.distcp` per process; torch's own `dcp_to_torch_save` (the whole "
        "state dict in memory) runs in the same rounds.",
        (
            ("bench_dcp.py", "--gib", "1", "--runs", "5", "--mesh", "--naive", "--dir", "{disk}"),
            ("bench_dcp.py", "--gib", "4", "--runs", "3", "--mesh", "--naive", "--dir", "{disk}"),
        ),
    ),
    Section(
        "dcp-mesh-16",
        "2-D parallel DCP at 16 GiB",
        "The 2x2-mesh folder above at 16 GiB, once, each output removed after its run (the folder and one "
        "output fit the disk). torch's `dcp_to_torch_save` holds the whole state dict in memory (the 4 GiB "
        "row's peak is the weights' size): two thirds of this machine's RAM here.",
        (("bench_dcp.py", "--gib", "16", "--runs", "1", "--mesh", "--folder-only", "--naive", "--dir", "{disk}"),),
    ),
    Section(
        "deepspeed",
        "DeepSpeed ZeRO-3 to plain weights",
        "A ZeRO-3 folder in DeepSpeed 0.19.8's exact layout (2 ranks of a bf16 run, Adam states included), written "
        "by the script because real ZeRO-3 training at these sizes does not fit a small CPU machine. The folder "
        "is about 3x the fp32 weights; convert reads only the fp32 partitions. `--naive` is DeepSpeed's "
        "`zero_to_fp32`, which builds the whole state dict in memory.",
        (("bench_deepspeed.py", "--gib", "1", "--runs", "5", "--naive", "--dir", "{disk}"),),
    ),
    Section(
        "merge",
        "Merging a LoRA adapter offline",
        "`convert --merge-adapter` on a GPT-like fp32 base (one safetensors file) with a LoRA (r=16) on every "
        "layer's attention and MLP weights, against a plain convert of the same base and against the few lines "
        "users write by hand (`load_file`, `W += scaling * B @ A`, `save_file`); each merged output is compared "
        "with the hand-written one, bit for bit. The merge imports torch (a plain convert does not) and holds one "
        "adapted weight and its delta at a time: the second table, at 4 GiB, shows its memory not growing with "
        "the base.",
        (
            ("bench_merge.py", "--gib", "2.1", "--runs", "3", "--dir", "{disk}"),
            ("bench_merge.py", "--gib", "4", "--runs", "1", "--only-memory", "--dir", "{disk}"),
        ),
    ),
    Section(
        "s3",
        "Object storage (s3://)",
        "`convert` to and from `s3://` against s3fs's own `get_file` / `put_file` of the same bytes, each a whole "
        "process, against a local moto S3 server on 127.0.0.1 (the client side is compared, not a network). moto "
        "reads the whole object to answer each ranged GET; the server here answers one by reading its range, as S3 "
        "does (`tests/s3stores.py`'s `WithS3Ranges`, checked against moto's own answers by the tests), so that many "
        "ranged GETs of a large object cost what they cost on S3. From S3, ckptkit converts as it reads: 8 MiB "
        "ranged GETs, the next 4 fetched ahead, every tensor byte CRC-checked, the output fsynced; nothing staged. "
        "To S3 it converts straight into the upload (no staging file): 16 MiB parts, 4 at a time, each with its "
        "CRC-32, the zip's own check run on a sparse local image of its headers before the upload is completed "
        "with the whole object's CRC-32, which the store checks (moto keeps it; ckptkit reads it with one "
        "HeadObject instead of reading the object back). s3fs reads with one GET and sends ten 50 MiB parts at once. "
        "The last table reads a prefix: the same weights as four Hugging Face shards under it, converted to one "
        "file (the shards read through ranges as above, sharing one budget of runs and threads; the index copied "
        "whole), against s3fs's recursive `get` of the prefix.",
        (
            ("bench_s3.py", "--gib", "1", "--runs", "3"),
            ("bench_s3.py", "--gib", "4", "--runs", "1"),
            ("bench_s3.py", "--gib", "1", "--runs", "3", "--direction", "folder"),
        ),
    ),
    Section(
        "memory",
        "Memory at 4 GiB",
        "Private memory of the converts at 4 GiB, one run each. Their times come after the scripts have "
        "written several GiB and are not speed figures.",
        (
            ("bench_shards.py", "--gib", "4", "--runs", "1", "--only-memory", "--dir", "{disk}"),
            ("bench_dcp.py", "--gib", "4", "--only-memory", "--dir", "{disk}"),
            ("bench_deepspeed.py", "--gib", "4", "--only-memory", "--naive", "--dir", "{disk}"),
        ),
    ),
    Section(
        "save",
        "Saving and loading, against the peers",
        "One process, a model of 64 x 16 MiB fp32 weights, the peers interleaved. Every save is followed by an "
        "fsync where the peer does not fsync itself; every load reads a file whose pages were read just before "
        "and ends with the weights in a model. Accelerate and Lightning Fabric are included where installed. "
        "The first table is on tmpfs, the second on disk, the third a training state (the model plus AdamW's "
        "two moments) on tmpfs.",
        (
            ("bench_save.py", "--runs", "5", "--dir", "{shm}"),
            ("bench_save.py", "--runs", "5", "--dir", "{disk}"),
            ("bench_save.py", "--training", "--runs", "3", "--dir", "{shm}"),
        ),
    ),
    Section(
        "train",
        "Training time lost to checkpointing",
        "The reference trainer on the built-in data with a wider MLP (8.5M parameters, ~100 MB checkpoints with "
        'AdamW state). The trainer records each save\'s blocking time; "time lost" sums those waits. On a '
        "machine with few cores, one process already uses them all, so 2 processes only split them.",
        (("bench_train.py",),),
    ),
]


def machine(disk: Path) -> str:
    """One line: what these figures were measured on."""
    cpu = ""
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        cpu = platform.processor() or platform.machine()
    try:
        kib = next(int(line.split()[1]) for line in open("/proc/meminfo") if line.startswith("MemTotal"))
        ram = f"{kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration):
        ram = "RAM unknown"
    df = subprocess.run(["df", "--output=fstype", str(disk)], capture_output=True, text=True).stdout.split()
    fs = (
        df[-1]
        if len(df) == 2
        else subprocess.run(["stat", "-f", "-c", "%T", str(disk)], capture_output=True, text=True).stdout.strip()
    )
    torch = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__version__, torch.cuda.is_available())"],
        capture_output=True,
        text=True,
    ).stdout.split()
    gpu = "a CUDA GPU present (unused here)" if torch[1:] == ["True"] else "no GPU"
    return (
        f"**Machine:** {os.cpu_count()} CPU cores ({cpu}), {ram}, scratch files on {fs} (`{disk}`) and tmpfs "
        f"(`/dev/shm`), Python {platform.python_version()}, torch {torch[0] if torch else '?'}, {gpu}."
    )


def command_line(cmd: tuple[str, ...], disk: Path) -> list[str]:
    return [a.replace("{disk}", str(disk)).replace("{shm}", "/dev/shm") for a in cmd]


def shown(cmd: tuple[str, ...], disk: Path) -> str:
    """The command as the section shows it: as run, from the repository's root."""
    return "`" + " ".join(["python", f"benchmarks/{cmd[0]}", *command_line(cmd, disk)[1:]]) + "`"


def result_block(stdout: str) -> str:
    """What a benchmark printed as its result: the caption paragraph right before its first table,
    the tables, and the lines after them. Progress lines before the caption are left out."""
    lines = stdout.rstrip().splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if first is None:
        raise RuntimeError(f"no markdown table in the output:\n{stdout[-2000:]}")
    j = first - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    while j >= 0 and lines[j].strip() and not lines[j].startswith("|"):
        j -= 1
    block: list[str] = []
    for line in lines[j + 1 :]:  # a blank line between a table and the text beside it, as markdown needs
        if block and block[-1].strip() and line.strip() and block[-1].startswith("|") != line.startswith("|"):
            block.append("")
        block.append(line)
    return "\n".join(block).strip()


def run(cmd: tuple[str, ...], disk: Path) -> str:
    args = [sys.executable, str(ROOT / "benchmarks" / cmd[0]), *command_line(cmd, disk)[1:]]
    print(f"+ {' '.join(args)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    }
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    print(f"  exit {proc.returncode} in {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return result_block(proc.stdout)


def section_text(section: Section, results: list[str], disk: Path) -> str:
    parts = [f"## {section.title}", "", section.about, ""]
    for cmd, result in zip(section.commands, results, strict=True):
        parts += [f"{shown(cmd, disk)}:", "", result, ""]
    return "\n".join(parts).rstrip() + "\n"


def split_existing(text: str) -> tuple[dict[str, str], str]:
    """The current file's sections by title, and its GPU section (verbatim, to the end of the file)."""
    gpu = ""
    at = text.find(f"\n{GPU_HEADING}")
    if at >= 0:
        gpu, text = text[at + 1 :].rstrip() + "\n", text[:at]
    sections = {}
    for chunk in re.split(r"\n(?=## )", text):
        if chunk.startswith("## "):
            sections[chunk.splitlines()[0][3:].strip()] = chunk.rstrip() + "\n"
    return sections, gpu


def render(machine_line: str, bodies: list[str], gpu: str) -> str:
    parts = [TOP, "", GENERATED, "", machine_line, "", READING, ""]
    for body in bodies:
        parts += [body.rstrip(), ""]
    if gpu:
        parts += [gpu.rstrip(), ""]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--only", nargs="+", metavar="NAME", choices=[s.name for s in SECTIONS], help="run just these sections"
    )
    ap.add_argument("--list", action="store_true", help="list the sections and their commands, and exit")
    ap.add_argument(
        "--dry-run", action="store_true", help="print the file it would write, with the commands in place of results"
    )
    ap.add_argument(
        "--disk", type=Path, default=Path(tempfile.gettempdir()), help="scratch folder on disk (default: %(default)s)"
    )
    ap.add_argument("--out", type=Path, default=OUT, help="the file to write (default: BENCHMARKS.md)")
    args = ap.parse_args(argv)
    if args.list:
        for s in SECTIONS:
            print(f"{s.name}: {s.title}")
            for cmd in s.commands:
                print(f"    {shown(cmd, args.disk)}")
        return 0
    existing, gpu = split_existing(args.out.read_text()) if args.out.exists() else ({}, "")
    chosen = set(args.only or [s.name for s in SECTIONS])
    bodies = []
    for s in SECTIONS:
        if s.name not in chosen:
            if s.title not in existing:
                raise SystemExit(
                    f"run_all: {args.out} has no section '{s.title}' to keep; run it too (--only ... {s.name})"
                )
            bodies.append(existing[s.title])
        elif args.dry_run:
            bodies.append(section_text(s, ["(its output)" for _ in s.commands], args.disk))
        else:
            bodies.append(section_text(s, [run(c, args.disk) for c in s.commands], args.disk))
    text = render(machine(args.disk), bodies, gpu)
    if args.dry_run:
        print(text)
        return 0
    args.out.write_text(text)
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
