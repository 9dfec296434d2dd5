"""torch's checkpoint format, written faster than ``torch.save``: torch's pickling, ckptkit's zip.

``torch.save`` is two jobs: pickling (which storages, what the tensors are) and the zip writer.
The first is torch's own, reused as it is (``torch.serialization._save``, which takes any object
with ``write_record``). The second is ckptkit's ``ZipWriter``: each storage's bytes go to the
file in large writes straight from tensor memory, and their CRC-32 (ISA-L's) is computed on a
second thread during the write, where torch's writer runs a slow CRC after copying. The file is
the format ``torch.load`` reads, memory-mapped or not, with every CRC right.

Where the private ``_save`` is missing or takes other arguments (another torch release), or an
object needs what this writer does not do (``skip_data``), the caller falls back to
``torch.save``.
"""

from __future__ import annotations

import ctypes
import inspect
import pickle
from typing import Any, BinaryIO

import torch

from ...io.fileio import Progress
from .writer import ZipWriter

_PREFIX = "archive/"
_SAVE_PARAMETERS = ["obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record"]


class FallBack(Exception):
    """This object or this torch needs ``torch.save`` itself; nothing useful was written."""


class _Records:
    """What ``torch.serialization._save`` writes to: PyTorchFileWriter's ``write_record``."""

    def __init__(self, writer: ZipWriter, progress: Progress | None) -> None:
        self.writer, self.progress = writer, progress

    def write_record(self, name: str, data: Any, size: int) -> None:
        if isinstance(data, str):
            data = data.encode()
        if isinstance(data, (bytes, bytearray)):
            self.writer.add_bytes(_PREFIX + name, bytes(data[:size]))
            return
        # A CPU UntypedStorage (torch copied any other device's to the CPU): its memory as it is.
        buf = (ctypes.c_ubyte * size).from_address(data.data_ptr()) if size else b""
        self.writer.add_buffer(_PREFIX + name, buf, self.progress)

    def write_record_metadata(self, name: str, size: int) -> None:
        raise FallBack("skip_data")


def save_zip(obj: Any, f: BinaryIO, *, progress: Progress | None = None) -> None:
    """Write ``obj`` to ``f`` in torch's zip format (what ``torch.save(obj, f)`` writes).

    Raises:
        FallBack: use ``torch.save`` (before anything but a partial file was written: the caller
            starts the file again).
    """
    save = getattr(torch.serialization, "_save", None)
    if save is None or list(inspect.signature(save).parameters)[:5] != _SAVE_PARAMETERS:
        raise FallBack("torch.serialization._save is not the one this writer knows")
    alignment = getattr(torch.serialization, "_get_storage_alignment", lambda: 64)()
    writer = ZipWriter(f, alignment=alignment)
    save(obj, _Records(writer, progress), pickle, 2, False)  # protocol 2, as torch.save
    writer.finish_torch_archive(_PREFIX)
    writer.close()
