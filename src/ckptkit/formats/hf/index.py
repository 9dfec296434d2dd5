"""Hugging Face sharded checkpoints: the index, its check against the shards, and the split.

``save_pretrained`` and ``huggingface_hub.save_torch_state_dict`` write shards
``model-00001-of-00003.safetensors`` (or ``pytorch_model-00001-of-00003.bin``, torch zips) and an
index ``model.safetensors.index.json``: ``{"metadata": {"total_size": N, ...}, "weight_map":
{tensor: shard file}}``. Tied tensors are stored once; the index metadata maps each dropped name
to the name kept (``{"head.weight": "embed.weight"}``). The split here is huggingface_hub's
``split_state_dict_into_shards_factory``, step for step, so ckptkit writes the same shards.

Example:
    >>> split([("a", 1, 600), ("b", 2, 600), ("c", 3, 100)], max_shard_size=1000)[0]
    {'model-00001-of-00002.safetensors': ['a'], 'model-00002-of-00002.safetensors': ['b', 'c']}
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import (
    PARSE_ERRORS,
    ArgumentError,
    CheckpointFormatError,
    CheckpointNotFoundError,
    PartialCheckpointError,
    spell,
    summarize,
)
from ...io.fileio import file_size, open_regular, require_regular, small_json
from ..safetensors.codec import read_header
from .detect import HF_INDEXES, HF_SINGLE

SAFETENSORS_PATTERN = "model{suffix}.safetensors"  # huggingface_hub's SAFETENSORS_WEIGHTS_FILE_PATTERN
DEFAULT_MAX_SHARD_SIZE = "5GB"  # huggingface_hub's MAX_SHARD_SIZE
MAX_INDEX_BYTES = 10_000_000  # an index is names only; huggingface_hub refuses larger ones too
_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}  # huggingface_hub's SIZE_UNITS: decimal
SHARD_NAME = re.compile(r"^(?P<stem>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})(?P<ext>\.[^.]+)$")
# Everything save_torch_state_dict may have written in a folder (its own clean-up regex, both patterns).
_NOT_ALIASES = frozenset({"format", "total_size"})  # huggingface_hub's own metadata keys
HF_FILE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|pytorch_model(-\d{5}-of-\d{5})?\.bin)(\.index\.json)?$")


@dataclass
class HfIndex:
    """A parsed index: ``path`` (the .index.json), ``weight_map`` (tensor -> shard file name),
    ``metadata`` (``total_size`` and whatever else the writer put there). ``single``: no index, one
    file (``path``) as huggingface_hub writes a model that fits one shard; its weight map is
    what the file holds (filled by :func:`check_shard_keys` for a pickle)."""

    path: Path
    weight_map: dict[str, str]
    metadata: dict[str, Any]
    single: bool = False

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def shards(self) -> list[str]:
        """Shard file names, in the order the index first names them."""
        return [self.path.name] if self.single else list(dict.fromkeys(self.weight_map.values()))

    def tied(self) -> dict[str, str]:
        """``{dropped name: kept name}`` for tied tensors stored once (huggingface_hub's metadata entries
        naming a tensor the weight map lacks after one it has)."""
        return {
            k: v
            for k, v in self.metadata.items()
            if k not in _NOT_ALIASES and k not in self.weight_map and isinstance(v, str) and v in self.weight_map
        }

    def total_bytes(self) -> int:
        """The index's and every shard's size on disk (missing shards count 0)."""
        paths = {self.path, *(self.folder / s for s in self.shards)}
        return sum(p.stat().st_size for p in paths if p.is_file())


MODULES = "modules.json"  # sentence-transformers: the model's modules, each in a folder ("" the top one)


def weighted_modules(folder: Path) -> list[str]:
    """The module folders a sentence-transformers model's ``modules.json`` names that hold weights
    of their own (``""`` the top folder); [] for any other folder.

    Example:
        >>> weighted_modules(Path("fixtures/frameworks/sentence_transformers/model"))
        ['', '2_Dense']
    """
    modules = small_json(folder / MODULES, limit=MAX_INDEX_BYTES)  # none, or unreadable: read as it is
    found = []
    for module in modules if isinstance(modules, list) else []:
        sub = module.get("path") if isinstance(module, dict) else None
        if isinstance(sub, str) and not Path(sub).is_absolute() and ".." not in Path(sub).parts:
            if any((folder / sub / name).is_file() for name in (*HF_INDEXES, *HF_SINGLE)):
                found.append(sub)
    return found


def index_path(path: str | Path) -> Path:
    """The index of a Hugging Face checkpoint given as its folder or as the index file itself.

    Raises:
        PartialCheckpointError: the folder's weights are in several module folders (a
            sentence-transformers model with a Dense head): read as one, it would be part of them.
    """
    p = Path(path)
    if p.is_dir():
        if len(parts := weighted_modules(p)) > 1:
            files = [
                next(str(p / sub / n) for n in (*HF_INDEXES, *HF_SINGLE) if (p / sub / n).is_file()) for sub in parts
            ]
            raise PartialCheckpointError(
                f"{p} is a sentence-transformers model whose weights are in {len(parts)} module folders "
                f"({', '.join(sub or '.' for sub in parts)}): read as one checkpoint it would be part of the model; "
                f"give one module's weights file instead ({', '.join(files)})"
            )
        for name in (*HF_INDEXES, *HF_SINGLE):
            if (p / name).is_file():
                return p / name
        raise CheckpointFormatError(f"{p}: holds no {' or '.join(HF_INDEXES)}")
    return p


def read_index(path: str | Path) -> HfIndex:
    """Read and check an index (a folder's, or the file): a JSON object whose ``weight_map`` maps
    strings to shard file names in the same folder, each of which exists.

    Raises:
        CheckpointFormatError: naming the index and what is wrong with it.
    """
    p = index_path(path)
    if p.name in HF_SINGLE:
        return _single(p)
    with open_regular(p, folder=p.parent) as f:
        size = file_size(f)
        if size > MAX_INDEX_BYTES:
            raise CheckpointFormatError(
                f"{p}: {size} bytes is too big for a Hugging Face index (at most {MAX_INDEX_BYTES})"
            )
        data = f.read()
    try:
        raw = json.loads(data.decode("utf-8"))
    except PARSE_ERRORS as e:  # RecursionError too: an index nested 100,000 deep
        raise CheckpointFormatError(f"{p}: a Hugging Face index must be JSON ({type(e).__name__}: {e})") from e
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CheckpointFormatError(
            f'{p}: a Hugging Face index is a JSON object whose "weight_map" maps tensor names to shard files'
        )
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        raise CheckpointFormatError(f'{p}: "metadata" is a JSON {type(metadata).__name__}, not an object')
    index = HfIndex(p, weight_map, metadata)
    for shard in index.shards:
        if shard in ("", ".", "..") or "/" in shard or "\\" in shard:  # the shards lie beside their index
            raise CheckpointFormatError(f"{p}: shard {shard!r} is not a file name in the index's folder")
    missing = []
    for shard in index.shards:
        try:
            require_regular(index.folder / shard, folder=index.folder)  # raises for a FIFO, folder, loop ...
        except CheckpointNotFoundError:  # ... and leaves plain absence to be listed with the others
            missing.append(shard)
    if missing:
        raise CheckpointFormatError(f"{p}: names shard(s) missing from {index.folder}: {summarize(missing)}")
    return index


def _single(p: Path) -> HfIndex:
    """The index of a folder holding one file: a safetensors header's names and metadata (where
    huggingface_hub records tied tensors then), or nothing yet for a pickle."""
    if p.suffix != ".safetensors":
        return HfIndex(p, {}, {}, single=True)
    with open_regular(p, folder=p.parent) as f:
        header, _ = read_header(f, source=str(p))
    metadata = header.pop("__metadata__", None) or {}
    return HfIndex(p, dict.fromkeys(header, p.name), metadata, single=True)


def check_shard_keys(index: HfIndex, found: Mapping[str, Sequence[str]]) -> None:
    """Raise unless each shard holds exactly the tensors the index's ``weight_map`` puts in it.

    ``found``: shard file name -> the tensor names it holds.

    Example:
        >>> ix = HfIndex(Path("m.index.json"), {"a": "s1", "b": "s2"}, {})
        >>> check_shard_keys(ix, {"s1": ["a"], "s2": ["b"]})  # agrees: nothing raised
    """
    where = {k: s for s, keys in found.items() for k in keys}
    if index.single:  # no index to disagree with: the file holds what it holds
        index.weight_map = {k: s for k, s in where.items() if k not in index.tied()}
        return
    problems = []
    for key, shard in index.weight_map.items():
        if where.get(key) != shard:
            also = f" (it is in {where[key]})" if key in where else ""
            problems.append(f"missing key {key}: the index puts it in {shard}, which does not hold it{also}")
    problems += [
        f"extra key {k} in {s}: the index does not list it" for k, s in where.items() if k not in index.weight_map
    ]
    held: dict[str, list[str]] = {}
    for shard, keys in found.items():
        for k in keys:
            held.setdefault(k, []).append(shard)
    problems += [f"key {k} is in {len(s)} shards ({', '.join(s)})" for k, s in held.items() if len(s) > 1]
    if problems:
        raise CheckpointFormatError(
            f"{index.path} and its shards disagree: {summarize(problems, 3)}. The folder is incomplete or "
            "mixes two saves; save the model again, or use the index that came with these shards"
        )


_OTHER_INDEXES = 16  # indexes of other names beside a shard that are read to find its own


def shard_note(path: Path) -> str | None:
    """For one shard of a sharded checkpoint (named ``*-0000i-of-0000n.*`` and listed by an index
    beside it), a note saying so; None for any other file."""
    m = SHARD_NAME.match(path.name)
    if m is None:
        return None
    others = sorted(p.name for p in path.parent.glob("*.index.json") if p.name not in HF_INDEXES)
    for name in (*HF_INDEXES, *others[:_OTHER_INDEXES]):  # the usual names first, then any other
        try:
            index = read_index(path.parent / name)
        except (CheckpointFormatError, OSError):
            continue
        if path.name in index.shards:
            held = sum(1 for s in index.weight_map.values() if s == path.name)
            return (
                f"{path.name} is shard {int(m['i'])} of {int(m['n'])} of a sharded checkpoint: it holds {held} of "
                f"the {len(index.weight_map)} tensors its index {index.path} lists; give that index"
                + (f" or {index.folder}" if name in HF_INDEXES else "")  # a folder opens by the usual names only
                + " for the whole model"
            )
    return None


def parse_size(size: int | str) -> int:
    """``max_shard_size`` as bytes: an int, digits, or huggingface_hub's ``"5GB"``/``"500MB"``/``"10KB"``
    (decimal units, as huggingface_hub's ``parse_size_to_int``).

    Example:
        >>> parse_size("5GB"), parse_size("0.5MB"), parse_size(1000)
        (5000000000, 500000, 1000)
    """
    value: float | None = None
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        text = size.strip()
        unit = _UNITS.get(text[-2:].upper(), 1) if not text.isdigit() else 1
        number = text[:-2] if unit != 1 else text
        try:
            value = float(number) * unit
        except ValueError:
            value = None
    if value is None or value < 1 or value != value:
        raise ArgumentError(
            f"max shard size {size!r} is not a size; give bytes or a number with TB, GB, MB or KB "
            f"(decimal, as huggingface_hub), e.g. {spell('max_shard_size=' + repr(DEFAULT_MAX_SHARD_SIZE), '--max-shard-size 5GB')}"
        )
    return int(value)


def split(
    entries: Sequence[tuple[str, Any, int]], *, max_shard_size: int, pattern: str = SAFETENSORS_PATTERN
) -> tuple[dict[str, list[str]], int]:
    """huggingface_hub's split: ``({shard file: names}, total_size)`` for ``(name, storage id, storage
    bytes)`` entries in state-dict order. Tensors go in order into the current shard until the
    next would pass ``max_shard_size``; one bigger than that gets a shard of its own; tensors
    sharing a storage id join the first one's shard and are counted once. One shard is named
    ``pattern`` without a suffix (no index is written then)."""
    groups: dict[Any, list[str]] = {}
    shards: list[dict[str, None]] = []
    current: dict[str, None] = {}
    current_size = total = 0
    for name, storage, size in entries:
        if storage is not None:
            if storage in groups:
                groups[storage].append(name)
                continue
            groups[storage] = [name]
        if size > max_shard_size:
            total += size
            shards.append({name: None})
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = {}, 0
        current[name] = None
        current_size += size
        total += size
    if current:
        shards.append(current)
    for names in groups.values():
        for shard in shards:
            if names[0] in shard:
                shard.update(dict.fromkeys(names))
                break
    if len(shards) == 1:
        return {pattern.format(suffix=""): list(shards[0])}, total
    n = len(shards)
    return {pattern.format(suffix=f"-{i + 1:05d}-of-{n:05d}"): list(s) for i, s in enumerate(shards)}, total


def index_bytes(files: Mapping[str, Sequence[str]], total_size: int, metadata: Mapping[str, str]) -> bytes:
    """The index as huggingface_hub writes it (``json.dump(index, f, indent=2)``)."""
    weight_map = {name: file for file, names in files.items() for name in names}
    return json.dumps({"metadata": {"total_size": total_size, **metadata}, "weight_map": weight_map}, indent=2).encode()


def drop_tied(groups: Mapping[Any, Sequence[str]]) -> dict[str, str]:
    """huggingface_hub's choice among tensors stored once: ``{dropped: kept}``, keeping the first
    name in sorted order of each group of exact aliases (``groups``: storage -> names)."""
    return {
        name: min(names) for names in groups.values() if len(names) > 1 for name in sorted(names) if name != min(names)
    }
