"""torch.distributed.checkpoint folders as detection sees them: a folder holding ``.metadata``
(and the ``.distcp`` files it points into).

Example:
    >>> is_dcp_file("__0_0.distcp"), is_dcp_file("model.safetensors")
    (True, False)
"""

from __future__ import annotations

from ..detect import Signature

DCP = "dcp"
DCP_METADATA = ".metadata"  # a DCP folder: this file, and the .distcp files it points into


def is_dcp_file(name: str) -> bool:
    """True for a file name torch's DCP writer puts in a checkpoint folder."""
    return name == DCP_METADATA or name.endswith(".distcp")


SIGNATURE = Signature(
    DCP,
    "a torch.distributed.checkpoint folder",
    lambda p, head: (p / DCP_METADATA).is_file(),
    folder=True,
    looks_for=f"a {DCP_METADATA} file (a torch.distributed.checkpoint)",
)
