"""A DeepSpeed ZeRO folder opened as the fp32 state dict ``zero_to_fp32`` rebuilds, its tensors
entries whose bytes are pieces of the ranks' partition records, copied kernel-side, no torch.

Each piece lies inside a zip record whose CRC-32 covers the whole record (a rank's whole fp32
partition, of which one parameter is a slice). So each piece's CRC-32 is computed as it is
copied, and once the output is written (:meth:`RecordDamage.raise_if_any`, which every writer
calls before it publishes) the pieces of each record are combined, the bytes no tensor took
(padding, a rank's share of the next group) CRC'd from the file, and the result held against
the record's CRC-32: a damaged byte fails the output, naming the tensors in that record.

Example:
    >>> src = open_deepspeed("ckpt/")  # doctest: +SKIP
    >>> list(src.obj)[:3], src.description  # doctest: +SKIP
    (['scale', 'seen', 'pos'], 'DeepSpeed ZeRO stage 2, 2 ranks, tag global_step3')
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal

from ...errors import ArgumentError, CheckpointFormatError, spell
from ...io.crcmath import crc32_combine
from ...io.fileio import Progress, copy_range, crc32, crc_of_range, open_regular, pread, write_checked
from ..dtypes import BY_NAME
from ..entry import Entry
from ..integrity import Damage, tensors_named
from ..pickles import reader as tp
from ..producers import Producer
from ..spec import EntryView, Info
from ..torchzip.container import Record, TorchZip
from . import rebuild as rb
from .files import Layout, entry_of, find_layout, read_pickle

ZeroWeights = Literal["fp32", "module"]
_STEP = 8 << 20  # bytes of a buffer read into memory at a time to be upcast


@dataclass(eq=False)
class DsTensor(Entry):
    """One tensor of the rebuilt state dict (tied names share one object): its bytes are the
    pieces of :attr:`spec`, upcast to :attr:`dtype` while copied where the spec says so."""

    name: str
    spec: rb.Spec = field(repr=False)
    src: DsSource = field(repr=False)
    crc = None  # pieces of records: known only once copied
    zip = None
    complete = True

    @property
    def dtype(self) -> str:  # type: ignore[override]
        return self.spec.dtype

    @property
    def shape(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.spec.shape

    @property
    def nbytes(self) -> int:  # type: ignore[override]
        return math.prod(self.spec.shape) * BY_NAME[self.spec.dtype].itemsize

    @property
    def ident(self) -> DsTensor:  # type: ignore[override]
        return self

    storage = ident

    @property
    def storage_size(self) -> int:  # type: ignore[override]
        return self.nbytes

    def write(self, f: BinaryIO, progress: Progress | None = None) -> int:
        return self.src.copy(self, f, progress)


class RecordDamage(Damage):
    """:class:`~..integrity.Damage` of records copied piece by piece: :meth:`seen` each piece's
    CRC-32, and :meth:`raise_if_any` holds each record's combined CRC-32 against its zip's."""

    def __init__(self, src: DsSource) -> None:
        super().__init__(str(src.folder), src.name_record)
        self._src = src
        self._pieces: dict[tuple[int, str], tuple[Record, dict[int, tuple[int, int]]]] = {}
        self.copied: set[tuple[int, str]] = set()  # (file, record): read whole, for its CRC-32

    def seen(self, piece: rb.Piece, crc: int) -> None:
        self.copied.add((piece.file, piece.record.name))
        _, spans = self._pieces.setdefault((piece.file, piece.record.name), (piece.record, {}))
        spans[piece.start - piece.record.data_offset] = (piece.length, crc)

    def raise_if_any(self) -> None:
        for (file, name), (rec, spans) in self._pieces.items():
            self.check((file, name), rec.crc, self._record_crc(self._src.files[file], rec, spans))
        self._pieces.clear()
        super().raise_if_any()

    @staticmethod
    def _record_crc(f: BinaryIO, rec: Record, spans: dict[int, tuple[int, int]]) -> int:
        """The record's CRC-32 from its copied spans and the bytes between them, read now."""
        crc = at = 0
        for start, (length, value) in sorted(spans.items()):
            if start < at:  # overlapping spans: none of zero_to_fp32's tensors do; read the record whole
                return crc_of_range(f, rec.data_offset, rec.size)
            if start > at:
                crc = crc32_combine(crc, crc_of_range(f, rec.data_offset + at, start - at), start - at)
            crc, at = crc32_combine(crc, value, length), start + length
        if at < rec.size:
            crc = crc32_combine(crc, crc_of_range(f, rec.data_offset + at, rec.size - at), rec.size - at)
        return crc


