"""Which checkpoint format a path holds, from its first bytes (and a zip's record names).

Example:
    >>> detect_format("fixtures/ddp.safetensors")  # doctest: +SKIP
    'safetensors'
"""

from __future__ import annotations

import difflib
import os
import struct
import zipfile
from pathlib import Path
from typing import BinaryIO, Literal

from ..errors import PARSE_ERRORS, CheckpointFormatError, CheckpointNotFoundError, UnsupportedCheckpointError

Format = Literal["torch-zip", "torch-legacy", "safetensors", "dcp", "hf-sharded", "deepspeed"]
ZIP: Format = "torch-zip"
LEGACY: Format = "torch-legacy"
SAFETENSORS: Format = "safetensors"
DCP: Format = "dcp"
HF: Format = "hf-sharded"  # Hugging Face shards + index (save_pretrained, huggingface_hub.save_torch_state_dict)
HF_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")  # in the order a folder is read
HF_SINGLE = ("model.safetensors", "pytorch_model.bin")  # what they write, without an index, for one shard
DEEPSPEED: Format = "deepspeed"  # a DeepSpeed ZeRO folder: ``latest`` + tag folder, or the tag folder itself
DCP_METADATA = ".metadata"  # a DCP folder: this file, and the .distcp files it points into


def is_dcp_file(name: str) -> bool:
    """True for a file name torch's DCP writer puts in a checkpoint folder."""
    return name == DCP_METADATA or name.endswith(".distcp")


def deepspeed_tag_folder(p: Path) -> Path | None:
    """The tag folder of a DeepSpeed ZeRO checkpoint at ``p`` (the folder holding ``latest``, or a
    tag folder such as ``global_step3/`` itself), or None where ``p`` is not one.

    Raises:
        CheckpointFormatError: ``latest`` names a tag whose folder is missing or holds no model states.
    """
    latest = p / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        folder = p / tag
        if (
            tag
            and "/" not in tag
            and tag not in (".", "..")
            and folder.is_dir()
            and any(folder.glob("*_model_states.pt"))
        ):
            return folder
        if any(p.glob("*_model_states.pt")):  # a tag folder that happens to hold a file named latest
            return p
        tags = sorted(c.name for c in p.iterdir() if c.is_dir() and any(c.glob("*_model_states.pt")))
        if not tags and not folder.is_dir():
            return None  # a file named latest, and nothing of DeepSpeed's
        hint = f"; give one of its tag folders instead: {', '.join(str(p / t) for t in tags[:3])}" if tags else ""
        raise CheckpointFormatError(
            f"{p}: a DeepSpeed checkpoint folder whose latest file names tag {tag!r}, but "
            f"{folder} is missing or holds no *_model_states.pt{hint}"
        )
    if any(p.glob("*_model_states.pt")) and any(p.glob("*_optim_states.pt")):
        return p
    return None


_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"  # pickle of 0x1950a86a20f9469cfc6c


def check_exists(path: str | os.PathLike[str]) -> Path:
    """Return ``path`` as a Path, or raise CheckpointNotFoundError naming close matches."""
    p = Path(path)
    if p.exists():
        return p
    near: list[str] = []
    if p.parent.is_dir():
        near = difflib.get_close_matches(p.name, [c.name for c in p.parent.iterdir()], n=3, cutoff=0.6)
    hint = f"; similar names there: {', '.join(near)}" if near else ""
    raise CheckpointNotFoundError(f"{p}: no such file{hint}", filename=str(p))


def detect_format(path: str | os.PathLike[str]) -> Format:
    """Return ZIP, LEGACY, SAFETENSORS, DCP, HF or DEEPSPEED for ``path``.

    HF is a folder holding one of ``HF_INDEXES`` (or, for one shard, ``HF_SINGLE``), or such an
    index file itself (``*.index.json``); DEEPSPEED a ZeRO folder (see :func:`deepspeed_tag_folder`).

    Raises:
        CheckpointNotFoundError: nothing is at ``path``.
        UnsupportedCheckpointError: an intact file of a kind ckptkit does not read (a
            TorchScript or torch.export archive).
        CheckpointFormatError: not a checkpoint at all.
    """
    p = check_exists(path)
    if p.is_dir():
        if (p / DCP_METADATA).is_file():
            return DCP
        if any((p / name).is_file() for name in (*HF_INDEXES, *HF_SINGLE)):
            return HF
        if deepspeed_tag_folder(p) is not None:
            return DEEPSPEED
        raise CheckpointFormatError(
            f"{p}: is a folder without a .metadata file (a torch.distributed.checkpoint), a "
            f"{' or '.join(HF_INDEXES)} (Hugging Face shards) or DeepSpeed's latest file and "
            "*_model_states.pt/*_optim_states.pt files; give a file"
        )
    if p.name.endswith(".index.json"):
        return HF
    size = p.stat().st_size
    with open(p, "rb") as f:
        head = f.read(16)
        if size == 0:
            raise CheckpointFormatError(f"{p}: file is empty")
        if head.startswith(b"PK\x03\x04"):
            _refuse_programs(p, f)
            return ZIP
    if head.startswith(_LEGACY_MAGIC):
        return LEGACY
    if len(head) >= 9 and head[8:9] == b"{":
        (n,) = struct.unpack("<Q", head[:8])
        if 8 + n <= size:
            return SAFETENSORS
    raise CheckpointFormatError(
        f"{p}: not a checkpoint ckptkit knows (expected a torch zip or legacy file, safetensors, "
        f"a torch.distributed.checkpoint or DeepSpeed ZeRO folder, or Hugging Face shards' folder or *.index.json; first bytes {head[:8].hex()})"
    )


def _refuse_programs(p: Path, f: BinaryIO) -> None:
    """Raise for the zip archives torch writes for programs rather than checkpoints."""
    try:
        names = zipfile.ZipFile(f).namelist()
    except PARSE_ERRORS:
        return  # damaged: the zip reader says how, with the details
    base = {n.split("/", 1)[1] if "/" in n else n for n in names}
    if "constants.pkl" in base or any(n.startswith("code/") for n in base):
        raise UnsupportedCheckpointError(
            f"{p}: is a TorchScript archive (torch.jit.save): a compiled program, not a checkpoint. "
            f"Load it with torch.jit.load({str(p)!r}) and save its state_dict() to get one"
        )
    # torch 2.6's torch.export.save wrote serialized_exported_program.json, later ones a PT2 archive
    if "archive_format" in base or "models/model.json" in base or "serialized_exported_program.json" in base:
        raise UnsupportedCheckpointError(
            f"{p}: is a torch.export archive (torch.export.save): a program, not a checkpoint. "
            f"Load it with torch.export.load({str(p)!r}) and save .module().state_dict() to get one"
        )
