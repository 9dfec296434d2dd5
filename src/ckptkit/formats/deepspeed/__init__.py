"""DeepSpeed ZeRO (stage 1, 2, 3) checkpoint folders, read without torch or deepspeed.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag) and ``dir/<tag>/``: model-state
files (``module``, 16-bit, or 0-element placeholders under ZeRO-3) and one optimizer-state file
per data-parallel rank holding that rank's partition of the fp32 master weights.
``fixtures/DEEPSPEED_LAYOUT.md`` describes the layout and DeepSpeed's ``zero_to_fp32`` rebuild.

- ``files``: the folder's layout (tag, rank files), its pickles read through inert stand-ins, and
  the refusal of a ZeRO-3 rank file given alone;
- ``rebuild``: ``zero_to_fp32``'s rules, as byte ranges of the partition records;
- ``stream``: :class:`~.stream.DsSource`, the folder as an object tree of entries every writer
  takes, each piece checked against its zip record's CRC-32.
"""

from __future__ import annotations

from pathlib import Path

from ...errors import CheckpointFormatError, summarize
from ...io.fileio import Progress
from ..integrity import Check, record_crc
from ..torchzip.container import TorchZip
from .stream import open_deepspeed


def zero_checks(path: Path, *, full: bool, progress: Progress | None = None) -> list[Check]:
    """What ``verify`` reports of a ZeRO folder: the files ``zero_to_fp32`` reads open and fit
    together, their pickles hold only what the inert reader models, and (``full``) every record
    of those files matches its CRC-32.

    Example:
        >>> [c.name for c in zero_checks(Path("ckpt"), full=False)]  # doctest: +SKIP
        ['DeepSpeed ZeRO layout', 'safe to load']
    """
    try:
        src = open_deepspeed(path)
    except CheckpointFormatError as e:  # UnsupportedCheckpointError (a global it does not model) included
        return [Check("DeepSpeed ZeRO layout", "integrity", False, str(e))]
    try:
        checks = [
            Check(
                "DeepSpeed ZeRO layout",
                "integrity",
                True,
                f"{src.description}; {len(src.obj)} tensors from {src.weights_from}",
            ),
            Check(
                "safe to load",
                "safety",
                True,
                "read inertly: tensors, containers and DeepSpeed's loss scaler, "
                "stage and fragment records; nothing imported or run",
            ),
        ]
        if full:
            bad, count = [], 0
            for file, f in zip(src.paths, src.files, strict=True):
                z = TorchZip(file, file=f)
                for rec in z.records:
                    count += 1
                    if record_crc(z, rec, progress) != rec.crc:
                        bad.append(f"{file.name}:{rec.name}")
            detail = f"damaged: {summarize(bad, 4)}" if bad else f"{count} records of {len(src.paths)} files match"
            checks.append(Check("CRC-32 of every record", "integrity", not bad, detail))
        return checks
    finally:
        src.close()
