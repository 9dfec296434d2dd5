"""Is a torch zip or safetensors file intact? Typed checks, computed without torch.

Each check says what it covers (``kind``): ``integrity`` (the bytes are what the file says they
are) or ``safety`` (loading it would not import anything beyond what is allowed). ``full``
checks read every payload byte (CRC-32s); the structural level reads headers and pickles only,
which is what a resume needs to pick a checkpoint quickly.

Example:
    >>> Check("CRC-32 of every record", "integrity", True, "33 records match").to_dict()["kind"]
    'integrity'
"""

from __future__ import annotations

import functools
import os
import zipfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from ..errors import PARSE_ERRORS, CheckpointFormatError, CheckpointWriteError, CkptkitError, summarize
from ..io.atomic import Kept
from ..io.fileio import Progress, crc32, crc_of_range, open_regular
from .hf.detect import HF, shard_format
from .hf.index import read_index
from .pickles import reader as tp
from .pickles.scan import sharded_tensor_error
from .safetensors.codec import (
    ALIASES_KEY,
    CRC_KEY,
    HEADER_CRC_KEY,
    HeaderKept,
    parse_aliases,
    parse_crcs,
    read_header,
)
from .safetensors.detect import SAFETENSORS
from .torchzip import modulepickle as mp
from .torchzip.bounds import StorageFit, tensor_problems, tensors_in
from .torchzip.container import Record, TorchZip
from .torchzip.detect import ZIP
from .torchzip.kept import RecordsKept

Kind = Literal["integrity", "safety"]


@dataclass(frozen=True)
class Check:
    """One check's outcome.

    Attributes:
        name: what was checked, e.g. ``"CRC-32 of every record"``.
        kind: ``"integrity"`` or ``"safety"``.
        ok: whether it passed.
        detail: what was found.
        needs: for a failed safety check, the globals the file needs (``argparse.Namespace``).
    """

    name: str
    kind: Kind
    ok: bool
    detail: str = ""
    needs: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["check"] = d.pop("name")  # the --json spelling
        d["needs"] = list(self.needs)
        return d


def zip_checks(z: TorchZip, *, full: bool, progress: Progress | None = None) -> tuple[list[Check], bool]:
    """Checks of an opened torch zip; also True when its pickle needs torch to be judged further.

    The pickle is read through inert stand-ins, every declared storage checked against its
    record as it is read. If the pickle names a global the stand-ins do not model
    (``argparse.Namespace``, a numpy scalar), the caller decides safety with torch's allowlist.
    """
    checks = [Check("zip structure", "integrity", True, f"{len(z.records)} records")]
    if full:
        bad = [r.name for r in z.records if record_crc(z, r, progress) != r.crc]
        detail = f"damaged: {summarize(bad)}" if bad else f"{len(z.records)} records match"
        checks.append(Check("CRC-32 of every record", "integrity", not bad, detail))
    fit = StorageFit(z)
    data = z.read(f"{z.prefix}data.pkl")
    try:
        obj, safe = tp.loads(data, on_storage=fit), "only tensors, containers and plain values"
    except tp.UnsupportedGlobal:
        if (sharded := sharded_tensor_error(data, str(z.path))) is not None:
            raise sharded from None  # intact, and not a checkpoint to read alone
        try:
            fit = StorageFit(z)  # read again from the start
            module = mp.read_module(data, on_storage=fit)
            obj, safe = (
                module.state,
                f"a pickled {module.description} module: its state_dict() is read without running the pickle",
            )
        except mp.UnsafeModulePickle as e:
            detail = f"a pickled {e.description} module that calls or names {summarize(e.names)}, beyond what its state_dict() needs"
            return [*checks, Check("safe to load", "safety", False, detail, tuple(e.names))], False
        except (mp.NotAModule, mp.Unmodelled):
            if fit.problems:  # what was read before the global already shows damage
                checks.append(Check("storages fit their records", "integrity", False, summarize(fit.problems, 3)))
            return checks, True
        except CheckpointFormatError as why:  # as the readers say it
            raise CheckpointFormatError(f"pickled module: {why}") from None
    checks.append(Check("safe to load", "safety", True, safe))
    problems = fit.problems + tensor_problems(obj, z)
    detail = summarize(problems, 3) if problems else "all in bounds"
    checks.append(Check("tensors fit their storages", "integrity", not problems, detail))
    return checks, False


