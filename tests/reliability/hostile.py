"""Broken and hostile checkpoints, and what every reader must do with them.

The contract: a reader returns (the bytes still make a valid checkpoint) or raises a
CkptkitError; a CLI command exits 0, or 1 (diff: 2, as GNU diff does) with one line on stderr
and no traceback; a failed
convert leaves no output and no temp file. Anything else is a finding.
"""

from __future__ import annotations

import json
import random
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.torchcompat import SAVE_ALONE

BASES = ["ddp.pt", "train_ckpt.pt", "legacy_ddp.pt", "ddp.safetensors", "tied.safetensors"]


def _st(header: Any, data: bytes = b"", *, length: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


SAFETENSORS_CASES: dict[str, bytes] = {
    "header length past EOF": _st(
        {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, length=10_000
    ),
    "header length of 2^60": _st({}, length=1 << 60),
    "header not JSON": _st(b"{not json at all}"),
    "header a JSON list": _st(b"[1, 2, 3]"),
    "unknown dtype": _st({"a": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "overlapping tensors": _st(
        {
            "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
        },
        b"\0" * 12,
    ),
    "offsets out of bounds": _st({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 4),
    "size does not match shape": _st({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8),
    "terabyte shape": _st({"a": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4]}}, b"\0" * 4),
    "negative dimension": _st({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4),
    "metadata not strings": _st({"__metadata__": {"x": 1}}),
    "gap between tensors": _st({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
    "deeply nested JSON": _st(b"[" * 100_000 + b"]" * 100_000),
    "aliases metadata malformed": _st(
        {"__metadata__": {"ckptkit.aliases": "{oops"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        b"\0" * 4,
    ),
    "crc metadata malformed": _st(
        {"__metadata__": {"ckptkit.crc32": "[1]"}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
        b"\0" * 4,
    ),
}


def _zip_regions(path: Path) -> dict[str, tuple[int, int]]:
    from ckptkit.formats.torchzip.container import TorchZip

    z = TorchZip(path)
    pkl = z.by_name[f"{z.prefix}data.pkl"]
    storage = z.storage("0")
    data = path.read_bytes()
    cd = data.find(b"PK\x01\x02")
    return {
        "pickle": (pkl.data_offset, pkl.data_offset + pkl.compressed_size),
        "payload": (storage.data_offset, storage.data_offset + storage.compressed_size),
        "zip directory": (cd, len(data)),
    }


def corpus(fixtures: Path, work: Path, seed: int, scale: int) -> Iterator[tuple[str, str, Path]]:
    """``(family, description, path)`` for every hostile input, written under ``work``."""
    rng = random.Random(seed)
    n = 0

    def emit(family: str, what: str, data: bytes, suffix: str) -> tuple[str, str, Path]:
        nonlocal n
        n += 1
        path = work / f"case{n:05d}{suffix}"
        path.write_bytes(data)
        return family, what, path

    for name in BASES:
        data = (fixtures / name).read_bytes()
        suffix = Path(name).suffix
        for i in range(1, 16 * scale):
            cut = len(data) * i // (16 * scale)
            yield emit("truncated", f"{name} cut at {cut} of {len(data)}", data[:cut], suffix)
        for _ in range(12 * scale):
            pos, bit = rng.randrange(len(data)), rng.randrange(8)
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            yield emit("bit flip", f"{name} bit {bit} of byte {pos}", bytes(flipped), suffix)
        if suffix == ".pt" and name != "legacy_ddp.pt":
            for region, (lo, hi) in _zip_regions(fixtures / name).items():
                for _ in range(6 * scale):
                    pos = rng.randrange(lo, hi)
                    flipped = bytearray(data)
                    flipped[pos] ^= 1 << rng.randrange(8)
                    yield emit(f"bit flip in {region}", f"{name} byte {pos}", bytes(flipped), suffix)
    yield emit("empty", "empty file", b"", ".pt")
    yield emit("garbage", "random bytes", bytes(rng.randrange(256) for _ in range(4096)), ".pt")
    yield emit("garbage", "zip magic then nothing", b"PK\x03\x04" + b"\0" * 26, ".pt")
    other = work / "not_a_checkpoint.zip"
    with zipfile.ZipFile(other, "w") as zf:
        zf.writestr("readme.txt", "hello")
        zf.writestr("data/0", b"\1" * 64)
    yield "not a checkpoint", "a zip of other files", other
    folder = work / "plain_folder"
    folder.mkdir(exist_ok=True)
    yield "a folder", "a folder with no .metadata", folder
    for what, blob in SAFETENSORS_CASES.items():
        yield emit("crafted safetensors", what, blob, ".safetensors")
    yield from _dcp_cases(work)


def _dcp_cases(work: Path) -> Iterator[tuple[str, str, Path]]:
    import shutil

    import torch
    import torch.distributed.checkpoint as dcp

    good = work / "dcp_good"
    if not good.exists():
        dcp.save({"w": torch.ones(8), "epoch": 3}, checkpoint_id=str(good), **SAVE_ALONE)
    cases = {
        "missing shard": lambda d: [p.unlink() for p in d.glob("*.distcp")],
        "missing .metadata": lambda d: (d / ".metadata").unlink(),
        "truncated .metadata": lambda d: (d / ".metadata").write_bytes((good / ".metadata").read_bytes()[:40]),
        "garbage .metadata": lambda d: (d / ".metadata").write_bytes(b"\x80\x02garbage" * 10),
        "truncated shard": lambda d: [p.write_bytes(p.read_bytes()[:10]) for p in d.glob("*.distcp")],
    }
    for what, damage in cases.items():
        d = work / f"dcp_{what.replace(' ', '_').replace('.', '')}"
        shutil.copytree(good, d, dirs_exist_ok=True)
        damage(d)
        yield "damaged DCP folder", what, d


def check_library(path: Path, out: Path) -> list[str]:
    """Run every library reader on ``path``; return the findings (empty when all behaved)."""
    import ckptkit
    from fixtures.models import TinyNet

    findings = []
    calls = {
        "read_checkpoint": lambda: ckptkit.read_checkpoint(path),
        "load_for_rank": lambda: ckptkit.load_for_rank(path, model=TinyNet()),
        "load_for_rank(verify)": lambda: ckptkit.load_for_rank(path, verify=True),
        "inspect_checkpoint": lambda: ckptkit.inspect_checkpoint(path),
        "verify_checkpoint": lambda: ckptkit.verify_checkpoint(path),
        "convert_checkpoint": lambda: ckptkit.convert_checkpoint(path, out, force=True, model_only=True),
    }
    results: dict[str, Any] = {}
    for name, call in calls.items():
        try:
            results[name] = call()
        except ckptkit.CkptkitError:
            pass
        except BaseException as e:  # the finding itself: any other exception escaping
            findings.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
    # Soundness: a file verify passes must load, and a convert that succeeded must have
    # written a checkpoint that loads (a rewrite must not pass damage through silently).
    promised = []
    if getattr(results.get("verify_checkpoint"), "ok", False):
        promised.append(("verify passed", path))
    if "convert_checkpoint" in results:
        promised.append(("convert succeeded", out))
    for claim, target in promised:
        try:
            ckptkit.read_checkpoint(target)
        except ckptkit.CkptkitError as e:
            findings.append(f"{claim} but {target.name} does not load: {str(e)[:200]}")
    return findings


def check_cli(path: Path, out: Path) -> tuple[list[str], dict[str, int]]:
    """Run every CLI command on ``path``; return findings and exit-code counts."""
    from click.testing import CliRunner

    from ckptkit.cli import main

    findings, codes = [], {}
    runner = CliRunner()
    for cmd in (
        ["convert", str(path), str(out)],
        ["inspect", str(path)],
        ["verify", str(path)],
        ["diff", str(path), str(path)],
    ):
        if out.exists():
            out.unlink()
        result = runner.invoke(main, cmd)
        codes[f"{cmd[0]} exit {result.exit_code}"] = codes.get(f"{cmd[0]} exit {result.exit_code}", 0) + 1
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            findings.append(f"{cmd[0]}: uncaught {type(result.exception).__name__}: {str(result.exception)[:200]}")
            continue
        error_code = 2 if cmd[0] == "diff" else 1  # diff keeps 1 for "different"
        if result.exit_code not in (0, 1, error_code):
            findings.append(f"{cmd[0]}: exit {result.exit_code}")
        if "Traceback" in result.stderr or "Traceback" in result.stdout:
            findings.append(f"{cmd[0]}: printed a traceback")
        if (
            result.exit_code == error_code
            and cmd[0] != "verify"
            and not (result.stderr.startswith("ckptkit: error: ") and result.stderr.count("\n") <= 2)
        ):  # verify reports its failed checks on stdout
            findings.append(f"{cmd[0]}: error was not one line on stderr: {result.stderr[:200]!r}")
        if cmd[0] == "convert" and result.exit_code != 0:
            if out.exists():
                findings.append("convert: failed but left an output file")
            if any(p.name.endswith(".ckptkit-tmp") for p in out.parent.iterdir()):
                findings.append("convert: failed and left a temp file")
    return findings, codes
