"""Hugging Face shards as detection sees them: a folder holding an index (or, for one shard, the
file ``save_pretrained`` writes without one), or an ``*.index.json`` itself; and what a shard that
an index names may be.

Example:
    >>> from pathlib import Path
    >>> SIGNATURE.matches(Path("model.safetensors.index.json"), b"{")
    True
"""

from __future__ import annotations

from pathlib import Path

from ...errors import CheckpointFormatError
from ..detect import Signature, detect_format, sniff
from ..safetensors.detect import SIGNATURE as SAFETENSORS_SIGNATURE
from ..torchzip.detect import LEGACY_SIGNATURE, ZIP_SIGNATURE

HF = "hf-sharded"  # Hugging Face shards + index (save_pretrained, huggingface_hub.save_torch_state_dict)
# In the order a folder is read: transformers' names, then diffusers' (each model's folder of a
# pipeline, e.g. transformer/, holds diffusion_pytorch_model*). The first is what ckptkit writes.
HF_INDEXES = (
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "diffusion_pytorch_model.safetensors.index.json",
    "diffusion_pytorch_model.bin.index.json",
)
HF_SINGLE = (
    "model.safetensors",
    "pytorch_model.bin",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.bin",
    "adapter_model.safetensors",  # PeftModel.save_pretrained's, in a folder holding no model weights
    "adapter_model.bin",
)


def _matches(p: Path, head: bytes) -> bool:
    if p.is_dir():
        return any((p / name).is_file() for name in (*HF_INDEXES, *HF_SINGLE))
    return p.name.endswith(".index.json")


SIGNATURE = Signature(
    HF,
    "Hugging Face shards (a folder, or its *.index.json)",
    _matches,
    folder=None,  # the folder, or its index file
    looks_for=f"a {' or '.join(HF_INDEXES)} (Hugging Face shards)",
)

# What a shard may be: a file of tensors, whichever library wrote it.
SHARDS = (ZIP_SIGNATURE, LEGACY_SIGNATURE, SAFETENSORS_SIGNATURE)


def shard_format(index: Path, folder: Path, shard: str) -> str:
    """The format of the shard ``shard`` that the index ``index`` names, in ``folder``.

    Raises:
        CheckpointNotFoundError: the shard is missing.
        CheckpointFormatError: it is not a file of tensors (a folder, an index, anything else).
    """
    path = folder / shard
    found = sniff(path, SHARDS)
    if found is not None:
        return found.name
    if path.is_dir() or SIGNATURE.matches(path, b""):  # a folder, or an index (itself)
        raise CheckpointFormatError(f"{index}: shard {shard} is not a file of tensors")
    return detect_format(path, SHARDS)  # raises, saying what the file is not