def record_crc(z: TorchZip, rec: Record, progress: Progress | None = None) -> int | None:
    """The CRC-32 of a record's bytes as stored, or as inflated for a compressed one (None: they
    do not inflate, or zipfile's own CRC check of them failed)."""
    if rec.method == 0:
        return crc_of_range(z.file, rec.data_offset, rec.compressed_size, progress)
    crc = 0
    try:
        with zipfile.ZipFile(z.file).open(rec.name) as f:
            while chunk := f.read(8 << 20):
                crc = crc32(chunk, crc)
    except CkptkitError:
        raise  # the store's failure while a URL's object was read: not the record's damage
    except PARSE_ERRORS:  # zipfile's own CRC check failed, or the stream does not inflate
        return None
    return crc


def safetensors_checks(f: BinaryIO, source: str, *, full: bool, progress: Progress | None = None) -> list[Check]:
    """Checks of a safetensors file: header, offsets, aliases and (``full``) recorded CRC-32s."""
    header, start = read_header(f, source=source)  # and what ckptkit recorded of it, where it did
    meta = header.pop("__metadata__", None) or {}
    checks = [
        Check(
            "header and offsets",
            "integrity",
            True,
            f"{len(header)} tensors, dtypes known, offsets in bounds, no overlap or gap"
            + (", header as written" if HEADER_CRC_KEY in meta else ""),
        )
    ]
    if ALIASES_KEY in meta and HEADER_CRC_KEY not in meta:
        detail = f"{ALIASES_KEY} ignored: the header is not ckptkit's (no {HEADER_CRC_KEY}), and no reader acts on it"
        checks.append(Check("tied tensors", "integrity", True, detail))
    elif ALIASES_KEY in meta:
        try:
            detail = f"{len(parse_aliases(meta, header, source))} alias(es), each naming a stored tensor"
        except CheckpointFormatError as e:
            return [*checks, Check("tied tensors", "integrity", False, str(e))]
        checks.append(Check("tied tensors", "integrity", True, detail))
    if not full:
        return checks
    if CRC_KEY not in meta:
        detail = "none recorded (not written by ckptkit): a flipped bit in tensor data cannot be detected"
        return [*checks, Check("checksums", "integrity", True, detail)]
    try:
        recorded = parse_crcs(meta, source)
    except CheckpointFormatError as e:
        return [*checks, Check("CRC-32 of every tensor", "integrity", False, str(e))]
    bad = [
        n
        for n, e in header.items()
        if n in recorded
        and crc_of_range(f, start + e["data_offsets"][0], e["data_offsets"][1] - e["data_offsets"][0], progress)
        != recorded[n]
    ]
    unchecked = [n for n in header if n not in recorded]
    detail = f"damaged: {summarize(bad)}" if bad else f"{len(header) - len(unchecked)} tensors match"
    detail += f"; no CRC for {summarize(unchecked)}" if unchecked else ""
    return [*checks, Check("CRC-32 of every tensor", "integrity", not bad, detail)]


class Damage:
    """Bytes found to differ from the CRC-32 their file records for them, while a copy reads them.

    ``check`` each range as it is read, then ``raise_if_any``: every damaged one is reported at
    once, named by ``name(key)`` (called for a mismatch only), and nothing is written.

    Example:
        >>> d = Damage("a.pt", lambda key: tensors_named([key]))
        >>> d.check("fc.weight", 0x1234, 0x1234)
        >>> d.raise_if_any()  # no mismatch: nothing raised
    """

    def __init__(self, source: str, name: Callable[[Any], str]) -> None:
        self.source, self._name = source, name
        self.found: list[str] = []

    def check(self, key: Any, recorded: int, read: int | None) -> None:
        """``read``: the CRC-32 of the bytes as read; None for compressed bytes that do not inflate."""
        if read is None:
            found = f"{self._name(key)} (compressed bytes that do not inflate to CRC-32 {recorded:08x})"
        elif read != recorded:
            found = f"{self._name(key)} (CRC-32 recorded {recorded:08x}, read {read:08x})"
        else:
            return
        if found not in self.found:  # a range read twice (a stream's first pass) is damaged once
            self.found.append(found)

    def raise_if_any(self) -> None:
        if self.found:
            raise CheckpointFormatError(
                f"{self.source} is damaged: {summarize(self.found, 3)}; nothing was written. "
                "Use an intact copy of the file (ckptkit verify lists every damaged record)"
            )


def record_tensors(z: TorchZip, obj: Any, record: str) -> str:
    """``tensor fc1.weight in record archive/data/0``: what a record holds, by where its tensors
    are in ``obj`` (the pickle read through stand-ins; None names the record alone)."""
    names = (
        sorted(w() for w, t in tensors_in(obj) if f"{z.prefix}data/{t.storage.key}" == record)
        if obj is not None
        else []
    )
    return f"{tensors_named(names)} in record {record}" if names else f"record {record}"