@dataclass
class DsSource(EntryView):
    """An opened ZeRO folder: ``obj``, the rebuilt state dict (name -> :class:`DsTensor`, tied
    names one object), and the open rank files its pieces are read from.

    Attributes:
        folder: the folder given (``path`` too); ``layout``: its tag and rank files.
        stage, world_size: ZeRO's; ``zero_weights``: which weights ``obj`` holds.
    """

    folder: Path
    layout: Layout
    zero_weights: ZeroWeights = "fp32"
    stage: int = 0
    world_size: int = 0
    obj: OrderedDict[str, Any] = field(default_factory=OrderedDict)
    files: list[BinaryIO] = field(default_factory=list)
    paths: list[Path] = field(default_factory=list)
    zips: list[TorchZip] = field(default_factory=list)
    damage: RecordDamage = field(init=False)
    leaf_type = DsTensor

    def __post_init__(self) -> None:
        self.damage = RecordDamage(self)

    @property
    def path(self) -> Path:
        return self.folder

    @property
    def description(self) -> str:
        return f"DeepSpeed ZeRO stage {self.stage}, {self.world_size} rank{'s' * (self.world_size != 1)}, tag {self.layout.tag}"

    @property
    def weights_from(self) -> str:
        """Where the weights are read from, for ``inspect``."""
        if self.zero_weights == "module":
            return f"16-bit module weights of {self.layout.model_files[0].name}"
        return f"fp32 master weights partitioned across {self.world_size} *_optim_states.pt in {self.layout.tag}/"

    @property
    def notes(self) -> list[str]:
        return [f"{self.description}: {self.weights_from}"]

    def describe(self) -> tuple[Info, dict[str, Any], Producer | None]:
        """The rebuilt names, shapes and dtypes, read from the pickles alone; DeepSpeed as the producer."""
        meta = {"deepspeed": self.description, "weights": self.weights_from}
        return self.entry_info, meta, Producer("deepspeed", self.description, notes=[self.weights_from])

    @property
    def nbytes(self) -> int:
        """Source bytes the tensors are copied from (what progress is measured against)."""
        unique = {id(t): t for t in self.obj.values()}.values()
        return sum(p.length for t in unique for p in t.spec.pieces)

    def unread(self) -> list[str]:
        """The rank files' storage records no copy touched (``file:record``), so never checked."""
        return [
            f"{self.paths[i].name}:{rec.name}"
            for i, z in enumerate(self.zips)
            for rec in z.records
            if rec.name.startswith(f"{z.prefix}data/") and (i, rec.name) not in self.damage.copied
        ]

    def close(self) -> None:
        for f in self.files:
            f.close()

    def name_record(self, key: tuple[int, str]) -> str:
        """``tensors a, b (record data/6 of <file>)``: the tensors with bytes in a damaged record."""
        file, record = key
        names = [
            n for n, t in self.obj.items() if any(p.file == file and p.record.name == record for p in t.spec.pieces)
        ]
        return f"{tensors_named(names) if names else 'bytes'} (record {record} of {self.paths[file].name})"

    def copy(self, t: DsTensor, dst: BinaryIO, progress: Progress | None = None) -> int:
        """Append ``t``'s bytes to ``dst``; returns their CRC-32 (of the upcast bytes, if upcast)."""
        crc, spec = 0, t.spec
        for p in spec.pieces:
            if spec.source_dtype == spec.dtype:
                read = copy_range(self.files[p.file], dst, p.start, p.length, progress, crc=True)
                crc = crc32_combine(crc, read, p.length)
            else:
                read, crc = self._upcast(p, spec.source_dtype, dst, crc, progress)
            self.damage.seen(p, read)
        return crc

    def _upcast(self, p: rb.Piece, dtype: str, dst: BinaryIO, crc: int, progress: Progress | None) -> tuple[int, int]:
        """A 16-bit (or float64) buffer's piece as float32, as ``zero_to_fp32``'s ``.float()``:
        (CRC-32 of the bytes read, of the bytes written continued from ``crc``)."""
        read, step = 0, _STEP - _STEP % BY_NAME[dtype].itemsize
        for at in range(0, p.length, step):
            n = min(step, p.length - at)
            data = pread(self.files[p.file], n, p.start + at)
            if len(data) != n:
                raise CheckpointFormatError(f"{self.paths[p.file]}: ended early at byte {p.start + at + len(data)}")
            read = crc32(data, read)
            crc = crc32_combine(crc, write_checked(dst, rb.to_float32(dtype, data)), n * 4 // BY_NAME[dtype].itemsize)
            if progress is not None:
                progress(n)
        return read, crc


def _stage(optim: Any, path: Path) -> int:
    value = entry_of(optim, "zero_stage", path)
    value = value.args[0] if isinstance(value, tp.Call) and value.args else value  # ZeroStageEnum(N)
    if not isinstance(value, int) or value not in (1, 2, 3):
        raise CheckpointFormatError(f"{path}: zero_stage is {value!r}, expected 1, 2 or 3")
    return value


def open_deepspeed(path: str | os.PathLike[str], *, zero_weights: ZeroWeights = "fp32") -> DsSource:
    """Open a ZeRO folder (the one holding ``latest``, or a tag folder): pickles only, no tensor bytes.

    Args:
        path: the checkpoint folder.
        zero_weights: ``"fp32"``: the fp32 state dict ``zero_to_fp32`` rebuilds; ``"module"``:
            the 16-bit ``module`` state dict as saved (stage 1/2 only: stage 3 saves placeholders).

    Raises:
        CheckpointFormatError: files missing, of another checkpoint, or damaged;
        UnsupportedCheckpointError: a layout ckptkit does not model; ArgumentError: ``"module"`` of stage 3.
    """
    if zero_weights not in ("fp32", "module"):
        raise ArgumentError(f"zero_weights must be 'fp32' or 'module', not {zero_weights!r}")
    src = DsSource(Path(path), find_layout(Path(path)), zero_weights)
    try:
        _read(src)
    except BaseException:
        src.close()
        raise
    return src


def _open(src: DsSource, p: Path) -> tuple[int, TorchZip, Any]:
    f = open_regular(p, folder=src.layout.folder)  # owned by the source, closed by its user
    src.files.append(f)
    src.paths.append(p)
    z = TorchZip(p, file=f)
    src.zips.append(z)
    return len(src.files) - 1, z, read_pickle(z)


def _read(src: DsSource) -> None:
    lay = src.layout
    optim = [_open(src, p) for p in lay.optim_files]
    states = [entry_of(o, "optimizer_state_dict", z.path) for _, z, o in optim]
    src.stage = _stage(states[0], lay.optim_files[0])
    count = entry_of(states[0], "partition_count", lay.optim_files[0])
    src.world_size = max(count) if isinstance(count, list) and count else count if isinstance(count, int) else -1
    if src.world_size != len(lay.optim_files):
        raise CheckpointFormatError(
            f"{lay.folder}: expected {src.world_size} *_optim_states.pt files (partition_count), found "
            f"{len(lay.optim_files)}: an old checkpoint overwritten, or a rank did not save; use a complete tag folder"
        )
    need = src.world_size if src.stage == 3 else 1
    if len(lay.model_files) < need:
        raise CheckpointFormatError(
            f"{lay.folder}: ZeRO-{src.stage} needs {need} *_model_states.pt files, found {len(lay.model_files)}"
        )
    models = [_open(src, p) for p in lay.model_files[:need]]
    mfiles, mzips, mobjs = [m[0] for m in models], [m[1] for m in models], [m[2] for m in models]
    if src.zero_weights == "module":
        if src.stage == 3:
            flag = spell("zero_weights='module'", "--zero-weights module")
            raise ArgumentError(
                f"{lay.folder}: is ZeRO-3, whose model-state files hold 0-element placeholders, not the "
                f"16-bit weights; leave out {flag} to rebuild the fp32 weights"
            )
        specs = rb.module_weights(mobjs[0], mzips[0], mfiles[0])
    else:
        specs = rb.buffers(mobjs[0], mzips[0], mfiles[0])
        specs.update(rb.frozen(src.stage, mobjs, mzips, mfiles))
        shapes = entry_of(mobjs[0], "param_shapes", mzips[0].path)
        if not isinstance(shapes, list) or not all(isinstance(g, dict) for g in shapes):
            raise CheckpointFormatError(
                f"{mzips[0].path}: param_shapes is a {type(shapes).__name__}, expected a list of dicts"
            )
        trainable = rb.trainable_3 if src.stage == 3 else rb.trainable_12
        specs.update(trainable(shapes, states, list(lay.optim_files), [z for _, z, _ in optim]))
        for alias, source in (entry_of(mobjs[0], "shared_params", mzips[0].path) or {}).items():
            if source in specs:  # as zero_to_fp32: the alias is the source's very tensor
                specs[alias] = specs[source]
    made: dict[int, DsTensor] = {}
    for name, spec in specs.items():
        src.obj[name] = made.setdefault(id(spec), DsTensor(name, spec, src))


def is_leaf(value: Any) -> bool:
    return isinstance(value, DsTensor)
