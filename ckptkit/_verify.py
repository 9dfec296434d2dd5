"""``ckptkit verify``: is this checkpoint intact, and can it be loaded without trusting it?

Every check is listed with its outcome. Nothing runs pickled code: pickles are read through
stand-ins or scanned opcode by opcode; torch is used only for files whose globals all passed
torch's weights-only allowlist.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ._errors import PARSE_ERRORS, CheckpointFormatError, CkptkitError, summarize
from ._formats import (
    DCP,
    LEGACY,
    SAFETENSORS,
    ZIP,
    check_exists,
    checkpoint_globals,
    detect_format,
    filter_unsafe,
    pickle_globals,
)


@dataclass
class VerifyReport:
    """Each check as ``{"check", "ok", "detail"}``; ``ok`` is True when all passed."""

    path: str
    format: str = "unknown"
    checks: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    def add(self, check: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": check, "ok": ok, "detail": detail})
        return ok

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def verify_checkpoint(path: str | os.PathLike[str]) -> VerifyReport:
    """Check integrity (zip CRCs, header bounds, storage extents, DCP shards) and safety.

    Example:
        >>> verify_checkpoint("fixtures/ddp.pt").ok  # doctest: +SKIP
        True
    """
    report = VerifyReport(os.fspath(path))
    try:
        p = check_exists(path)
        report.format = detect_format(p)
    except CkptkitError as e:
        report.add("format", False, str(e))
        return report
    report.add("format", True, report.format)
    check = {ZIP: _zip, SAFETENSORS: _safetensors, LEGACY: _legacy, DCP: _dcp}[report.format]
    try:
        check(p, report)
    except CkptkitError as e:
        report.add("structure", False, str(e))
    return report


def _globals_safe(p: Path, report: VerifyReport) -> bool:
    unsafe = filter_unsafe(checkpoint_globals(p))
    return report.add(
        "safe to load",
        not unsafe,
        f"needs --trust: pickle names {summarize(unsafe)}" if unsafe else "only weights-only globals",
    )


def _zip(p: Path, report: VerifyReport) -> None:
    from ._torchzip import TorchZip

    z = TorchZip(p)
    try:
        _zip_checks(p, z, report)
    finally:
        z.close()


def _zip_checks(p: Path, z: Any, report: VerifyReport) -> None:
    from . import _lazy_pickle as lp
    from ._bounds import tensor_problems
    from ._torchzip import crc_of_range

    report.add("zip structure", True, f"{len(z.records)} records")
    bad = []
    for rec in z.records:  # read through z.file: the version opened, even if the path is replaced
        if rec.method == 0 and crc_of_range(z.file, rec.data_offset, rec.compressed_size) != rec.crc:
            bad.append(rec.name)
    report.add("CRC-32 of every record", not bad, f"damaged: {summarize(bad)}" if bad else f"{len(z.records)} records match")
    try:
        obj = lp.loads(z.read(f"{z.prefix}data.pkl"))
    except lp.UnsupportedGlobal:
        if _globals_safe(p, report):
            _torch_loads(p, report)
        return
    report.add("safe to load", True, "only tensors, containers and plain values")
    problems = tensor_problems(obj, z)
    report.add("tensors fit their storages", not problems, summarize(problems, 3) if problems else "all in bounds")


def _torch_loads(p: Path, report: VerifyReport) -> None:
    from ._load import read_checkpoint

    try:
        read_checkpoint(p, map_location="cpu")
    except CkptkitError as e:
        report.add("loads with torch (weights-only)", False, str(e))
    else:
        report.add("loads with torch (weights-only)", True)


def _safetensors(p: Path, report: VerifyReport) -> None:

    from ._safetensors import ALIASES_KEY, CRC_KEY, parse_aliases, parse_crcs, read_header
    from ._torchzip import crc_of_range

    with open(p, "rb") as f:
        header, start = read_header(f, source=str(p))
        meta = header.pop("__metadata__", None) or {}
        report.add("header and offsets", True, f"{len(header)} tensors, dtypes known, offsets in bounds, no overlap or gap")
        if ALIASES_KEY in meta:
            try:
                detail = f"{len(parse_aliases(meta, header, str(p)))} alias(es), each naming a stored tensor"
            except CheckpointFormatError as e:
                report.add("tied tensors", False, str(e))
                return
            report.add("tied tensors", True, detail)
        if CRC_KEY not in meta:
            report.add("checksums", True, "none recorded (not written by ckptkit): a flipped bit in tensor data cannot be detected")
            return
        try:
            recorded = parse_crcs(meta, str(p))
        except CheckpointFormatError as e:
            report.add("CRC-32 of every tensor", False, str(e))
            return
        bad = [n for n, e in header.items() if n in recorded and crc_of_range(f, start + e["data_offsets"][0],
               e["data_offsets"][1] - e["data_offsets"][0]) != recorded[n]]  # fmt: skip
        unchecked = [n for n in header if n not in recorded]
    detail = f"damaged: {summarize(bad)}" if bad else f"{len(header) - len(unchecked)} tensors match"
    report.add("CRC-32 of every tensor", not bad, detail + (f"; no CRC for {summarize(unchecked)}" if unchecked else ""))


def _legacy(p: Path, report: VerifyReport) -> None:
    if _globals_safe(p, report):
        _torch_loads(p, report)
    report.add("checksums", True, "the legacy format stores none; convert to torch zip to get CRC-32s")


def _dcp(p: Path, report: VerifyReport) -> None:
    from ._dcp import _safe, metadata_globals

    unsafe = [g for g in metadata_globals(p) if not _safe(g)]
    if not report.add("safe to load", not unsafe, f"needs --trust: .metadata names {summarize(unsafe)}" if unsafe else "DCP metadata classes only"):
        return
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = FileSystemReader(str(p)).read_metadata()
    except Exception as e:  # .metadata passed the allowlist; anything else is damage
        report.add("metadata", False, f"{type(e).__name__}: {e}")
        return
    report.add("metadata", True, f"{len(meta.state_dict_metadata)} entries")
    _dcp_entries(p, meta, report)
    problems, sizes = [], {}
    for index, info in (meta.storage_data or {}).items():
        shard = p / info.relative_path
        if shard not in sizes:
            sizes[shard] = shard.stat().st_size if shard.is_file() else -1
        if sizes[shard] < 0:
            problems.append(f"{info.relative_path} missing ({index.fqn})")
        elif info.offset + info.length > sizes[shard]:
            problems.append(f"{index.fqn}: bytes {info.offset}+{info.length} past the end of {info.relative_path}")
    report.add("shards present and long enough", not problems, summarize(sorted(set(problems)), 3) if problems else f"{len(sizes)} shard file(s)")


def _dcp_entries(p: Path, meta: Any, report: VerifyReport) -> None:
    """Non-tensor DCP entries are torch.save'd pickles inside the shards: list their globals."""
    import io
    import zipfile

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    unsafe: dict[str, list[str]] = {}
    for index, info in (meta.storage_data or {}).items():
        if not isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        shard = p / info.relative_path
        if not shard.is_file():
            continue  # reported by the shard check
        with open(shard, "rb") as f:
            f.seek(info.offset)
            blob = f.read(min(info.length, max(0, shard.stat().st_size - info.offset)))
        try:
            with zipfile.ZipFile(io.BytesIO(blob)) as zf:
                names = [g for n in zf.namelist() if n.endswith("data.pkl") for g in pickle_globals(zf.read(n))]
        except (CkptkitError, *PARSE_ERRORS):  # type: ignore[misc]
            unsafe[index.fqn] = ["<unreadable pickle>"]
            continue
        bad = filter_unsafe(names)
        if bad:
            unsafe[index.fqn] = bad
    shown = [f"{fqn}: {', '.join(g)}" for fqn, g in unsafe.items()]
    report.add("non-tensor entries safe to load", not unsafe, f"needs --trust: {summarize(shown, 3)}" if unsafe else "weights-only globals")