def tensors_named(names: list[str]) -> str:
    """``tensor a`` or ``tensors a, b``."""
    return f"tensor{'s' if len(names) > 1 else ''} {', '.join(names)}"


def check_recorded_crcs(path: str | os.PathLike[str], fmt: str, *, progress: Progress | None = None) -> None:
    """Raise CheckpointFormatError naming every tensor of a torch zip or safetensors file whose
    bytes differ from the CRC-32 the file records (every zip record; each tensor in ckptkit's
    ``ckptkit.crc32``); other formats record none, so there is nothing to check.

    Example:
        >>> check_recorded_crcs("model.pt", "torch-zip")  # doctest: +SKIP
    """
    source = os.fspath(path)
    if fmt == HF:
        index = read_index(source)
        for shard in index.shards:
            check_recorded_crcs(index.folder / shard, shard_format(index.path, index.folder, shard), progress=progress)
    elif fmt == ZIP:
        with TorchZip(source) as z:
            pickled = functools.cache(lambda: _stand_ins(z))
            damage = Damage(source, lambda rec: record_tensors(z, pickled(), rec.name))
            for rec in z.records:
                damage.check(rec, rec.crc, record_crc(z, rec, progress))
            damage.raise_if_any()
    elif fmt == SAFETENSORS:
        with open_regular(source) as f:
            header, start = read_header(f, source=source)
            recorded = parse_crcs(header.pop("__metadata__", None) or {}, source)
            damage = Damage(source, lambda name: tensors_named([name]))
            for name, e in header.items():
                if name in recorded:
                    begin, end = e["data_offsets"]
                    damage.check(name, recorded[name], crc_of_range(f, start + begin, end - begin, progress))
        damage.raise_if_any()


def check_written(path: Path, fmt: str, *, dest: Path) -> None:
    """A writer's check of what it wrote to ``path``, before it replaces ``dest``: the structure
    (a safetensors header tiling its data section, a zip directory whose records, storages and
    tensors fit one another, a shard index naming its shards). Payload CRCs are not read again:
    the writers compute them as they write.

    Raises:
        CheckpointWriteError: naming ``dest`` and what failed; nothing is published.

    Example:
        >>> check_written(tmp, "safetensors", dest=Path("model.safetensors"))  # doctest: +SKIP
    """
    try:
        if fmt == HF:
            checks = [c for shard in read_index(path).shards for c in _file_checks(path / shard, SAFETENSORS)]
        else:
            checks = _file_checks(path, fmt)
    except CheckpointFormatError as e:
        checks = [Check("structure", "integrity", False, str(e))]
    refuse_failed(checks, path, dest=dest)


def refuse_failed(checks: list[Check], path: Path, *, dest: Path) -> None:
    """Raise where a writer's own check of ``path`` (what it wrote, to replace ``dest``) failed.

    Raises:
        CheckpointWriteError: naming ``dest`` and what failed; nothing is published.
    """
    failed = [
        f"{c.name}: {c.detail}".replace(str(path), str(dest)) for c in checks if c.kind == "integrity" and not c.ok
    ]
    if failed:
        raise CheckpointWriteError(
            f"cannot write {dest}: what was written fails its own check ({'; '.join(failed)}), so it was not "
            f"published and {dest} is as it was; this is a ckptkit bug, please report it with the command that did it"
        )


def kept_for_check(fmt: str) -> Callable[[], Kept] | None:
    """What :func:`check_written` reads of a ``fmt`` file, for a writer that streams it to a store
    and keeps only that locally (None: the whole file)."""
    kept: dict[str, Callable[[], Kept]] = {SAFETENSORS: HeaderKept, ZIP: RecordsKept}
    return kept.get(fmt)


def _file_checks(path: Path, fmt: str) -> list[Check]:
    if fmt == SAFETENSORS:
        with open(path, "rb") as f:
            return safetensors_checks(f, str(path), full=False)
    if fmt == ZIP:
        with TorchZip(str(path)) as z:  # opening checks the directory and every record's header
            z.read(f"{z.prefix}data.pkl")  # and its pickle's CRC-32, whatever the stand-ins make of it
            try:
                return zip_checks(z, full=False)[0]
            except CheckpointFormatError:  # a pickle the stand-ins do not model: torch's pickler wrote it
                return []
    return []


def _stand_ins(z: TorchZip) -> Any:
    try:
        return tp.loads(z.read(f"{z.prefix}data.pkl"))
    except CheckpointFormatError:  # a global the stand-ins do not model, or data.pkl itself damaged
        return None
