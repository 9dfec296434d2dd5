"""What ``verify`` reports of Hugging Face shards: each shard checked as a file of its own (check
names prefixed with the shard's), and the index against the tensors the shards hold, read by the
same :func:`~ckptkit.formats.source.open_source` the readers use.

Example:
    >>> [c.name for c in hf_check(Path("fixtures/hf/sharded"), False, None)][-1]  # doctest: +SKIP
    'index matches the shards'
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from ...errors import CheckpointFormatError, CkptkitError
from ...io.fileio import Progress
from ..integrity import Check
from ..pickles.reader import UnsupportedGlobal
from ..safetensors.detect import SAFETENSORS
from ..safetensors.format import check as safetensors_check
from ..source import NeedsTorch, open_source
from ..torchzip.check import legacy_check, zip_check
from ..torchzip.detect import LEGACY, ZIP
from .detect import HF, shard_format
from .index import read_index

# What a shard may be, and how each is checked.
_SHARD_CHECKS = {ZIP: zip_check, SAFETENSORS: safetensors_check, LEGACY: legacy_check}


def hf_check(p: Path, full: bool, progress: Progress | None) -> list[Check]:
    index = read_index(p)
    checks = [Check("index", "integrity", True, f"{len(index.weight_map)} tensors in {len(index.shards)} shard(s)")]
    for shard in index.shards:
        path = index.folder / shard
        try:
            found = _SHARD_CHECKS[shard_format(index.path, index.folder, shard)](path, full, progress)
        except CkptkitError as e:
            found = [Check("structure", "integrity", False, str(e))]
        checks += [dataclasses.replace(c, name=f"{shard}: {c.name}") for c in found]
    name = "index matches the shards"
    try:
        open_source(p, HF).close()  # opens every shard and holds its tensor names against the index
    except NeedsTorch as e:
        return [*checks, Check(name, "integrity", True, f"not compared without torch ({e})")]
    except CheckpointFormatError as e:  # the pickle stand-ins' UnsupportedGlobal included
        ok = isinstance(e, UnsupportedGlobal)
        return [
            *checks,
            Check(name, "integrity", ok, "not compared: a shard needs torch to list its tensors" if ok else str(e)),
        ]
    return [*checks, Check(name, "integrity", True, "each shard holds exactly the tensors the index puts in it")]
