"""A fixed-seed mutation fuzzer over every reader and the CLI (issue 33).

Each mutant is made from a seed checkpoint, as its producers write them (``torch.save`` in both
formats, safetensors, ckptkit's own ``convert`` outputs, a DCP folder, Hugging Face shards, a
DeepSpeed ZeRO folder), by one of the mutation families below: byte flips, truncations and
splices; zip regions, records and pickle opcodes; safetensors headers; crafted pickles; folder
attacks. Mutant ``i`` of campaign ``seed`` is a function of ``(seed, i)`` and the seeds alone, so
any one can be rebuilt (``python -m tests.reliability.fuzz one``).

Every mutant goes through ``verify_checkpoint``, ``read_checkpoint``, ``inspect_checkpoint``,
``convert_checkpoint`` to safetensors, the reference reader (``torch.load(weights_only=True)``,
``safetensors.torch.load_file``), and the CLI's ``verify``, ``inspect`` and ``convert``, under a
per-mutant alarm: each of those calls has the budget (10 s) to itself, so that a slow machine does
not turn a bounded but slow read (a pickle nested 200,000 deep takes seconds) into a hang. What
each class counts (the goal is 0 in each):

- hangs: a call into ckptkit that ran past the budget (the alarm, or a worker stuck in C code that
  faulthandler ended).
- exceptions: anything but a CkptkitError out of the library; a CLI traceback, an exit code other
  than 0 or 1, an error that is not one line; a worker that crashed.
- disagreements: verify passes and read_checkpoint refuses; verify fails (for more than a data
  checksum, which read_checkpoint does not check) and read_checkpoint reads it; verify passes a
  file the reference reader refuses; convert publishes from a source verify fails; an index that
  routes a tensor outside its folder accepted.
- silent changes: values read differ from the reference reader's; convert's output differs from
  the reference's or read_checkpoint's values; a checksummed seed changed by raw bytes (its
  checksums left as they were) that verify passes and reads with other values than the seed's.
- debris: a failed convert that left its output or a temp file.
- payloads run: a code payload (``payloads.py``'s, which create a marker file) ran.

The crafted inputs reuse ``hostile.py``'s crafted safetensors and ``payloads.py``'s code payloads.

Usage::

    python -m tests.reliability.fuzz run --n 3000 --seed 0 --dir /tmp/fuzz      # prints one JSON summary
    python -m tests.reliability.fuzz one --seed 0 --index 17 --dir /tmp/fuzz    # rebuild and judge one
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import io
import json
import math
import os
import pickle
import pickletools
import random
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import traceback
import warnings
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.reliability import hostile, payloads

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"
CLASSES = ("hangs", "exceptions", "disagreements", "silent changes", "debris", "payloads run")
TMP_SUFFIX = ".ckptkit-tmp"


# -- seeds ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seed:
    """A checkpoint mutants are made from. ``checksummed``: every byte that decides its values is
    covered by a checksum verify checks, so a raw change that verify passes must leave them equal."""

    name: str
    kind: str  # zip, legacy, safetensors, dcp, hf, deepspeed
    path: Path
    checksummed: bool
    weight: int = 1


def _state() -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4, 3, generator=g)
    model = {
        "fc.weight": w,
        "fc.bias": torch.linspace(-1, 1, 4),
        "emb.weight": torch.randn(5, 2, generator=g).to(torch.bfloat16),
        "steps": torch.arange(6, dtype=torch.int64) - 2,
        "mask": torch.tensor([True, False, True]),
        "half": torch.tensor([1.5, -2.0, 65504.0], dtype=torch.float16),
    }
    return {"model": model, "step": 7, "lr": 0.125, "names": ["a", "b"], "view": w[1:3]}


def make_seeds(folder: Path) -> list[Seed]:
    """Write every seed under ``folder`` (once) and return them."""
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    import ckptkit
    from tests.torchcompat import SAVE_ALONE

    folder.mkdir(parents=True, exist_ok=True)
    manifest = folder / "manifest.json"
    if manifest.exists():
        return load_seeds(folder)
    state = _state()
    model = state["model"]
    seeds = []

    def seed(name: str, kind: str, checksummed: bool, weight: int = 1) -> Path:
        seeds.append(Seed(name, kind, folder / name, checksummed, weight))
        return folder / name

    torch.save(state, seed("torch_save.pt", "zip", True, 4))
    flat = {f"module.{k}": v for k, v in model.items()}
    flat["module.head.weight"] = flat["module.fc.weight"]  # tied: stored once
    torch.save(flat, seed("ddp.pt", "zip", True, 2))
    torch.save(state, seed("legacy.pt", "legacy", False, 2), _use_new_zipfile_serialization=False)
    save_file({k: v.contiguous() for k, v in model.items()}, seed("plain.safetensors", "safetensors", False, 3))
    ckptkit.convert_checkpoint(
        folder / "torch_save.pt", seed("ckptkit.safetensors", "safetensors", True, 3), model_only=True
    )
    ckptkit.convert_checkpoint(folder / "torch_save.pt", seed("ckptkit.pt", "zip", True, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {"model": dict(model), "step": 7, "names": ["a", "b"]},
            checkpoint_id=str(seed("dcp", "dcp", False, 3)),
            **SAVE_ALONE,
        )
    shutil.copytree(FIXTURES / "hf" / "safetensors", seed("hf", "hf", False, 2))
    shutil.copytree(FIXTURES / "hf" / "bin", seed("hf_bin", "hf", True, 1))
    ckptkit.convert_checkpoint(
        folder / "torch_save.pt", seed("hf_ckptkit", "hf", True, 1), max_shard_size=100, model_only=True
    )
    shutil.copytree(FIXTURES / "deepspeed" / "bf16" / "zero2", seed("deepspeed", "deepspeed", True, 2))
    manifest.write_text(json.dumps([[s.name, s.kind, s.checksummed, s.weight] for s in seeds]))
    return seeds


def load_seeds(folder: Path) -> list[Seed]:
    return [Seed(n, k, folder / n, c, w) for n, k, c, w in json.loads((folder / "manifest.json").read_text())]


# -- byte-level mutations ------------------------------------------------------------------------

INTERESTING_BYTES = [0x00, 0xFF, 0x7F, 0x80, 0x01, 0x20, 0x2E, 0x2F]
INTERESTING_INTS = [
    0,
    1,
    2,
    7,
    8,
    255,
    256,
    65535,
    65536,
    2**31 - 1,
    2**31,
    2**32 - 1,
    2**32,
    2**63 - 1,
    2**63,
    2**64 - 1,
    -1,
    -2,
    -(2**31),
    10**12,
]


class NotApplicable(Exception):
    """This family has nothing to act on in this file."""


def _flip_bits(rng: random.Random, data: bytes, lo: int = 0, hi: int | None = None) -> tuple[bytes, str]:
    hi = len(data) if hi is None else hi
    if hi <= lo:
        raise NotApplicable
    buf = bytearray(data)
    done = []
    for _ in range(rng.choice([1, 1, 1, 2, 3, 4])):
        pos, bit = rng.randrange(lo, hi), rng.randrange(8)
        buf[pos] ^= 1 << bit
        done.append(f"bit {bit} of byte {pos}")
    return bytes(buf), "flipped " + ", ".join(done)


def _set_bytes(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if not data:
        raise NotApplicable
    buf = bytearray(data)
    pos, value = rng.randrange(len(buf)), rng.choice([*INTERESTING_BYTES, rng.randrange(256)])
    buf[pos] = value
    return bytes(buf), f"byte {pos} set to {value:#04x}"


def _set_int(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    width = rng.choice([2, 4, 8])
    if len(data) < width:
        raise NotApplicable
    pos = rng.randrange(len(data) - width + 1)
    value = rng.choice(INTERESTING_INTS + [len(data), len(data) + 1, pos])
    buf = bytearray(data)
    buf[pos : pos + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    return bytes(buf), f"{width}-byte integer at {pos} set to {value}"


def _truncate(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if not data:
        raise NotApplicable
    cut = rng.choice([rng.randrange(len(data)), len(data) - rng.randrange(1, min(len(data), 64) + 1), 0])
    return data[:cut], f"cut at {cut} of {len(data)}"


def _splice(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    if not data:
        raise NotApplicable
    pos = rng.randrange(len(data))
    how = rng.choice(["delete", "insert", "duplicate"])
    n = rng.choice([1, 2, 4, 8, 64, 512])
    if how == "delete":
        return data[:pos] + data[pos + n :], f"deleted {n} bytes at {pos}"
    if how == "insert":
        return data[:pos] + bytes(rng.randrange(256) for _ in range(n)) + data[pos:], f"inserted {n} bytes at {pos}"
    return data[:pos] + data[pos : pos + n] + data[pos:], f"duplicated {n} bytes at {pos}"


RAW: dict[str, Callable[[random.Random, bytes], tuple[bytes, str]]] = {
    "bit flips": _flip_bits,
    "byte set": _set_bytes,
    "integer field": _set_int,
    "truncation": _truncate,
    "splice": _splice,
}


# -- zips: regions, records, pickle opcodes --------------------------------------------------------


def _zip_regions(data: bytes) -> dict[str, list[tuple[int, int]]]:
    """Byte ranges of a torch zip's parts, by zipfile's reading of it."""
    regions: dict[str, list[tuple[int, int]]] = {
        k: [] for k in ("pickle", "payload", "local header", "record name", "central directory", "end records")
    }
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        for info in z.infolist():
            n, e = struct.unpack_from("<HH", data, info.header_offset + 26)
            start = info.header_offset + 30 + n + e
            regions["local header"].append((info.header_offset, info.header_offset + 30))
            regions["record name"].append((info.header_offset + 30, info.header_offset + 30 + n))
            kind = "pickle" if info.filename.endswith(".pkl") else "payload"
            if info.compress_size:
                regions[kind].append((start, start + info.compress_size))
        end = data.rfind(b"PK\x05\x06")
        z64 = data.rfind(b"PK\x06\x06")
        tail = z64 if 0 <= z64 < end else end
        regions["central directory"].append((z.start_dir, tail))  # type: ignore[attr-defined]
        regions["end records"].append((tail, len(data)))
    return {k: [r for r in v if r[1] > r[0]] for k, v in regions.items() if any(r[1] > r[0] for r in v)}


def _zip_region_flip(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    try:
        regions = _zip_regions(data)
    except (zipfile.BadZipFile, struct.error, ValueError) as e:
        raise NotApplicable from e
    region = rng.choice(sorted(regions))
    lo, hi = rng.choice(regions[region])
    out, what = _flip_bits(rng, data, lo, hi)
    return out, f"in the {region}: {what}"


def _records(data: bytes) -> list[tuple[zipfile.ZipInfo, bytes]]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return [(i, z.read(i)) for i in z.infolist()]


def _zip_of(records: list[tuple[str, bytes]], compress: frozenset[str] = frozenset()) -> bytes:
    buf = io.BytesIO()
    with warnings.catch_warnings(), zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        warnings.simplefilter("ignore")  # "Duplicate name": meant
        for name, blob in records:
            z.writestr(name, blob, zipfile.ZIP_DEFLATED if name in compress else zipfile.ZIP_STORED)
    return buf.getvalue()


def _record_edit(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    try:
        records = [(i.filename, blob) for i, blob in _records(data)]
    except (zipfile.BadZipFile, struct.error, ValueError, NotImplementedError) as e:
        raise NotApplicable from e
    storages = [k for k, (n, _) in enumerate(records) if "/data/" in n and not n.endswith(".pkl")]
    how = rng.choice(
        ["drop", "duplicate name", "rename", "resize storage", "metadata record", "extra record", "reorder", "deflate"]
    )
    k = rng.randrange(len(records))
    name, blob = records[k]
    if how == "drop":
        del records[k]
        what = f"record {name} dropped"
    elif how == "duplicate name":
        k = rng.choice(storages) if storages else k
        name, blob = records[k]
        records.append((name, b"\x07" * len(blob)))
        what = f"a second record named {name} appended, same length, other bytes"
    elif how == "rename":
        new = rng.choice(
            [
                name + "x",
                name.replace("data", "dat", 1),
                "../" + name,
                name.upper(),
                name.rsplit("/", 1)[0] + "/\u00e9",
                records[(k + 1) % len(records)][0],
            ]
        )
        records[k] = (new, blob)
        what = f"record {name} renamed {new}"
    elif how == "resize storage":
        if not storages:
            raise NotApplicable
        k = rng.choice(storages)
        name, blob = records[k]
        delta = rng.choice([-8, -4, -1, 1, 4, 8, 4096])
        records[k] = (name, blob[:delta] if delta < 0 else blob + b"\0" * delta)
        what = f"record {name} resized by {delta} bytes"
    elif how == "metadata record":
        meta = [
            j
            for j, (n, _) in enumerate(records)
            if n.rsplit("/", 1)[-1] in ("version", "byteorder", ".format_version", ".storage_alignment")
        ]
        if not meta:
            raise NotApplicable
        k = rng.choice(meta)
        name = records[k][0]
        value = rng.choice([b"", b"big", b"little\n", b"0", b"3\n", b"99", b"-1", b"64\n", b"1", b"x" * 300])
        records[k] = (name, value)
        what = f"record {name} set to {value[:20]!r}"
    elif how == "extra record":
        prefix = records[0][0].split("/", 1)[0]
        new = rng.choice([f"{prefix}/data/999", f"{prefix}/extra", "outside", f"{prefix}/data.pkl.bak"])
        records.insert(rng.randrange(len(records) + 1), (new, b"\0" * 16))
        what = f"record {new} added"
    elif how == "reorder":
        rng.shuffle(records)
        what = "records reordered"
    else:
        return _zip_of(records, frozenset({name})), f"record {name} deflated"
    return _zip_of(records), what


def _enc_int(v: int) -> bytes:
    if 0 <= v < 256:
        return b"K" + bytes([v])
    if 0 <= v < 65536:
        return b"M" + struct.pack("<H", v)
    if -(2**31) <= v < 2**31:
        return b"J" + struct.pack("<i", v)
    raw = pickle.encode_long(v)  # type: ignore[attr-defined]
    return b"\x8a" + bytes([len(raw)]) + raw


def _enc_str(s: str) -> bytes:
    raw = s.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(raw)) + raw


def _ops(data: bytes) -> list[tuple[str, Any, int, int]]:
    """``(opcode name, argument, start, end)`` of each opcode; raises NotApplicable for a pickle
    pickletools cannot walk."""
    try:
        found = list(pickletools.genops(data))
    except Exception as e:  # noqa: BLE001  # pickletools raises many kinds on damaged pickles
        raise NotApplicable from e
    spans = []
    for k, (op, arg, pos) in enumerate(found):
        end = found[k + 1][2] if k + 1 < len(found) else pos + 1
        spans.append((op.name, arg, pos or 0, end or 0))
    return spans


def _splice_pickle(data: bytes, ops: list[tuple[str, Any, int, int]], start: int, end: int, new: bytes) -> bytes:
    """``data[start:end]`` replaced by ``new``, the length of the frame holding it adjusted."""
    out = bytearray(data[:start] + new + data[end:])
    delta = len(new) - (end - start)
    for name, arg, pos, _ in ops:
        if name == "FRAME" and pos < start <= pos + 9 + arg:
            struct.pack_into("<Q", out, pos + 1, arg + delta)
    return bytes(out)


GLOBALS = [
    "torch FloatStorage",
    "torch LongStorage",
    "torch HalfStorage",
    "torch BFloat16Storage",
    "torch BoolStorage",
    "torch ByteStorage",
    "torch DoubleStorage",
    "torch UntypedStorage",
    "torch._utils _rebuild_tensor_v2",
    "torch._utils _rebuild_parameter",
    "torch._utils _rebuild_tensor",
    "collections OrderedDict",
    "builtins set",
    "builtins getattr",
    "torch.nn.modules.linear Linear",
    "os system",
]


def _pickle_edit(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One opcode of a pickle changed: an integer, a string, a global, a memo index; deleted,
    duplicated or swapped; or rewritten with opcodes torch's writer never uses (LIST, DICT, DUP)."""
    ops = _ops(data)
    how = rng.choice(
        ["int", "int", "int", "string", "global", "memo", "delete", "duplicate", "swap", "LIST", "DICT", "DUP", "TUPLE"]
    )
    pick: dict[str, list[int]] = {
        "int": [
            k for k, o in enumerate(ops) if o[0] in ("BININT", "BININT1", "BININT2", "LONG1", "LONG4", "INT", "LONG")
        ],
        "string": [k for k, o in enumerate(ops) if "UNICODE" in o[0] or "STRING" in o[0]],
        "global": [k for k, o in enumerate(ops) if o[0] == "GLOBAL"],
        "memo": [k for k, o in enumerate(ops) if o[0] in ("BINGET", "LONG_BINGET", "BINPUT", "LONG_BINPUT")],
        "delete": [k for k, o in enumerate(ops) if o[0] not in ("PROTO", "FRAME")],
        "duplicate": [k for k, o in enumerate(ops) if o[0] not in ("PROTO", "FRAME", "STOP")],
        "swap": list(range(1, len(ops) - 2)),
        "LIST": [k for k, o in enumerate(ops) if o[0] == "EMPTY_LIST"],
        "DICT": [k for k, o in enumerate(ops) if o[0] == "EMPTY_DICT"],
        "DUP": [
            k for k, o in enumerate(ops) if o[0] in ("EMPTY_DICT", "EMPTY_LIST", "BINUNICODE", "BININT1", "EMPTY_TUPLE")
        ],
        "TUPLE": [k for k, o in enumerate(ops) if o[0] in ("TUPLE1", "TUPLE2", "TUPLE3")],
    }
    if not pick[how]:
        raise NotApplicable
    k = rng.choice(pick[how])
    name, arg, start, end = ops[k]
    if how == "int":
        v = int(arg)
        new_v = rng.choice([*INTERESTING_INTS, v + 1, v - 1, v * 2, v // 2, -v])
        return _splice_pickle(data, ops, start, end, _enc_int(new_v)), f"{name} {v} at {start} -> {new_v}"
    if how == "string":
        s = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
        flipped = s[:-1] + chr((ord(s[-1]) ^ 1) if s else 65) if s else "x"
        new_s = rng.choice(
            [
                flipped,
                "",
                s + s,
                "../" + s,
                "0",
                "1",
                "999",
                "cuda:0",
                "meta",
                "t" * 300,
                s + "\u00e9",
                s + "\x00",
                "storage",
                "__proto__",
            ]
        )
        return _splice_pickle(data, ops, start, end, _enc_str(new_s)), f"{name} {s[:30]!r} at {start} -> {new_s[:30]!r}"
    if how == "global":
        new_g = rng.choice(GLOBALS)
        module, _, attr = new_g.partition(" ")
        return _splice_pickle(
            data, ops, start, end, f"c{module}\n{attr}\n".encode()
        ), f"GLOBAL {arg} at {start} -> {new_g}"
    if how == "memo":
        new_i = rng.choice([0, 1, 2, 3, 5, 8, 200, 255])
        op = {"BINGET": b"h", "LONG_BINGET": b"h", "BINPUT": b"q", "LONG_BINPUT": b"q"}[name]
        return _splice_pickle(data, ops, start, end, op + bytes([new_i])), f"{name} {arg} at {start} -> {new_i}"
    if how == "delete":
        return _splice_pickle(data, ops, start, end, b""), f"{name} at {start} deleted"
    if how == "duplicate":
        return _splice_pickle(data, ops, end, end, data[start:end]), f"{name} at {start} duplicated"
    if how == "swap":
        n2, _, s2, e2 = ops[k + 1]
        return _splice_pickle(
            data, ops, start, e2, data[s2:e2] + data[start:end]
        ), f"{name} at {start} swapped with {n2}"
    if how == "LIST":
        return _splice_pickle(data, ops, start, end, b"(l"), f"EMPTY_LIST at {start} -> MARK LIST"
    if how == "DICT":
        return _splice_pickle(data, ops, start, end, b"(d"), f"EMPTY_DICT at {start} -> MARK DICT"
    if how == "DUP":
        return _splice_pickle(data, ops, end, end, b"20"), f"DUP POP inserted after {name} at {start}"
    new_t = rng.choice([b"\x85", b"\x86", b"\x87", b")"])
    return _splice_pickle(
        data, ops, start, end, new_t
    ), f"{name} at {start} -> {pickletools.code2op[new_t.decode('latin-1')].name}"


def _zip_pickle_edit(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    try:
        records = [(i.filename, blob) for i, blob in _records(data)]
    except (zipfile.BadZipFile, struct.error, ValueError, NotImplementedError) as e:
        raise NotApplicable from e
    k = next((j for j, (n, _) in enumerate(records) if n.endswith("data.pkl")), None)
    if k is None:
        raise NotApplicable
    edited, what = _pickle_edit(rng, records[k][1])
    records[k] = (records[k][0], edited)
    return _zip_of(records), what


# -- crafted pickles -----------------------------------------------------------------------------


def _shared_twice(levels: int) -> bytes:
    """One list paired with itself ``levels`` times over: ``levels + 1`` objects, 2**levels paths."""
    out = bytearray(b"(]q\x00")
    for i in range(levels):
        out += b"h" + bytes([i]) + b"h" + bytes([i]) + b"\x86" + b"q" + bytes([i + 1])
    return bytes(out) + b"t"


def _tensor_opcodes(
    *,
    key: str = "0",
    storage: str = "torch FloatStorage",
    numel: int = 4,
    location: str = "cpu",
    offset: int = 0,
    size: tuple[Any, ...] = (4,),
    stride: tuple[Any, ...] = (1,),
    extra: bytes = b"",
) -> bytes:
    """``_rebuild_tensor_v2`` of a persistent storage, as torch pickles a tensor, with any arguments."""
    module, _, name = storage.partition(" ")

    def tup(values: tuple[Any, ...]) -> bytes:
        return b"(" + b"".join(tup(v) if isinstance(v, tuple) else _enc_int(v) for v in values) + b"t"

    pid = (
        b"("
        + _enc_str("storage")
        + f"c{module}\n{name}\n".encode()
        + _enc_str(key)
        + _enc_str(location)
        + _enc_int(numel)
        + b"tQ"
    )
    args = pid + _enc_int(offset) + tup(size) + tup(stride) + b"\x89" + b"ccollections\nOrderedDict\n)R" + extra
    return b"ctorch._utils\n_rebuild_tensor_v2\n(" + args + b"tR"


def _crafted_value(rng: random.Random, storage_numel: int) -> tuple[bytes, str]:
    """Opcodes for one value (the stack gains one item), and what it is."""
    n = storage_numel
    templates: list[tuple[str, Callable[[], bytes]]] = [
        ("a list shared 2**L ways", lambda: _shared_twice(L)),
        ("nested 1-tuples, depth D", lambda: b"N" + b"\x85" * D),
        ("nested lists, depth D", lambda: b"]" * D + b"a" * (D - 1)),
        ("nested dicts, depth D", lambda: (b"}" + _enc_str("k")) * D + b"}" + b"s" * D),
        ("a list built by MARK LIST", lambda: b"(K\x01K\x02l"),
        ("a dict built by MARK DICT", lambda: b"(" + _enc_str("k") + b"K\x01d"),
        ("a tuple built with DUP", lambda: b"K\x05" + b"2" + b"\x86"),
        ("a set", lambda: b"\x8f(K\x01\x90"),
        ("a BINGET of an unset memo slot", lambda: b"h\xfe"),
        ("a string claiming 2**31-1 bytes", lambda: b"X\xff\xff\xff\x7f"),
        ("a protocol-5 out-of-band buffer", lambda: b"\x97"),
        ("an EXT1 code", lambda: b"\x82\x01"),
        ("an INST of os.system", lambda: b"(S'true'\nios\nsystem\n"),
        ("a NaN float", lambda: b"G" + struct.pack(">d", math.nan)),
        ("a tensor over the storage", lambda: _tensor_opcodes(numel=n, size=(n,))),
        ("a tensor whose size is a nested tuple", lambda: _tensor_opcodes(numel=n, size=((n,),))),
        (
            "a tensor of 4 of the 6 rebuild arguments",
            lambda: (
                b"ctorch._utils\n_rebuild_tensor_v2\n(("
                + _enc_str("storage")
                + b"ctorch\nFloatStorage\n"
                + _enc_str("0")
                + _enc_str("cpu")
                + _enc_int(n)
                + b"tQK\x00(K\x01t(K\x01ttR"
            ),
        ),
        ("a tensor at a negative offset", lambda: _tensor_opcodes(numel=n, offset=-1, size=(1,))),
        ("a tensor with a negative stride", lambda: _tensor_opcodes(numel=n, size=(2,), stride=(-1,))),
        ("a tensor with a negative size", lambda: _tensor_opcodes(numel=n, size=(-1,))),
        ("a tensor past its storage", lambda: _tensor_opcodes(numel=n, offset=n, size=(2,))),
        ("a tensor with more strides than sizes", lambda: _tensor_opcodes(numel=n, size=(1,), stride=(1, 1))),
        ("a tensor of 2**40 elements", lambda: _tensor_opcodes(numel=n, size=(2**40,))),
        ("a storage declaring 2**61 elements", lambda: _tensor_opcodes(numel=2**61, size=(1,))),
        ("a storage declaring one element more than its record", lambda: _tensor_opcodes(numel=n + 1, size=(1,))),
        ("a storage declaring one element less than its record", lambda: _tensor_opcodes(numel=n - 1, size=(1,))),
        ("a storage of no record", lambda: _tensor_opcodes(key="999", numel=1, size=(1,))),
        ("a storage key climbing out", lambda: _tensor_opcodes(key="../data.pkl", numel=1, size=(1,))),
        ("a storage on a device named nowhere", lambda: _tensor_opcodes(numel=n, location="nowhere:7", size=(1,))),
        (
            "a storage of another dtype over the same record",
            lambda: _tensor_opcodes(storage="torch HalfStorage", numel=2 * n, size=(2 * n,)),
        ),
        (
            "a storage type that is not one",
            lambda: _tensor_opcodes(storage="collections OrderedDict", numel=n, size=(1,)),
        ),
        (
            "a tensor with backward hooks",
            lambda: _tensor_opcodes(numel=n, size=(1,)).replace(b")R", b"(K\x01K\x02dR", 1),
        ),
        ("a persistent id that is an int", lambda: b"K\x01Q"),
        ("a persistent id that is too short", lambda: b"(" + _enc_str("storage") + b"tQ"),
        ("an OrderedDict called with an int", lambda: b"ccollections\nOrderedDict\n(K\x01tR"),
    ]
    L = rng.choice([20, 40, 60])
    D = rng.choice([1000, 30000, 200000])
    what, make = rng.choice(templates)
    return make(), what.replace("2**L", f"2**{L}").replace("depth D", f"depth {D}")


MARKER = "PAYLOAD_RAN"


def _code_payload(rng: random.Random, target: Path, marker: Path) -> str:
    """A torch.save file carrying one of payloads.py's code payloads (each creates ``marker`` if it
    ever runs), sometimes with one more opcode edit on top."""
    import torch

    found = payloads.payloads(marker)
    name = rng.choice(sorted(found))
    legacy = rng.random() < 0.2
    torch.save({"model": {"w": torch.ones(2)}, "x": found[name]}, target, _use_new_zipfile_serialization=not legacy)
    what = f"{name} ({'legacy format' if legacy else 'torch zip'})"
    if not legacy and rng.random() < 0.5:
        with contextlib.suppress(NotApplicable):
            data, edit = _zip_pickle_edit(rng, target.read_bytes())
            target.write_bytes(data)
            what += f", then {edit}"
    return what


def _crafted_pickle(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One more top-level entry, built by hand, in a torch.save file's pickle (CRCs recomputed)."""
    try:
        records = [(i.filename, blob) for i, blob in _records(data)]
    except (zipfile.BadZipFile, struct.error, ValueError, NotImplementedError) as e:
        raise NotApplicable from e
    k = next((j for j, (n, _) in enumerate(records) if n.endswith("data.pkl")), None)
    if k is None or not records[k][1].endswith(b"u."):
        raise NotApplicable
    sizes = {n.rsplit("/", 1)[-1]: len(b) for n, b in records if "/data/" in n}
    numel = sizes.get("0", 16) // 4 or 1
    value, what = _crafted_value(rng, numel)
    key = rng.choice(["x", "model", "state_dict"])
    records[k] = (records[k][0], records[k][1][:-1] + _enc_str(key) + value + b"s.")
    return _zip_of(records), f"entry {key!r}: {what}"


def _reduce_crafted(rng: random.Random, folder: Path) -> tuple[bytes, str]:
    """A torch.save file holding one tensor built by a hand-written __reduce__ (odd arguments)."""
    import collections

    import torch

    from tests.reliability.payloads import Reduce

    storage = torch.storage.TypedStorage(
        wrap_storage=torch.arange(6.0).untyped_storage(), dtype=torch.float32, _internal=True
    )
    variants: list[tuple[str, tuple[Any, ...]]] = [
        ("size ((6,),)", (storage, 0, ((6,),), (1,), False, collections.OrderedDict())),
        ("4 of 6 arguments", (storage, 0, (6,), (1,))),
        ("offset -2", (storage, -2, (2,), (1,), False, collections.OrderedDict())),
        ("stride (-1,)", (storage, 0, (3,), (-1,), False, collections.OrderedDict())),
        ("stride (0,) over 2**20", (storage, 0, (2**20,), (0,), False, collections.OrderedDict())),
        ("size (7,)", (storage, 0, (7,), (1,), False, collections.OrderedDict())),
        ("size (2, 3) stride (1,)", (storage, 0, (2, 3), (1,), False, collections.OrderedDict())),
        ("size (6.0,)", (storage, 0, (6.0,), (1,), False, collections.OrderedDict())),
        ("size '6'", (storage, 0, "6", (1,), False, collections.OrderedDict())),
        ("requires_grad 'yes'", (storage, 0, (6,), (1,), "yes", collections.OrderedDict())),
        ("hooks {1: 2}", (storage, 0, (6,), (1,), False, collections.OrderedDict({1: 2}))),
        ("storage 5", (5, 0, (6,), (1,), False, collections.OrderedDict())),
        ("a seventh argument", (storage, 0, (6,), (1,), False, collections.OrderedDict(), {"x": 1})),
    ]
    what, args = rng.choice(variants)
    path = folder / "reduce_crafted.pt"
    torch.save({"model": {"w": Reduce(torch._utils._rebuild_tensor_v2, *args), "b": torch.ones(2)}}, path)
    return path.read_bytes(), f"a tensor rebuilt with {what}"


# -- safetensors headers -----------------------------------------------------------------------

SAME_SIZE = [
    ["I64", "U64", "F64"],
    ["F32", "I32", "U32"],
    ["F16", "BF16", "I16", "U16"],
    ["U8", "I8", "BOOL", "F8_E4M3", "F8_E5M2"],
]


def _st_split(data: bytes) -> tuple[dict[str, Any], bytes]:
    if len(data) < 8:
        raise NotApplicable
    (n,) = struct.unpack_from("<Q", data)
    try:
        header = json.loads(data[8 : 8 + n])
    except (ValueError, RecursionError) as e:
        raise NotApplicable from e
    if not isinstance(header, dict):
        raise NotApplicable
    return header, data[8 + n :]


def _st_join(header: Any, rest: bytes, *, raw: bytes | None = None, length: int | None = None) -> bytes:
    blob = raw if raw is not None else json.dumps(header, separators=(",", ":")).encode()
    pad = (-len(blob)) % 8
    blob += b" " * pad
    return struct.pack("<Q", len(blob) if length is None else length) + blob + rest


def _header_edit(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """One edit of a safetensors header, its checksums (ckptkit's metadata) left as they were."""
    header, rest = _st_split(data)
    names = [k for k in header if k != "__metadata__" and isinstance(header[k], dict)]
    meta = header.get("__metadata__") if isinstance(header.get("__metadata__"), dict) else None
    how = rng.choice(
        [
            "dtype same size",
            "dtype same size",
            "dtype any",
            "shape",
            "shape",
            "offsets",
            "rename",
            "drop",
            "alias",
            "metadata",
            "metadata",
            "length",
            "nesting",
            "odd values",
            "duplicate key",
        ]
    )
    if not names:
        raise NotApplicable
    name = rng.choice(names)
    entry = header[name]
    if how == "dtype same size":
        group = next((g for g in SAME_SIZE if entry.get("dtype") in g), None)
        if group is None:
            raise NotApplicable
        new = rng.choice([d for d in group if d != entry["dtype"]])
        what = f"{name}: dtype {entry['dtype']} -> {new}"
        entry["dtype"] = new
    elif how == "dtype any":
        new = rng.choice(["F32", "F64", "I8", "U64", "F4", "C64", "F33", "", "f32", "BOOL"])
        what = f"{name}: dtype {entry.get('dtype')} -> {new}"
        entry["dtype"] = new
    elif how == "shape":
        shape = list(entry.get("shape", []))
        numel = math.prod(shape) if all(isinstance(s, int) for s in shape) else 0
        new = rng.choice(
            [shape[::-1], [numel], [*shape, 1], [1, *shape], [0], [], [numel, 0], [2**33, 2**33], [-numel], [numel + 1]]
        )
        what = f"{name}: shape {shape} -> {new}"
        entry["shape"] = new
    elif how == "offsets":
        others = [k for k in names if k != name]
        size = lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0]  # noqa: E731
        same = [k for k in others if size(k) == size(name)]
        if same and rng.random() < 0.6:
            other = rng.choice(same)
            entry["data_offsets"], header[other]["data_offsets"] = header[other]["data_offsets"], entry["data_offsets"]
            what = f"data_offsets of {name} and {other} swapped"
        else:
            a, b = entry["data_offsets"]
            new = rng.choice(
                [[a + 1, b + 1], [a, b + 4], [a - 4, b - 4], [b, a], [0, b - a], [a, a], [-1, b], [a, 2**64]]
            )
            what = f"{name}: data_offsets {[a, b]} -> {new}"
            entry["data_offsets"] = new
    elif how == "rename":
        new = rng.choice(
            [name[:-1] + chr(ord(name[-1]) ^ 1), "module." + name, name + "\u00e9", "[bold]" + name, name.upper(), ""]
        )
        header = {(new if k == name else k): v for k, v in header.items()}
        what = f"{name} renamed {new!r}"
    elif how == "drop":
        del header[name]
        what = f"{name} dropped"
    elif how == "alias":
        header[name + ".alias"] = dict(entry)
        what = f"{name}.alias added over {name}'s bytes"
    elif how == "metadata":
        if meta is None:
            header["__metadata__"] = meta = {}
        keys = sorted(meta)
        choice = rng.choice(["drop key", "crc map", "crc map", "set value", "aliases"])
        if choice == "drop key" and keys:
            k = rng.choice(keys)
            del meta[k]
            what = f"metadata {k} dropped"
        elif choice == "crc map" and any("crc" in k for k in keys):
            k = rng.choice([k for k in keys if "crc" in k])
            try:
                crcs = json.loads(meta[k])
            except ValueError:
                crcs = None
            if isinstance(crcs, dict) and crcs:
                victim = rng.choice(sorted(crcs))
                edit = rng.choice(["drop", "absent", "value", "rename"])
                if edit == "drop":
                    del crcs[victim]
                elif edit == "absent":
                    crcs["not.a.tensor"] = crcs[victim]
                elif edit == "value":
                    crcs[victim] = "00000000"
                else:
                    crcs[victim + "x"] = crcs.pop(victim)
                meta[k] = json.dumps(crcs)
                what = f"metadata {k}: {edit} {victim}"
            else:
                meta[k] = rng.choice(["", "{}", "[1]", "0"])
                what = f"metadata {k} set to {meta[k]!r}"
        elif choice == "aliases":
            meta["ckptkit.aliases"] = rng.choice(
                [
                    json.dumps({name + ".t": [name, 1]}),
                    json.dumps({name: [name, 1]}),
                    "{oops",
                    json.dumps({"x": ["missing", 1]}),
                ]
            )
            what = f"metadata ckptkit.aliases set to {meta['ckptkit.aliases'][:40]!r}"
        else:
            k = rng.choice(keys) if keys else "format"
            meta[k] = rng.choice(["", "pt", "x" * 1000, "0"])
            what = f"metadata {k} set to {meta[k][:20]!r}"
    elif how == "length":
        blob = json.dumps(header, separators=(",", ":")).encode()
        n = len(blob) + (-len(blob)) % 8
        length = rng.choice([n + 1, n - 1, n + 8, n - 8, 0, 2**63, len(data) - 8, len(data)])
        return _st_join(header, rest, length=length), f"header length {n} -> {length}"
    elif how == "nesting":
        depth = rng.choice([100, 10000, 100000])
        entry["shape"] = "DEEP"
        raw = json.dumps(header, separators=(",", ":")).encode().replace(b'"DEEP"', b"[" * depth + b"]" * depth)
        return _st_join(None, rest, raw=raw), f"{name}: shape nested {depth} deep"
    elif how == "odd values":
        field, value = rng.choice(
            [
                ("shape", [2.0]),
                ("shape", ["2"]),
                ("shape", None),
                ("data_offsets", [0]),
                ("data_offsets", [0.0, 4.0]),
                ("dtype", 5),
                ("shape", [2**70]),
                ("extra", 1),
            ]
        )
        entry[field] = value
        what = f"{name}: {field} -> {value!r}"
    else:
        blob = json.dumps(header, separators=(",", ":")).encode()
        dup = json.dumps({name: entry}, separators=(",", ":")).encode()[1:-1]
        other = next((k for k in names if k != name), None)
        if other is None:
            raise NotApplicable
        raw = blob[:-1] + b"," + dup.replace(json.dumps(name).encode(), json.dumps(other).encode(), 1) + b"}"
        return _st_join(None, rest, raw=raw), f"key {other!r} given twice (the second with {name}'s entry)"
    return _st_join(header, rest), what


def _header_length_raw(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """The JSON header's bytes flipped, in place (its length kept)."""
    if len(data) < 8:
        raise NotApplicable
    (n,) = struct.unpack_from("<Q", data)
    return _flip_bits(rng, data, 8, min(8 + n, len(data)))


# -- folders ---------------------------------------------------------------------------------------


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _folder_attack(rng: random.Random, folder: Path, outside: Path) -> str:
    files = _files(folder)
    victim = rng.choice(files)
    rel = victim.relative_to(folder)
    # A FIFO or /dev/zero in place of a file costs a whole budget wherever a reader blocks on it or
    # reads on without end: rarer than the rest, so that one campaign stays minutes long.
    attacks = {"delete": 8, "empty": 8, "directory": 8, "symlink outside": 8, "symlink loop": 8, "dangling symlink": 8}
    attacks |= {"extra file": 8, "symlink to sibling": 8, "fifo": 1, "dev zero": 1}
    how = rng.choices(list(attacks), weights=list(attacks.values()))[0]
    if how == "extra file":
        sibling = rng.choice(files)
        new = sibling.with_name(
            rng.choice(
                [
                    "__1_0.distcp",
                    "model-00004-of-00003.safetensors",
                    "zero_pp_rank_2_mp_rank_00_optim_states.pt",
                    sibling.name + ".bak",
                    "bf16_zero_pp_rank_2_mp_rank_00_optim_states.pt",
                ]
            )
        )
        shutil.copyfile(sibling, new)
        return f"{new.relative_to(folder)} added (a copy of {sibling.relative_to(folder)})"
    victim.unlink()
    if how == "delete":
        return f"{rel} deleted"
    if how == "empty":
        victim.write_bytes(b"")
    elif how == "directory":
        victim.mkdir()
    elif how == "fifo":
        os.mkfifo(victim)
    elif how == "symlink outside":
        outside.write_bytes(b"\0" * 64)
        victim.symlink_to(outside)
    elif how == "symlink loop":
        victim.symlink_to(victim.name)
    elif how == "dangling symlink":
        victim.symlink_to(folder / "no-such-file")
    elif how == "dev zero":
        victim.symlink_to("/dev/zero")
    else:
        others = [f for f in files if f != victim]
        if not others:
            raise NotApplicable
        victim.symlink_to(rng.choice(others))
    return f"{rel} replaced by a {how}"


def _hf_index_edit(rng: random.Random, folder: Path, outside: Path) -> tuple[str, bool]:
    """An edit of the index; True where it routes a tensor outside the folder."""
    index = next(folder.glob("*.index.json"))
    doc = json.loads(index.read_text())
    wm = doc["weight_map"]
    name = rng.choice(sorted(wm))
    how = rng.choice(
        [
            "parent",
            "absolute",
            "missing",
            "other shard",
            "drop",
            "absent tensor",
            "not a map",
            "total size",
            "nesting",
            "duplicate key",
            "self",
        ]
    )
    escapes = False
    if how in ("parent", "absolute"):
        shard = folder / wm[name]
        shutil.copyfile(shard, outside.with_suffix(shard.suffix))
        wm[name] = (
            f"../{outside.with_suffix(shard.suffix).name}"
            if how == "parent"
            else str(outside.with_suffix(shard.suffix))
        )
        escapes = True
        what = f"weight_map[{name!r}] -> {wm[name]}"
    elif how == "missing":
        wm[name] = "model-00009-of-00009" + Path(wm[name]).suffix
        what = f"weight_map[{name!r}] -> a missing shard"
    elif how == "other shard":
        others = sorted(set(wm.values()) - {wm[name]})
        if not others:
            raise NotApplicable
        wm[name] = rng.choice(others)
        what = f"weight_map[{name!r}] -> {wm[name]} (which lacks it)"
    elif how == "drop":
        del wm[name]
        what = f"weight_map[{name!r}] dropped"
    elif how == "absent tensor":
        wm["not.in.any.shard"] = wm[name]
        what = "weight_map names a tensor no shard holds"
    elif how == "not a map":
        doc["weight_map"] = rng.choice([[], "x", None, 5])
        what = f"weight_map -> {doc['weight_map']!r}"
    elif how == "total size":
        doc.setdefault("metadata", {})["total_size"] = rng.choice([-1, 0, 2**70, "big", None])
        what = f"total_size -> {doc['metadata']['total_size']!r}"
    elif how == "nesting":
        depth = rng.choice([1000, 100000])
        index.write_text(
            json.dumps(doc).replace('"metadata"', '"deep": ' + "[" * depth + "]" * depth + ', "metadata"', 1)
        )
        return f"index holds an array nested {depth} deep", False
    elif how == "duplicate key":
        text = json.dumps(doc)
        other = rng.choice(sorted(set(wm.values())))
        index.write_text(text[:-2] + f", {json.dumps(name)}: {json.dumps(other)}" + text[-2:])
        return f"weight_map names {name!r} twice", False
    else:
        wm[name] = index.name
        what = f"weight_map[{name!r}] -> the index itself"
    index.write_text(json.dumps(doc))
    return what, escapes


def _latest_edit(rng: random.Random, folder: Path) -> str:
    value = rng.choice(
        [
            "t" * 300,
            "..",
            ".",
            "../deepspeed",
            "/etc",
            "",
            "\x00\xff",
            "global_step3\nglobal_step4",
            "global_step3/../global_step3",
            " global_step3 ",
            "global_step9",
            "latest",
            "global_step3" * 30,
        ]
    )
    (folder / "latest").write_bytes(value.encode("utf-8", "surrogateescape"))
    return f"latest -> {value[:40]!r}"


def _dcp_metadata_edit(rng: random.Random, folder: Path) -> str:
    meta = folder / ".metadata"
    edited, what = _pickle_edit(rng, meta.read_bytes())
    meta.write_bytes(edited)
    return f".metadata: {what}"


# -- one mutant --------------------------------------------------------------------------------------


@dataclass
class Mutant:
    index: int
    seed: Seed
    family: str
    what: str
    raw: bool  # the seed's checksums were left as they were
    escapes: bool  # the mutant routes a tensor outside its folder
    path: Path


FILE_FAMILIES: dict[str, list[tuple[str, int]]] = {
    "zip": [
        ("bit flips", 3),
        ("byte set", 1),
        ("integer field", 2),
        ("truncation", 2),
        ("splice", 2),
        ("zip region flip", 4),
        ("zip record edit", 3),
        ("pickle opcode edit", 6),
        ("crafted pickle", 4),
        ("crafted tensor reduce", 1),
        ("code payload", 1),
    ],
    "legacy": [
        ("bit flips", 3),
        ("byte set", 1),
        ("integer field", 2),
        ("truncation", 2),
        ("splice", 2),
        ("legacy pickle opcode edit", 3),
    ],
    "safetensors": [
        ("bit flips", 2),
        ("byte set", 1),
        ("integer field", 2),
        ("truncation", 2),
        ("splice", 1),
        ("header bytes flip", 2),
        ("header edit", 8),
        ("crafted safetensors", 1),
    ],
    "dcp": [("file bytes", 4), ("folder attack", 2), ("dcp metadata edit", 4)],
    "hf": [("file bytes", 3), ("folder attack", 2), ("hf index edit", 3), ("shard header edit", 2)],
    "deepspeed": [("file bytes", 4), ("folder attack", 2), ("latest edit", 2), ("rank pickle opcode edit", 2)],
}
# Changes of bytes under the seed's checksums, which are left as they were. Not the folder attacks
# or latest edits: a whole file swapped for another checkpoint's is as intact as the original.
RAW_FAMILIES = {
    "bit flips",
    "byte set",
    "integer field",
    "truncation",
    "splice",
    "zip region flip",
    "header bytes flip",
    "header edit",
    "file bytes",
    "shard header edit",
}


def _legacy_pickle_edit(rng: random.Random, data: bytes) -> tuple[bytes, str]:
    """An opcode edit of a legacy file's main pickle (the third of its pickles)."""
    f = io.BytesIO(data)
    try:
        for _ in range(2):
            pickle.load(f)  # magic number, protocol version: plain ints
        start = f.tell()
        ops = _ops(data[start:])
    except Exception as e:  # noqa: BLE001  # a legacy file that does not parse: nothing to edit
        raise NotApplicable from e
    end = start + ops[-1][3]
    edited, what = _pickle_edit(rng, data[start:end])
    return data[:start] + edited + data[end:], f"main pickle: {what}"


def build_mutant(seeds: list[Seed], campaign_seed: int, index: int, work: Path) -> Mutant:
    """Mutant ``index`` of campaign ``campaign_seed``, written under ``work`` (a fresh folder)."""
    rng = random.Random(f"{campaign_seed}:{index}")
    seed = rng.choices(seeds, weights=[s.weight for s in seeds])[0]
    families = FILE_FAMILIES[seed.kind]
    for _attempt in range(20):
        family = rng.choices([f for f, _ in families], weights=[w for _, w in families])[0]
        target = work / seed.name
        if target.exists() or target.is_symlink():
            shutil.rmtree(target) if target.is_dir() and not target.is_symlink() else target.unlink()
        if seed.path.is_dir():
            shutil.copytree(seed.path, target, symlinks=True)
        else:
            shutil.copyfile(seed.path, target)
        outside = work / "outside.bin"
        escapes = False
        try:
            what = _apply(rng, family, seed, target, outside, work)
            if isinstance(what, tuple):
                what, escapes = what
        except NotApplicable:
            continue
        return Mutant(index, seed, family, what, family in RAW_FAMILIES, escapes, target)
    raise RuntimeError(f"no family applies to seed {seed.name}")


# The families that rewrite the seed's one file: a function of the random source and its bytes.
REWRITES: dict[str, Callable[[random.Random, bytes], tuple[bytes, str]]] = {
    **RAW,
    "zip region flip": _zip_region_flip,
    "zip record edit": _record_edit,
    "pickle opcode edit": _zip_pickle_edit,
    "crafted pickle": _crafted_pickle,
    "legacy pickle opcode edit": _legacy_pickle_edit,
    "header edit": _header_edit,
    "header bytes flip": _header_length_raw,
}


def _apply(
    rng: random.Random, family: str, seed: Seed, target: Path, outside: Path, work: Path
) -> str | tuple[str, bool]:
    def rewrite(fn: Callable[[random.Random, bytes], tuple[bytes, str]], path: Path = target) -> str:
        data, what = fn(rng, path.read_bytes())
        path.write_bytes(data)
        return what

    if family in REWRITES:
        return rewrite(REWRITES[family])
    if family == "crafted tensor reduce":
        data, what = _reduce_crafted(rng, work)
        target.write_bytes(data)
        return what
    if family == "code payload":
        return _code_payload(rng, target, work / MARKER)
    if family == "crafted safetensors":
        what = rng.choice(sorted(hostile.SAFETENSORS_CASES))
        target.write_bytes(hostile.SAFETENSORS_CASES[what])
        return what
    if family == "file bytes":
        victim = rng.choice(_files(target))
        fn = rng.choice(
            [_flip_bits, _set_bytes, _set_int, _truncate, _splice, _zip_region_flip]
            if victim.suffix == ".pt"
            else [_flip_bits, _set_bytes, _set_int, _truncate, _splice]
        )
        return f"{victim.relative_to(target)}: {rewrite(fn, victim)}"
    if family == "folder attack":
        return _folder_attack(rng, target, outside)
    if family == "dcp metadata edit":
        return _dcp_metadata_edit(rng, target)
    if family == "hf index edit":
        return _hf_index_edit(rng, target, outside)
    if family == "shard header edit":
        shards = sorted(target.glob("*.safetensors"))
        if not shards:
            raise NotApplicable
        victim = rng.choice(shards)
        return f"{victim.name}: {rewrite(_header_edit, victim)}"
    if family == "latest edit":
        return _latest_edit(rng, target)
    if family == "rank pickle opcode edit":
        victim = rng.choice(sorted(target.rglob("*.pt")))
        return f"{victim.relative_to(target)}: {rewrite(_zip_pickle_edit, victim)}"
    raise AssertionError(family)


# -- judging a mutant ----------------------------------------------------------------------------------


class Hang(BaseException):
    """The alarm: a BaseException, so that no reader's ``except Exception`` hides it."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise Hang


@contextlib.contextmanager
def _alarm(budget: float) -> Iterator[None]:
    """Raise Hang in the block once it has run ``budget`` seconds (each reader call has its own)."""
    signal.setitimer(signal.ITIMER_REAL, budget)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0][:240]


def _diff(a: Any, b: Any) -> str | None:
    """Where ``a`` and ``b`` first differ (tensors bit for bit, mappings by key), or None.

    Iterative, and each pair of containers is compared once: a crafted pickle's value may be nested
    200,000 deep, or one list shared 2**60 ways.
    """
    import torch

    parents: list[tuple[int, str]] = [(-1, "")]
    stack: list[tuple[Any, Any, int]] = [(a, b, 0)]
    seen: set[tuple[int, int]] = set()

    def where(i: int) -> str:
        parts = []
        while i > 0:
            i, key = parents[i]
            parts.append(key)
        text = "".join(reversed(parts)) or "/"
        return text if len(text) <= 120 else f"{text[:60]}...{text[-50:]}"

    def push(x: Any, y: Any, at: int, key: str) -> None:
        parents.append((at, key))
        stack.append((x, y, len(parents) - 1))

    while stack:
        x, y, at = stack.pop()
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
                return f"{where(at)}: {type(x).__name__} vs {type(y).__name__}"
            if x.dtype != y.dtype or tuple(x.shape) != tuple(y.shape):
                return f"{where(at)}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
            try:
                same = torch.equal(
                    x.reshape(-1).contiguous().view(torch.uint8), y.reshape(-1).contiguous().view(torch.uint8)
                )
            except RuntimeError:
                same = torch.equal(x, y)
            if not same:
                return f"{where(at)}: values differ"
            continue
        storages = (torch.storage.TypedStorage, torch.UntypedStorage)
        if isinstance(x, storages) or isinstance(y, storages):  # a bare storage (a tensor's REDUCE undone)
            if type(x) is not type(y) or getattr(x, "dtype", None) != getattr(y, "dtype", None):
                return f"{where(at)}: {type(x).__name__} vs {type(y).__name__}"
            if bytes(x.untyped() if isinstance(x, torch.storage.TypedStorage) else x) != bytes(
                y.untyped() if isinstance(y, torch.storage.TypedStorage) else y
            ):
                return f"{where(at)}: storage bytes differ"
            continue
        containers = (Mapping, list, tuple)
        if isinstance(x, containers) and isinstance(y, containers):
            if (id(x), id(y)) in seen:
                continue
            seen.add((id(x), id(y)))
        if isinstance(x, Mapping) and isinstance(y, Mapping):
            if set(x) != set(y):
                return f"{where(at)}: keys {sorted(map(str, set(x) ^ set(y)))[:4]} on one side only"
            for k in reversed(list(x)):
                push(x[k], y[k], at, f"/{k}")
            continue
        if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
            if type(x) is not type(y) or len(x) != len(y):
                return f"{where(at)}: {type(x).__name__}[{len(x)}] vs {type(y).__name__}[{len(y)}]"
            for k in reversed(range(len(x))):
                push(x[k], y[k], at, f"[{k}]")
            continue
        if type(x) is not type(y):
            return f"{where(at)}: {type(x).__name__} vs {type(y).__name__}"
        if not (x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y))):
            return f"{where(at)}: {x!r:.40} vs {y!r:.40}"
    return None


def _weights(obj: Any, at: str) -> Any:
    for part in [p for p in at.split("/") if p]:
        obj = obj[part]
    return obj


def _tensors(obj: Any) -> dict[str, Any]:
    import torch

    return {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)} if isinstance(obj, Mapping) else {}


def _inside(folder: Path, name: str) -> bool:
    return not Path(name).is_absolute() and ".." not in Path(name).parts


def reference(mutant: Mutant) -> Any:
    """What the format's own reader makes of the mutant; None where there is none (DCP, DeepSpeed)."""
    import torch
    from safetensors.torch import load_file

    kind, path = mutant.seed.kind, mutant.path
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind in ("zip", "legacy"):
            return torch.load(path, weights_only=True, map_location="cpu")
        if kind == "safetensors":
            return load_file(path)
        if kind == "hf":
            index = next(path.glob("*.index.json"))
            if not stat.S_ISREG(index.stat().st_mode):
                raise ValueError(f"{index.name} is not a regular file")
            weight_map = json.loads(index.read_text())["weight_map"]
            out, shards = {}, {}
            for name, shard in weight_map.items():
                if not _inside(path, shard):
                    raise ValueError(f"{shard} is outside the folder")
                if shard not in shards:
                    shard_path = path / shard
                    if not stat.S_ISREG(shard_path.stat().st_mode):  # a loader opening a FIFO would wait forever
                        raise ValueError(f"{shard} is not a regular file")
                    shards[shard] = (
                        load_file(shard_path)
                        if shard.endswith(".safetensors")
                        else torch.load(shard_path, weights_only=True, map_location="cpu")
                    )
                out[name] = shards[shard][name]
            return out
    return None


def judge(mutant: Mutant, original: Any, budget: float) -> dict[str, Any]:
    """Run every reader on ``mutant``; return its findings (class, op, detail) and what happened."""
    import ckptkit

    out_dir = mutant.path.parent / "out"
    out_dir.mkdir(exist_ok=True)
    findings: list[dict[str, str]] = []
    info: list[str] = []
    outcome: dict[str, tuple[str, Any]] = {}

    def find(cls: str, op: str, detail: str) -> None:
        findings.append({"class": cls, "op": op, "detail": detail})

    def call(op: str, fn: Callable[[], Any]) -> tuple[str, Any]:
        current[0] = op
        try:
            with _alarm(budget):
                result = ("ok", fn())
        except ckptkit.CkptkitError as e:
            result = ("refused", e)
        except Hang:
            raise
        except BaseException as e:  # the finding itself: anything else escaping a reader
            result = ("raised", e)
            if op != "reference":
                tb = traceback.extract_tb(e.__traceback__)
                where = next(
                    (f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "ckptkit" in f.filename), "?"
                )
                find("exceptions", op, f"{type(e).__name__} at {where}: {_first_line(e)}")
        outcome[op] = result
        return result

    current = ["start"]
    signal.signal(signal.SIGALRM, _on_alarm)
    # The backstop for a reader stuck in C code, where the alarm's handler never runs: every call's
    # budget and a margin, then faulthandler prints where it was and ends the worker.
    faulthandler.dump_traceback_later(budget * 8 + 30, exit=True)
    try:
        v = call("verify", lambda: ckptkit.verify_checkpoint(mutant.path))
        r = call("read", lambda: ckptkit.read_checkpoint(mutant.path, map_location="cpu"))
        call("inspect", lambda: ckptkit.inspect_checkpoint(mutant.path))
        dst = out_dir / "lib.safetensors"
        c = call(
            "convert", lambda: ckptkit.convert_checkpoint(mutant.path, dst, force=True, to="keep", model_only=True)
        )
        current[0] = "cli"
        _cli(mutant, out_dir, find, budget)
        try:
            ref = call("reference", lambda: reference(mutant))
        except Hang:
            ref = ("hung", None)
            info.append("reference reader hung")
    except Hang:
        find("hangs", current[0], f"{current[0]} ran past the {budget:g} s budget of one call")
        return {"findings": findings, "info": info}
    finally:
        faulthandler.cancel_dump_traceback_later()

    if (mutant.path.parent / MARKER).exists():
        find("payloads run", "any", "a pickled payload ran: its marker file exists")
    report = v[1] if v[0] == "ok" else None
    verified = report is not None and report.ok
    failed = [] if report is None else [c for c in report.checks if not c.ok]
    checksum_only = bool(failed) and all("crc" in c.name.lower() or "checksum" in c.name.lower() for c in failed)
    info.append(
        f"verify {'ok' if verified else 'checksum only' if checksum_only else 'fails'}; read {r[0]}; convert {c[0]}; reference {ref[0]}"
    )
    failed_text = "; ".join(f"{c.name}: {c.detail}"[:160] for c in failed)[:400]

    # disagreements
    if verified and r[0] == "refused":
        find("disagreements", "verify/read", f"verify passes, read_checkpoint refuses: {_first_line(r[1])}")
    if report is not None and not verified and not checksum_only and r[0] == "ok":
        find("disagreements", "verify/read", f"verify fails ({failed_text}), read_checkpoint reads it")
    if verified and ref[0] in ("refused", "raised") and mutant.seed.kind in ("zip", "legacy", "safetensors"):
        find(
            "disagreements",
            "verify/reference",
            f"verify passes, the reference reader refuses: {type(ref[1]).__name__}: {_first_line(ref[1])}",
        )
    if report is not None and not verified and c[0] == "ok" and not _unread_only(failed, c[1].unread):
        find("disagreements", "verify/convert", f"convert writes what verify rejects ({failed_text})")
    if mutant.escapes and (verified or r[0] == "ok"):
        find(
            "disagreements",
            "escape",
            f"an index naming a shard outside the folder was accepted (verify {'ok' if verified else 'fails'}, read {r[0]})",
        )

    # silent changes
    if r[0] == "ok" and ref[0] == "ok" and ref[1] is not None:
        d = _diff(r[1], ref[1])
        if d:
            find("silent changes", "read/reference", f"read_checkpoint differs from the reference reader at {d}")
    if isinstance(original, Unreadable):
        original = None
    if verified and r[0] == "ok" and mutant.raw and mutant.seed.checksummed and original is not None:
        d = _diff(r[1], original)
        if d:
            find(
                "silent changes", "checksums", f"raw bytes changed, verify passes, values differ from the seed's at {d}"
            )
    if c[0] == "ok":
        _check_converted(mutant, c[1], dst, r, ref, original, find)
    elif dst.exists() or any(p.name.endswith(TMP_SUFFIX) for p in out_dir.iterdir()):
        find("debris", "convert", "a failed convert left its output or a temp file")
    return {"findings": findings, "info": info}


def _unread_only(failed: list[Any], unread: list[str]) -> bool:
    """Whether verify failed only on CRC-32s of records that convert says it never read (a
    model-only copy leaves the optimizer's records unread, as it promises, and says so)."""
    damaged: list[str] = []
    for check in failed:
        if check.name != "CRC-32 of every record" or not check.detail.startswith("damaged: "):
            return False
        names = check.detail.removeprefix("damaged: ")
        if " ... and " in names:  # not every name shown: cannot tell
            return False
        damaged += names.split(", ")
    return bool(damaged) and set(damaged) <= set(unread)


def _check_converted(
    mutant: Mutant,
    report: Any,
    dst: Path,
    r: tuple[str, Any],
    ref: tuple[str, Any],
    original: Any,
    find: Callable[[str, str, str], None],
) -> None:
    from safetensors.torch import load_file

    try:
        written = load_file(dst)
    except Exception as e:  # noqa: BLE001  # whatever safetensors raises: convert wrote a file it cannot read
        find(
            "silent changes",
            "convert",
            f"convert wrote a file safetensors cannot read: {type(e).__name__}: {_first_line(e)}",
        )
        return
    for tie in report.tied:
        alias, _, target = tie.partition(" is ")
        if alias not in written and target in written:
            written[alias] = written[target]
    against = [("read_checkpoint", r), ("the reference reader", ref)]
    if mutant.raw and mutant.seed.checksummed and original is not None:
        against.append(("the seed", ("ok", original)))
    for who, (status, value) in against:
        if status != "ok" or value is None:
            continue
        try:
            expected = _tensors(_weights(value, report.weights_at))
        except (KeyError, TypeError, IndexError):
            # weights_at joins keys with "/": a key that holds one (a crafted "../model") cannot be
            # walked back here. Compared as one key where it is one; else left uncompared.
            if not (isinstance(value, Mapping) and report.weights_at in value):
                continue
            expected = _tensors(value[report.weights_at])
        d = _diff(written, expected)
        if d:
            find("silent changes", "convert", f"convert's output differs from {who} at {d}")


def _cli(mutant: Mutant, out_dir: Path, find: Callable[[str, str, str], None], budget: float) -> None:
    from click.testing import CliRunner

    from ckptkit.cli import main

    runner = CliRunner()
    out = out_dir / "cli.safetensors"
    for cmd in (
        ["verify", str(mutant.path)],
        ["inspect", str(mutant.path)],
        ["convert", str(mutant.path), str(out), "--to", "keep", "--model-only", "--force"],
    ):
        with _alarm(budget):
            result = runner.invoke(main, cmd)
        op = f"cli {cmd[0]}"
        if isinstance(result.exception, Hang):
            raise result.exception
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            find("exceptions", op, f"uncaught {type(result.exception).__name__}: {_first_line(result.exception)}")
            continue
        if "Traceback" in result.stderr or "Traceback" in result.stdout:
            find("exceptions", op, "printed a traceback")
        if result.exit_code not in (0, 1):
            find("exceptions", op, f"exit {result.exit_code}: {result.stderr.strip()[:200]}")
        # verify reports its failed checks on stdout, and inspect its summary of a file it would not
        # load (what the file needs trusted); an error is one line on stderr.
        reported = cmd[0] == "verify" or (cmd[0] == "inspect" and not result.stderr and result.stdout)
        if result.exit_code == 1 and not reported:
            if not (result.stderr.startswith("ckptkit: error: ") and len(result.stderr.strip().splitlines()) == 1):
                find("exceptions", op, f"error is not one line: {result.stderr[:200]!r}")
        if cmd[0] == "convert" and result.exit_code != 0:
            if out.exists() or any(p.name.endswith(TMP_SUFFIX) for p in out_dir.iterdir()):
                find("debris", op, "a failed convert left its output or a temp file")


def originals(seeds: list[Seed]) -> dict[str, Any]:
    """Each seed's values as its own reader gives them (ckptkit's, for DCP, HF and DeepSpeed)."""
    import ckptkit

    found: dict[str, Any] = {}
    for s in seeds:
        shadow = Mutant(-1, s, "seed", "unchanged", False, False, s.path)
        try:
            found[s.name] = (
                reference(shadow)
                if s.kind in ("zip", "legacy", "safetensors")
                else ckptkit.read_checkpoint(s.path, map_location="cpu")
            )
        except Exception as e:  # noqa: BLE001  # reported by the campaign as a finding of its own
            found[s.name] = Unreadable(f"{type(e).__name__}: {_first_line(e)}")
    return found


@dataclass(frozen=True)
class Unreadable:
    """A seed its own reader could not read: mutants of it are judged without the seed's values."""

    error: str


# -- the worker and the campaign -------------------------------------------------------------------------


def worker(folder: Path, campaign_seed: int, start: int, stop: int, budget: float) -> None:
    """Judge mutants ``start`` to ``stop``, one JSON line each (and one as each starts) on stdout."""
    import resource

    import torch

    resource.setrlimit(resource.RLIMIT_AS, (6 << 30, resource.getrlimit(resource.RLIMIT_AS)[1]))
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    seeds = load_seeds(folder / "seeds")
    original = originals(seeds)
    work_root = folder / "work" / f"w{os.getpid()}"
    findings_dir = folder / "findings"
    for i in range(start, stop):
        print(json.dumps({"start": i}), flush=True)
        work = work_root / f"m{i}"
        work.mkdir(parents=True)
        m = build_mutant(seeds, campaign_seed, i, work)
        began = time.monotonic()
        result = judge(m, original[m.seed.name], budget)
        result.update(index=i, seed=m.seed.name, family=m.family, what=m.what, seconds=time.monotonic() - began)
        if result["findings"]:
            keep = findings_dir / f"m{i:05d}"
            keep.mkdir(parents=True, exist_ok=True)
            for part in work.iterdir():
                if part.name != "out":  # the mutant, and any file outside it that it names
                    _copy(part, keep / part.name)
            result["saved"] = str(keep / m.path.name)
        print(json.dumps({"result": result}), flush=True)
        shutil.rmtree(work, ignore_errors=True)


def _copy(src: Path, dst: Path) -> None:
    """Copy a file or folder as it is: symbolic links as links, FIFOs as new FIFOs (never opened)."""
    if src.is_symlink():
        dst.symlink_to(os.readlink(src))
    elif src.is_dir():
        dst.mkdir()
        for child in sorted(src.iterdir()):
            _copy(child, dst / child.name)
    elif stat.S_ISFIFO(src.lstat().st_mode):
        os.mkfifo(dst)
    else:
        shutil.copyfile(src, dst)


def _run_batch(folder: Path, campaign_seed: int, start: int, stop: int, budget: float) -> list[dict[str, Any]]:
    """Mutants ``start`` to ``stop`` in worker processes; a worker that dies or is stuck in C code
    is replaced, its mutant counted (a hang, or a crash), and the batch goes on after it."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in [str(ROOT), os.environ.get("PYTHONPATH", "")] if p),
    }
    results: list[dict[str, Any]] = []
    while start < stop:
        cmd = [
            sys.executable,
            "-m",
            "tests.reliability.fuzz",
            "worker",
            "--dir",
            str(folder),
            "--seed",
            str(campaign_seed),
            "--start",
            str(start),
            "--stop",
            str(stop),
            "--budget",
            str(budget),
        ]
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=(stop - start) * (budget * 3 + 40) + 300
        )
        started = None
        for line in proc.stdout.splitlines():
            if not line.startswith("{"):
                continue
            msg = json.loads(line)
            if "start" in msg:
                started = msg["start"]
            elif "result" in msg:
                results.append(msg["result"])
                started = None
        if started is None:
            if proc.returncode != 0:
                raise RuntimeError(
                    f"fuzz worker failed outside any mutant (exit {proc.returncode}): {proc.stderr[-3000:]}"
                )
            break
        stuck = "Timeout (" in proc.stderr
        cls = "hangs" if stuck else "exceptions"
        detail = (
            "stuck in C code past the budget; faulthandler ended the worker"
            if stuck
            else f"the worker died (exit {proc.returncode})"
        )
        seeds = load_seeds(folder / "seeds")
        work = folder / "findings" / f"m{started:05d}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        m = build_mutant(seeds, campaign_seed, started, work)
        tail = " | ".join(line.strip() for line in proc.stderr.strip().splitlines()[-6:])
        results.append(
            {
                "index": started,
                "seed": m.seed.name,
                "family": m.family,
                "what": m.what,
                "saved": str(m.path),
                "info": [],
                "findings": [{"class": cls, "op": "worker", "detail": f"{detail}: {tail[:400]}"}],
            }
        )
        start = started + 1
    return results


def campaign(
    n: int, campaign_seed: int, folder: Path, *, jobs: int = 2, budget: float = 10.0, batch: int | None = None
) -> dict[str, Any]:
    """Make the seeds, judge mutants ``0 .. n-1`` in ``jobs`` processes at once, and tally."""
    import ckptkit

    began = time.monotonic()
    seeds = make_seeds(folder / "seeds")
    broken = {k: v for k, v in originals(seeds).items() if isinstance(v, Unreadable)}
    size = batch or max(50, min(1000, -(-n // (2 * jobs))))
    ranges = [(a, min(a + size, n)) for a in range(0, n, size)]
    with ThreadPoolExecutor(jobs) as pool:
        parts = list(pool.map(lambda r: _run_batch(folder, campaign_seed, r[0], r[1], budget), ranges))
    results = sorted((r for part in parts for r in part), key=lambda r: r["index"])
    families: Counter[str] = Counter()
    per_seed: Counter[str] = Counter()
    verdicts: Counter[str] = Counter()
    findings = [
        {"class": "exceptions", "op": "seed", "detail": f"the unmutated seed does not read: {v.error}", "index": -1}
        | {"seed": k, "family": "none", "what": "the seed itself", "saved": str(folder / "seeds" / k)}
        for k, v in broken.items()
    ]
    counts = Counter({c: 0 for c in CLASSES})
    counts["exceptions"] += len(broken)
    family_seconds: Counter[str] = Counter()
    for r in results:
        families[r["family"]] += 1
        family_seconds[r["family"]] += r.get("seconds", budget)
        per_seed[r["seed"]] += 1
        for line in r["info"]:
            verdicts[line.split(";")[0]] += 1
        for cls in {f["class"] for f in r["findings"]}:
            counts[cls] += 1  # mutants, not findings: one mutant may break several readers the same way
        for f in r["findings"]:
            findings.append(
                {
                    **f,
                    "index": r["index"],
                    "seed": r["seed"],
                    "family": r["family"],
                    "what": r["what"],
                    "saved": r.get("saved"),
                }
            )
    return {
        "mutants": len(results),
        "seed": campaign_seed,
        "ckptkit": str(Path(ckptkit.__file__).parent),
        "budget_s": budget,
        "seconds": round(time.monotonic() - began, 1),
        "counts": dict(counts),
        "families": dict(sorted(families.items())),
        "family_seconds": {k: round(v, 1) for k, v in family_seconds.most_common()},
        "seeds": dict(sorted(per_seed.items())),
        "verify": dict(sorted(verdicts.items())),
        "findings": findings,
    }


def summary_lines(result: dict[str, Any], per_class: int = 12, *, paths: bool = True) -> list[str]:
    """The counts, then the findings grouped by class and by what broke, one line per group: at most
    ``per_class`` groups of each class, the largest first (for a test's message or a report)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for f in result["findings"]:
        groups.setdefault((f["class"], f["op"], _shape(f["detail"])), []).append(f)
    lines = [f"{result['counts']}"]
    for cls in CLASSES:
        mine = sorted(((k, v) for k, v in groups.items() if k[0] == cls), key=lambda kv: -len(kv[1]))
        for (_, op, shape), fs in mine[:per_class]:
            f = fs[0]
            where = f"; {f['saved']}" if paths else ""
            lines.append(
                f"[{cls}] {op}: {shape} x{len(fs)} (e.g. mutant {f['index']}, {f['seed']} / {f['family']}: {f['what'][:80]}{where})"
            )
        if len(mine) > per_class:
            lines.append(f"[{cls}] ... and {len(mine) - per_class} more kinds")
    return lines


def _shape(detail: str) -> str:
    """A finding's detail with its numbers and paths blurred, so alike findings group."""
    import re

    text = re.sub(r"/[^\s:;,()']+", "PATH", detail)
    return re.sub(r"\d+", "N", text)[:160]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="a whole campaign; prints its summary as JSON")
    run.add_argument("--n", type=int, default=3000)
    run.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    for p in (run, sub.add_parser("worker"), sub.add_parser("one", help="rebuild mutant --index and judge it")):
        p.add_argument("--dir", type=Path, required=True)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--budget", type=float, default=10.0)
    sub.choices["worker"].add_argument("--start", type=int, required=True)
    sub.choices["worker"].add_argument("--stop", type=int, required=True)
    sub.choices["one"].add_argument("--index", type=int, required=True)
    args = ap.parse_args()
    if args.command == "run":
        result = campaign(args.n, args.seed, args.dir, jobs=args.jobs, budget=args.budget)
        print("\n".join(summary_lines(result, per_class=100)), file=sys.stderr)
        print(json.dumps(result))
    elif args.command == "worker":
        worker(args.dir, args.seed, args.start, args.stop, args.budget)
    else:
        seeds = make_seeds(args.dir / "seeds")
        work = args.dir / "one" / f"m{args.index}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        m = build_mutant(seeds, args.seed, args.index, work)
        warnings.simplefilter("ignore")
        result = judge(m, originals([m.seed])[m.seed.name], args.budget)
        print(
            json.dumps(
                {"mutant": str(m.path), "seed": m.seed.name, "family": m.family, "what": m.what, **result}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
