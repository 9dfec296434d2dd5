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
        CheckpointFormatError: ``latest`` names a tag whose folder is missing, holds no model
            states, or cannot exist (a name over 255 bytes).
    """
    latest = p / "latest"
    if latest.is_file():
        tag = latest.read_text(encoding="utf-8", errors="replace").strip()
        folder = p / tag
        try:
            is_dir = bool(tag) and "/" not in tag and tag not in (".", "..") and folder.is_dir()
            unusable = None
        except OSError as e:  # a tag no folder can be named (over 255 bytes): the OS refuses to look
            is_dir, unusable = False, e.strerror or str(e)
        if is_dir and any(folder.glob("*_model_states.pt")):
            return folder
        if any(p.glob("*_model_states.pt")):  # a tag folder that happens to hold a file named latest
            return p
        tags = sorted(c.name for c in p.iterdir() if c.is_dir() and any(c.glob("*_model_states.pt")))
        if not tags and not is_dir and unusable is None:
            return None  # a file named latest, and nothing of DeepSpeed's
        hint = f"; give one of its tag folders instead: {', '.join(str(p / t) for t in tags[:3])}" if tags else ""
        if unusable is not None:
            raise CheckpointFormatError(
                f"{latest}: names tag {_shown(tag)}, which cannot be a folder name ({unusable}); "
                f"expected the name of a tag folder in {p}{hint}"
            )
        # The tag is quoted, never joined to a path: a tag holding a newline would break the one line.
        raise CheckpointFormatError(
            f"{p}: a DeepSpeed checkpoint folder whose latest file names tag {_shown(tag)}, but "
            f"its folder is missing or holds no *_model_states.pt{hint}"
        )
    if any(p.glob("*_model_states.pt")) and any(p.glob("*_optim_states.pt")):
        return p
    return None


def _shown(tag: str) -> str:
    """``tag`` for a one-line message: its start and its length where it is long."""
    return repr(tag) if len(tag) <= 60 else f"{tag[:40]!r}... ({len(tag)} characters)"


SIGNATURE = Signature(
    DEEPSPEED,
    "a DeepSpeed ZeRO folder",
    lambda p, head: deepspeed_tag_folder(p) is not None,
    folder=True,
    looks_for="DeepSpeed's latest file and *_model_states.pt/*_optim_states.pt files",
)
