"""A DCP folder written out as one file, torch-free: each tensor its chunks' bytes, in order.

The folder is opened by :mod:`.stream` (its tensors as :class:`~.stream.DcpTensor`, the
pieces of ``.distcp`` files they are made of); these writers copy the pieces kernel-side, each
checked against its chunk's CRC-32 while copied, into a torch zip or a safetensors file.

Example:
    >>> src = open_dcp("ckpt.dcp")  # doctest: +SKIP
    >>> write_torch_zip(out, src, src.obj, progress=None)  # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, BinaryIO

from ...errors import ArgumentError, summarize
from ...io.fileio import Progress
from ..dtypes import BY_NAME
from ..rewrite import new_tensor
from ..safetensors import write_with_crcs
from ..torchdump import dumps
from ..zipwrite import ZipWriter
from .stream import DcpSource, DcpTensor, is_leaf


def write_torch_zip(f: BinaryIO, src: DcpSource, obj: Any, progress: Progress | None) -> int:
    """Write ``obj`` (containers with :class:`DcpTensor` leaves) as a torch zip checkpoint."""
    order: list[DcpTensor] = []

    def convert(node: Any) -> Any:
        if isinstance(node, DcpTensor):
            order.append(node)
            return new_tensor(str(len(order) - 1), node.dtype, node.shape)
        if isinstance(node, Mapping):
            return type(node)((k, convert(v)) for k, v in node.items())  # type: ignore[call-arg]
        if isinstance(node, list):
            return [convert(v) for v in node]
        return node

    w = ZipWriter(f, alignment=64)
    prefix = w.start_torch_archive(dumps(convert(obj))[0])
    damage = src.damage()
    for i, t in enumerate(order):
        w.add_written(f"{prefix}data/{i}", t.nbytes, lambda t=t: src.copy(t, f, damage, progress), crc=t.crc)  # type: ignore[misc]
    damage.raise_if_any()
    w.finish_torch_archive(prefix)
    w.close()
    return sum(t.nbytes for t in order)


def write_safetensors(
    f: BinaryIO, src: DcpSource, state: Mapping[str, Any], progress: Progress | None, *, metadata: Mapping[str, str] | None = None
) -> int:
    """Write ``state`` (names -> :class:`DcpTensor`) as safetensors, with ckptkit's CRC-32s and
    ``metadata`` (default ``{"format": "pt"}``)."""
    bad = [f"{k} ({type(v).__name__})" for k, v in state.items() if not is_leaf(v)]
    if bad:
        raise ArgumentError(f"{src.folder}: safetensors holds only tensors; not tensors: {summarize(bad)}")
    entries = []
    for name, t in state.items():
        code = BY_NAME[t.dtype].safetensors
        if code is None:
            raise ArgumentError(f"{src.folder}: tensor {name} has dtype {t.dtype}, which safetensors cannot store; use a .pt output")
        entries.append((name, code, list(t.shape), t.nbytes))
    damage = src.damage()

    def write_data(crcs: dict[str, int]) -> None:
        for name, t in state.items():
            crcs[name] = src.copy(t, f, damage, progress)
        damage.raise_if_any()

    write_with_crcs(f, entries, dict(metadata or {"format": "pt"}), write_data)
    return sum(t.nbytes for t in state.values())
