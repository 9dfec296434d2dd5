"""DeepSpeed ZeRO folders as detection sees them: the folder holding ``latest`` and a tag folder,
or a tag folder (``global_step3/``) itself.

Example:
    >>> from pathlib import Path
    >>> deepspeed_tag_folder(Path("."))  # doctest: +SKIP
"""

from __future__ import annotations

from pathlib import Path

from ...errors import CheckpointFormatError
from ..detect import Signature

DEEPSPEED = "deepspeed"


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


SIGNATURE = Signature(
    DEEPSPEED,
    "a DeepSpeed ZeRO folder",
    lambda p, head: deepspeed_tag_folder(p) is not None,
    folder=True,
    looks_for="DeepSpeed's latest file and *_model_states.pt/*_optim_states.pt files",
)
